"""`TrainConfig`: every knob of self-study (synthesis and training), with its default."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

INITS = ("corpus", "spread", "text")
INITS_FROM_CORPUS = ("corpus", "spread")  # their KV is of corpus tokens: never more than the corpus has
OBJECTIVES = ("distill", "next_token")
LOSS_WEIGHTINGS = ("step", "token", "row")


def default_quality_samples(num_samples: int) -> int:
    """Held-out conversations when the config leaves it open: max(8, num_samples // 16), at most 32."""
    return min(32, max(8, num_samples // 16))


def default_num_samples(corpus_tokens: int) -> int:
    """Conversations when the config leaves it open: one per 10 corpus tokens, in whole batches
    of 16, at least 128 and at most 8192 (a 2,500-token document gets 256; a 100,000-token
    corpus 8192, about 16 per 512-token chunk)."""
    return min(8192, max(128, math.ceil(corpus_tokens / 10 / 16) * 16))


def default_num_tokens(corpus_tokens: int) -> int:
    """Cartridge length when the config leaves it open: an eighth of the corpus, rounded down
    to a multiple of 16, at least 64 and at most 2048 (a 2,500-token document gets 304, 8.2x
    less KV than itself in context; a 100,000-token corpus 2048)."""
    return min(2048, max(64, corpus_tokens // 8 // 16 * 16))


@dataclass
class TrainConfig:
    # The cartridge
    num_tokens: int | None = None
    """KV tokens of the cartridge (its memory is num_tokens x layers x 2 x kv_heads x head_dim).
    None (the default): an eighth of the corpus, in multiples of 16, at least 64 and at most 2048
    (`default_num_tokens`), which still keeps the KV over 8x smaller than the document in
    context and trained better cartridges than a fixed 256 tokens on every run screened
    (docs/experiments.md, "Do row weighting or a larger cartridge raise the recovered fraction
    over seeds?")."""
    num_frozen: int = 1
    """Leading tokens never trained (the attention sink). The default freezes only that first
    token: keeping more of the initialization unchanged (a quarter of the cartridge) lowered
    most of the runs it was tried on (docs/experiments.md, "Does giving each channel its own
    learning rate help, and do warmup or frozen tokens?")."""
    init: str = "corpus"
    """Where the cartridge's initial KV comes from: "corpus", the KV cache of the first
    num_tokens tokens of the corpus; "spread", of num_tokens corpus tokens taken as 8 evenly
    spaced runs from all over it; "text", of an unrelated built-in text (repeated as needed).
    The default is "corpus": "spread" started lower and trained to a lower figure
    (docs/experiments.md, "Which learning rate, teacher window and initialization suit the
    tuning document?")."""
    objective: str = "distill"
    """What the cartridge is trained toward: "distill", context distillation on synthetic
    conversations (the method); "next_token", plain next-token loss on windows of the corpus
    (the ablation; no synthesis). The default is "distill", the method the experiments measure
    (docs/experiments.md, "Does self-study distillation recover a document's facts, and better
    than next-token training?")."""

    # Synthesis
    num_samples: int | None = None
    """Synthetic conversations (or corpus windows for next_token). None (the default): scaled to
    the corpus, one per 10 tokens in batches of 16, at least 128 and at most 8192
    (`default_num_samples`); twice as many with one epoch did not raise the mean over seeds
    (docs/experiments.md, "Do twice the conversations with one epoch remove the seed
    variance?")."""
    chunk_tokens: int = 512
    """What "A" reads to write its message: the corpus is cut into chunks of this many tokens
    that cover it evenly, one per batch of conversations (longer when there are too few
    batches for such chunks to cover the corpus)."""
    teacher_tokens: int = 1024
    """What "B", the teacher, has in context when it answers: the window of at most this many
    corpus tokens that holds the chunk (the whole corpus when it fits; clipped to the model's
    context). Its KV is computed once per window and shared by every batch reading it.
    0: the chunk alone. A teacher reading the whole document trained much worse cartridges
    than the default 1024-token window (docs/experiments.md, "Which learning rate, teacher
    window and initialization suit the tuning document?")."""
    written_fraction: float = 1.0
    """Share of the conversations written from the chunk itself rather than by A and B: "recall"
    (a sentence's start quoted, the rest asked for) and "cloze" (a number or name blanked out),
    half each, with the document's own words as the answer, scored by the teacher. They carry
    the facts verbatim and cost no generation. The default, 1, leaves A and B out: with the
    default 135M model their conversations did not help and cost time; larger models, which
    write and answer better, may gain from some, e.g. 0.4 (docs/experiments.md, "Which
    changes to synthesis make self-study carry the document's facts?")."""
    synthesis_batch_size: int = 16
    """Conversations generated together; they share their chunk and window (and their KV)."""
    question_temperature: float = 0.6
    """Sampling temperature of "A", who writes the user message."""
    answer_temperature: float = 0.0
    """Temperature of "B", who answers with the window in context (0: greedy)."""
    max_question_tokens: int = 48
    """The longest message "A" writes, in tokens."""
    max_answer_tokens: int = 128
    """The longest answer "B" writes, in tokens. Longer answers are cut here; an answer that
    ends in a loop (the same words over and over, which small models fall into) is cut where
    the loop starts. Shorter answers with more conversations trained worse
    (docs/experiments.md, "Which changes to synthesis make self-study carry the document's
    facts?")."""
    top_k: int = 20
    """Teacher log-probabilities kept per answer token."""
    quality_samples: int | None = None
    """Held-out conversations for the quality report (never trained on; synthesized with
    their own random stream, so they change nothing of the training data). None: max(8,
    num_samples // 16), at most 32; 0: no report. Only for objective "distill"."""

    # Training
    lr: float = 2e-2
    """Adam's learning rate (its peak, between the warmup and the cosine decay). The higher
    rates that gained on the tuning documents did not carry over to the held-out ones, so the
    default stays 2e-2 (docs/experiments.md, "Which learning rate, teacher window and
    initialization suit the tuning document?" and "Does giving each layer its own learning
    rate help?")."""
    epochs: int = 2
    """Passes over the conversations. The default, 2, gained over one on the tuning document and
    on the held-out documents under the default seed, and fits in the 10 minutes a
    2,500-token document gets (docs/experiments.md, "Does a second epoch help?")."""
    batch_size: int = 4
    """Conversations per forward/backward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step. The default, 1, trained better than 2
    (docs/experiments.md, "Where does the seed variance come from, and do token weighting,
    gradient accumulation, tail averaging or a soup remove it?")."""
    cosine: bool = True
    """Cosine decay of the learning rate to 0 over the run (after the warmup)."""
    warmup: float = 0.0
    """Share of the run's optimizer steps over which the learning rate rises linearly to lr
    (from lr / W at the first of its W steps). It tempers Adam's first steps, which move every
    value by about the full lr whatever the gradient's noise, but is off (0) by default: 0.1
    lifted one of the two runs nearest their initializations and dropped the other below its
    own (docs/experiments.md, "Does giving each channel its own learning rate help, and do
    warmup or frozen tokens?")."""
    anchor: float = 0.0
    """Pull toward the initialization: after each optimizer step every trained KV value moves
    lr × anchor of the way back to where it started (0: none). Off by default: it pulls every
    run toward its initialization, lifting a failing run but lowering most good ones, for no
    gain on average (docs/experiments.md, "Does anchoring training to the initialization
    help?", screened with one lr for all layers)."""
    layer_scaled_lr: bool = True
    """Each layer's keys (and values) step at lr × their initial RMS / the RMS of all the
    cartridge's keys (values), so every layer moves by the same share of its size. On by
    default: with one lr for all layers (False) the smallest values, layer 0's, end training
    far from where they started, and scaled steps were better on most runs
    (docs/experiments.md, "Does giving each layer its own learning rate help?")."""
    channel_scaled_lr: bool = True
    """With layer_scaled_lr, finer: each channel of the keys (values), a layer's head and
    dimension, steps at lr × its initial RMS over the tokens / the RMS of all the cartridge's keys
    (values). No effect without layer_scaled_lr; on by default because channels within a head
    differ in size many times over, and per-channel steps gained on every tuning run and
    put every run above its initialization (docs/experiments.md, "Does giving each channel its
    own learning rate help, and do warmup or frozen tokens?")."""
    loss_weighting: str = "step"
    """How a step's loss is averaged over its conversations' answer tokens. "step": the step's
    mean per token, so within a step a recall answer (128 tokens) outweighs a cloze answer (a
    few) some 60 times. "token": the step's summed loss over the targets of an average step, so
    every token weighs the same across the run. "row": each conversation's mean per token,
    averaged over the step's conversations, so a short answer weighs as much as a long one.
    The default is "step": the other two recovered less on the held-out documents
    (docs/experiments.md, "Where does the seed variance come from, and do token weighting,
    gradient accumulation, tail averaging or a soup remove it?" and "Do row weighting or a
    larger cartridge raise the recovered fraction over seeds?")."""
    companion_every: int = 3
    """Composition: every companion_every-th conversation is trained with a stand-in for another
    cartridge in front (the KV of unrelated text, as long as this cartridge), as it would be
    when composed with another, so that it keeps working then. Left out when the two would take
    more than half the model's context. 0: never. The default, 3, serves composition by
    concatenation; dropping it saves some training time and changed quality within one run's
    variation (docs/experiments.md, "Is the training-time companion still needed once
    composition is by mixture?")."""
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
        for name in ("chunk_tokens", "synthesis_batch_size",
                     "max_question_tokens", "max_answer_tokens", "top_k", "epochs", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.num_samples is not None and (isinstance(self.num_samples, bool) or self.num_samples < 1):
            raise ValueError("num_samples must be at least 1 (or None: scaled to the corpus)")
        if not 0.0 <= self.written_fraction <= 1.0:
            raise ValueError("written_fraction must be in [0, 1]")
        if self.companion_every < 0:
            raise ValueError("companion_every must be non-negative (0: never)")
        if self.teacher_tokens < 0:
            raise ValueError("teacher_tokens must be non-negative (0: the teacher sees the chunk alone)")
        if self.num_tokens is not None and (isinstance(self.num_tokens, bool) or self.num_tokens < 1):
            raise ValueError("num_tokens must be at least 1 (or None: scaled to the corpus)")
        if not 0 <= self.num_frozen < (self.num_tokens or default_num_tokens(0)):
            raise ValueError("num_frozen must be in [0, num_tokens) (num_tokens left to the corpus: at least "
                             f"{default_num_tokens(0)})")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {self.loss_weighting!r}")
        if self.lr <= 0:
            raise ValueError("lr must be positive")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError("warmup must be in [0, 1) (a share of the run's steps)")
        if not 0 <= self.anchor * self.lr < 1:
            raise ValueError("anchor must be >= 0, and anchor * lr < 1 (the share of the way back per step)")
        if self.quality_samples is None and self.num_samples is not None:
            self.quality_samples = default_quality_samples(self.num_samples)
        # With num_samples left to the corpus, quality_samples is decided with it (for_corpus).
        quality = self.quality_samples
        if quality is not None and (isinstance(quality, bool) or not isinstance(quality, int) or quality < 0):
            raise ValueError("quality_samples must be a non-negative integer (0: no quality report)")

    def for_corpus(self, corpus_tokens: int) -> TrainConfig:
        """This config with what it leaves to the corpus decided for a corpus of `corpus_tokens`
        tokens: num_tokens, and num_samples (and with it quality_samples). A cartridge
        initialized from corpus tokens ("corpus", "spread") is never longer than the corpus."""
        decided: dict[str, Any] = {}
        num_tokens = default_num_tokens(corpus_tokens) if self.num_tokens is None else self.num_tokens
        if self.init in INITS_FROM_CORPUS:
            num_tokens = min(num_tokens, max(corpus_tokens, self.num_frozen + 1))
        if num_tokens != self.num_tokens:
            decided["num_tokens"] = num_tokens
        if self.num_samples is None:
            decided["num_samples"] = default_num_samples(corpus_tokens)
        return dataclasses.replace(self, **decided) if decided else self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def field_summaries() -> dict[str, str]:
    """The first sentence of each TrainConfig field's docstring (the string under the field in
    this file), for help texts; {} where the source cannot be read."""
    try:
        body = ast.parse(inspect.getsource(TrainConfig)).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return {}
    summaries = {}
    for field, doc in zip(body, body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)):
            text = " ".join(doc.value.value.split())
            summaries[field.target.id] = re.split(r"(?<=[.])\s(?=[A-Z\"(])", text, maxsplit=1)[0]
    return summaries
