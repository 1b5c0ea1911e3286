"""A tiny random Llama as a Hugging Face directory, for servers that train datablocks in
seconds: `cartridges serve --model DIR` loads it like any real model."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXTS = [
    "The harbor master of Quelmor rings the bell at dawn. Ships leave at noon.",
    "Write a question about the text. Summarize the section. Explain how it works.",
    "You are a helpful assistant. Answer briefly. The document says the bridge is old.",
]

# A training config that synthesizes and trains on the tiny model in well under a second.
TINY_TRAIN_CONFIG = {
    "num_tokens": 8, "num_samples": 8, "chunk_tokens": 24, "teacher_tokens": 48,
    "synthesis_batch_size": 2, "max_question_tokens": 6, "max_answer_tokens": 6, "top_k": 4,
    "epochs": 1, "batch_size": 2,
}

DOCUMENT = (
    "The village of Quelmor keeps three bells. The oldest, Brannick, was cast in 1402 by a smith "
    "named Odo Ferr. The second bell, Lisel, rings only at weddings. The harbor master rings the "
    "third bell at dawn, and ships leave the harbor at noon. "
) * 3


def write_tiny_model(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS * 4 + [DOCUMENT], trainer)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    model.save_pretrained(out)
    wrapper = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                      chat_template=CHATML)
    wrapper.save_pretrained(out)
    return out
