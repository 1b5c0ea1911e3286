"""PEFT CARTRIDGE adapters made as PEFT's own docs say, for the tests of import and export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.tiny_hf_model import DOCUMENT

# PEFT 0.21 reads an attribute that transformers 5 deprecates; nothing of ours.
PEFT_WARNINGS = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def hf_model(model_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_peft_adapter(tiny_dir: Path, tokenizer, out: Path, steps: int = 5):
    """A CARTRIDGE adapter made as PEFT's docs say: initialized from a text's KV, then trained a
    few steps (next-token loss on the text); saved to `out`. Returns the PEFT model and its
    initial prompt embeddings."""
    import peft

    config = peft.CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=12, num_frozen_tokens=1)
    model = peft.get_peft_model(hf_model(tiny_dir), config)
    initial = peft.initialize_kv_prefix_from_text(model, tokenizer, text=DOCUMENT).clone()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    batch = torch.tensor([tokenizer(DOCUMENT)["input_ids"][:40]])
    model.train()
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(str(out))
    return model, initial
