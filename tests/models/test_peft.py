"""Hugging Face PEFT `CARTRIDGE` adapters, out and in (docs/formats.md), proven with the real
libraries on a tiny Llama: our cartridge loaded by `PeftModel.from_pretrained` gives our
engine's next-token distribution; an adapter made and trained by PEFT gives PEFT's own in our
engine; both sides place the prefix's keys at positions 0..p-1 and the prompt after them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import cartridges
from cartridges import Cartridge, CartridgeFileError, TrainConfig
from peft_adapters import PEFT_WARNINGS, hf_model, make_peft_adapter
from server.tiny_hf_model import DOCUMENT, TINY_TRAIN_CONFIG, write_tiny_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = PEFT_WARNINGS

TOL = 1e-4  # the forward's parity tolerance against transformers (tests/engine/test_parity.py)
PROMPTS = ["Who rings the bell?", "The second bell", "Ships leave the harbor at"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-hf"))


@pytest.fixture(scope="module")
def ours(tiny_dir: Path) -> cartridges.Model:
    return cartridges.load_model(tiny_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


def our_logits(model: cartridges.Model, cartridge: Cartridge, tokens: list[int]) -> torch.Tensor:
    return model.native.forward(torch.tensor([tokens]), prefixes=[[cartridge.prefix(model)]])[0]


@torch.no_grad()
def peft_logits(peft_model, tokens: list[int]) -> torch.Tensor:
    return peft_model(input_ids=torch.tensor([tokens])).logits[0]


def test_our_trained_cartridge_loads_in_peft_with_the_same_distribution(tmp_path: Path, tiny_dir: Path,
                                                                         ours: cartridges.Model, tokenizer) -> None:
    config = TrainConfig(**TINY_TRAIN_CONFIG)
    trained = cartridges.train(ours, DOCUMENT, config, progress=False)
    assert trained.num_frozen == 1 and trained.num_tokens == config.num_tokens
    out = trained.to_peft(tmp_path / "adapter", base_model=str(tiny_dir))
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "CARTRIDGE"

    loaded = peft.PeftModel.from_pretrained(hf_model(tiny_dir), str(out)).eval()
    assert loaded.peft_config["default"].num_frozen_tokens == 1
    for text in PROMPTS:
        tokens = tokenizer(text)["input_ids"]
        diff = (our_logits(ours, trained, tokens) - peft_logits(loaded, tokens)).abs().max().item()
        assert diff <= TOL, (text, diff)
    # and back: the same tensors, bit for bit
    back = Cartridge.from_peft(out, ours)
    assert all(torch.equal(a, b) for a, b in zip(back.keys + back.values, trained.keys + trained.values))
    assert back.num_frozen == trained.num_frozen and back.fingerprint == trained.fingerprint


def test_both_sides_place_the_prefix_at_positions_zero_to_p(tmp_path: Path, tiny_dir: Path, ours: cartridges.Model,
                                                           tokenizer) -> None:
    """A cartridge that is the KV of a text's tokens (computed at positions 0..p-1), in front of
    a prompt, equals the text in context before it, in PEFT as in our engine: a prefix placed
    at other positions, or a prompt not starting at p, would differ."""
    document = tokenizer(DOCUMENT)["input_ids"][:20]
    native = ours.native.prefix_from_tokens(torch.tensor(document))
    cartridge = Cartridge([k.clone() for k in native.keys], [v.clone() for v in native.values], num_frozen=1)
    loaded = peft.PeftModel.from_pretrained(hf_model(tiny_dir), str(cartridge.to_peft(tmp_path / "a"))).eval()
    in_context_model = hf_model(tiny_dir)
    for text in PROMPTS:
        tokens = tokenizer(text)["input_ids"]
        with torch.no_grad():
            in_context = in_context_model(input_ids=torch.tensor([document + tokens])).logits[0, len(document):]
        assert (peft_logits(loaded, tokens) - in_context).abs().max().item() <= TOL
        assert (our_logits(ours, cartridge, tokens) - in_context).abs().max().item() <= TOL


def test_a_peft_made_adapter_gives_peft_distribution_in_our_engine(tmp_path: Path, tiny_dir: Path,
                                                                   ours: cartridges.Model, tokenizer) -> None:
    made, initial_embeddings = make_peft_adapter(tiny_dir, tokenizer, tmp_path / "peft")
    imported = Cartridge.from_peft(tmp_path / "peft", ours)
    assert imported.num_tokens == 12 and imported.num_frozen == 1
    initial = peft.PeftModel.from_pretrained(hf_model(tiny_dir), str(tmp_path / "peft")).eval()
    for text in PROMPTS:
        tokens = tokenizer(text)["input_ids"]
        expected = peft_logits(made, tokens)
        assert (peft_logits(initial, tokens) - expected).abs().max().item() <= TOL  # PEFT reloads its own
        assert (our_logits(ours, imported, tokens) - expected).abs().max().item() <= TOL
    # it trained: the trainable tokens moved from the text's KV, the frozen first one did not
    trained_embeddings = made.get_prompt_embedding_to_save("default")
    assert torch.equal(trained_embeddings[0], initial_embeddings[0])
    assert not torch.allclose(trained_embeddings[1:], initial_embeddings[1:])


def test_foreign_or_damaged_adapters_are_clear_errors(tmp_path: Path, ours: cartridges.Model) -> None:
    with pytest.raises(CartridgeFileError, match="adapter_config.json"):
        Cartridge.from_peft(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    with pytest.raises(CartridgeFileError, match="LORA"):
        Cartridge.from_peft(tmp_path)
    good = Cartridge([torch.randn(2, 4, 8)] * 2, [torch.randn(2, 4, 8)] * 2).to_peft(tmp_path / "good")
    config = json.loads((good / "adapter_config.json").read_text())
    (good / "adapter_config.json").write_text(json.dumps({**config, "token_dim": 32}))
    with pytest.raises(CartridgeFileError, match="prompt_embeddings"):
        Cartridge.from_peft(good)
    for bad in ({"num_layers": "two"}, {"num_layers": None}, {"token_dim": -16}, {"num_frozen_tokens": 1.5}):
        (good / "adapter_config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(CartridgeFileError, match="non-negative integer"):
            Cartridge.from_peft(good)
    (good / "adapter_config.json").write_text(json.dumps(config))
    (good / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CartridgeFileError, match="not readable"):
        Cartridge.from_peft(good)
    # a well-formed adapter for another shape of model
    other = Cartridge([torch.randn(3, 4, 8)] * 2, [torch.randn(3, 4, 8)] * 2).to_peft(tmp_path / "other")
    with pytest.raises(CartridgeFileError):
        Cartridge.from_peft(other, ours)
