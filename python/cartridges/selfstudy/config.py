"""`TrainConfig`: every knob of self-study (synthesis and training), with its default."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

INITS = ("corpus", "text")
OBJECTIVES = ("distill", "next_token")


def default_quality_samples(num_samples: int) -> int:
    """Held-out conversations when the config leaves it open: max(8, num_samples // 16), at most 32."""
    return min(32, max(8, num_samples // 16))


@dataclass
class TrainConfig:
    # The cartridge
    num_tokens: int = 256
    """KV tokens of the cartridge (its memory is num_tokens x layers x 2 x kv_heads x head_dim)."""
    num_frozen: int = 1
    """Leading tokens never trained (the attention sink)."""
    init: str = "corpus"
    """"corpus": the KV cache of the first num_tokens tokens of the corpus; "text": of an
    unrelated built-in text (repeated as needed)."""
    objective: str = "distill"
    """"distill": context distillation on synthetic conversations (the method);
    "next_token": plain next-token loss on windows of the corpus (the ablation; no synthesis)."""

    # Synthesis
    num_samples: int = 256
    """Synthetic conversations (or corpus windows for next_token)."""
    chunk_min_tokens: int = 512
    chunk_max_tokens: int = 4096
    """Each batch of conversations sees one random window of the corpus of a length drawn in
    [chunk_min_tokens, chunk_max_tokens], clipped to what the model's context leaves."""
    synthesis_batch_size: int = 16
    """Conversations generated together; they share their chunk (and its KV)."""
    question_temperature: float = 0.6
    """Sampling temperature of "A", who writes the user message."""
    answer_temperature: float = 0.0
    """Temperature of "B", who answers with the chunk in context (0: greedy)."""
    max_question_tokens: int = 64
    max_answer_tokens: int = 192
    top_k: int = 20
    """Teacher log-probabilities kept per answer token."""
    quality_samples: int | None = None
    """Held-out conversations for the quality report (never trained on; synthesized with
    their own random stream, so they change nothing of the training data). None: max(8,
    num_samples // 16), at most 32; 0: no report. Only for objective "distill"."""

    # Training
    lr: float = 2e-2
    epochs: int = 1
    batch_size: int = 4
    """Conversations per forward/backward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    cosine: bool = False
    """Cosine decay of the learning rate to 0 over the run."""
    checkpoint_every: int = 0
    """Optimizer steps between checkpoints when train() gets a checkpoint path (0: only at the end)."""
    seed: int = 0
    """Chunks, seed prompts, A's sampling and the batch order all derive from it: the same
    seed on the same model and texts gives the same cartridge."""

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        for name in ("num_tokens", "num_samples", "chunk_min_tokens", "synthesis_batch_size",
                     "max_question_tokens", "max_answer_tokens", "top_k", "epochs", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.chunk_max_tokens < self.chunk_min_tokens:
            raise ValueError("chunk_max_tokens must be >= chunk_min_tokens")
        if not 0 <= self.num_frozen < self.num_tokens:
            raise ValueError("num_frozen must be in [0, num_tokens)")
        if self.lr <= 0:
            raise ValueError("lr must be positive")
        if self.quality_samples is None:
            self.quality_samples = default_quality_samples(self.num_samples)
        if isinstance(self.quality_samples, bool) or not isinstance(self.quality_samples, int) or self.quality_samples < 0:
            raise ValueError("quality_samples must be a non-negative integer (0: no quality report)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
