"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading
the same GGUF file."""

from __future__ import annotations

import pytest
import torch
import transformers

import cartridges
from cartridges.models import default_model_path

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colors."}],
    [{"role": "user", "content": "Write one sentence about rivers."}],
]


@pytest.fixture(scope="module")
def ours():
    return cartridges.load_model()


@pytest.fixture(scope="module")
def theirs():
    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_logits_match_transformers(ours, theirs):
    prompt = ours.encode_chat(CHATS[1])
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        expected = theirs(tokens).logits
    got = ours.core.forward(tokens)
    assert (got - expected).abs().max().item() <= 1e-3


def test_greedy_generation_matches_transformers(ours, theirs):
    for chat in CHATS:
        prompt = ours.encode_chat(chat)
        with torch.no_grad():
            expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        got = ours.generate([prompt], max_new_tokens=32, stop_token_ids=[])[0]
        assert got.tokens == expected, ours.tokenizer.decode(got.tokens)


def test_batch_equals_each_alone(ours):
    prompts = [ours.encode_chat(chat) for chat in CHATS]
    assert len({len(p) for p in prompts}) == len(prompts)  # really ragged
    batched = ours.generate(prompts, max_new_tokens=24)
    for prompt, result in zip(prompts, batched):
        assert result.tokens == ours.generate([prompt], max_new_tokens=24)[0].tokens


def test_chat_answers_and_streams(ours):
    reply = ours.chat(CHATS[0], max_tokens=24)
    assert "Paris" in reply
    streamed = "".join(ours.stream_chat(CHATS[0], max_tokens=24))
    assert streamed == reply
