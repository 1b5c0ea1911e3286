"""`TrainConfig`: every knob of self-study (synthesis and training), defined once.

The datablock API's schema and validation, the `cartridges train` flags and their help, the
values the worker hands the C++ loop and the config a datablock reports all come from this
model (docs/configuration.md lists it). A field's docstring is its description everywhere."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

Init = Literal["corpus", "spread", "compact", "text"]
Objective = Literal["distill", "next_token", "compact"]
LossWeighting = Literal["step", "token", "row"]
TrainingDtype = Literal["auto", "model", "float32", "bfloat16"]
VerifyTargets = Literal["teacher", "label"]
VerifyStyle = Literal["judge", "correct"]
INITS: tuple[str, ...] = Init.__args__
OBJECTIVES: tuple[str, ...] = Objective.__args__
LOSS_WEIGHTINGS: tuple[str, ...] = LossWeighting.__args__
INITS_FROM_CORPUS = ("corpus", "spread", "compact")  # their KV is of corpus tokens: never more than the corpus has
# The fields the C++ training loop takes (cartridges_core.TrainOptions, same names and defaults).
CORE_TRAINING_FIELDS = ("learning_rate", "anchor", "epochs", "batch_size", "grad_accum", "cosine", "warmup",
                        "layer_scaled_lr", "channel_scaled_lr", "loss_weighting", "seed")


LONG_CORPUS_TOKENS = 8192
"""A corpus longer than this (the default model's context) is trained with the long-corpus plan:
one epoch instead of two, a quarter more conversations (one per 8 corpus tokens), a fifth of
the written conversations yes/no ones, a quarter of the rest fact ones and the others recall
ones (no cloze), and a cartridge that starts from the whole corpus' KV compacted by attention
matching (`default_epochs`, `default_num_samples`, `default_verify_fraction`,
`default_fact_fraction`, `default_cloze_fraction`, `default_init`; docs/experiments.md, "Which
plan should a corpus beyond the context get by default?", "Does the compact initialization hold
on the held-out rulebook under the long-corpus defaults?", "Do recall conversations in place of
cloze ones lift the long-corpus defaults?" and "Do fact conversations beside the recall ones
keep the rulebook's paraphrase questions?")."""

# What a field left None gets, in words (the CLI's help and the docs say it).
DECIDED_FROM_CORPUS = {
    "num_tokens": "an eighth of the corpus, in multiples of 16, at least 64 and at most 1024",
    "num_samples": f"one per 10 corpus tokens, or per 8 for a corpus over {LONG_CORPUS_TOKENS} tokens, "
                   "in batches of 16, at least 128 and at most 8192",
    "quality_samples": "max(8, num_samples / 16), at most 32; 0: no report",
    "epochs": f"2, or 1 for a corpus over {LONG_CORPUS_TOKENS} tokens",
    "verify_fraction": f"0, or 0.2 for a corpus over {LONG_CORPUS_TOKENS} tokens",
    "fact_fraction": f"0, or 0.25 for a corpus over {LONG_CORPUS_TOKENS} tokens",
    "cloze_fraction": f"0.5, or 0 for a corpus over {LONG_CORPUS_TOKENS} tokens",
    "init": f"corpus, or compact for a corpus over {LONG_CORPUS_TOKENS} tokens",
}


def default_quality_samples(num_samples: int) -> int:
    """Held-out conversations when the config leaves it open: max(8, num_samples // 16), at most 32."""
    return min(32, max(8, num_samples // 16))


def default_num_samples(corpus_tokens: int) -> int:
    """Conversations when the config leaves it open: one per 10 corpus tokens, or one per 8
    beyond LONG_CORPUS_TOKENS (where the fact conversations come beside the recall ones rather
    than in their place), in whole batches of 16, at least 128 and at most 8192 (a 2,500-token
    document gets 256; a 16,000-token corpus 2,000; a 100,000-token corpus 8192, about 16 per
    512-token chunk)."""
    per_conversation = 10 if corpus_tokens <= LONG_CORPUS_TOKENS else 8
    return min(8192, max(128, math.ceil(corpus_tokens / per_conversation / 16) * 16))


def default_num_tokens(corpus_tokens: int) -> int:
    """Cartridge length when the config leaves it open: an eighth of the corpus, rounded down
    to a multiple of 16, at least 64 and at most 1024 (a 2,500-token document gets 304, 8.2x
    less KV than itself in context; an 8,192-token one and anything longer 1024)."""
    return min(1024, max(64, corpus_tokens // 8 // 16 * 16))


def default_epochs(corpus_tokens: int) -> int:
    """Passes over the conversations when the config leaves it open: 2, or 1 beyond
    LONG_CORPUS_TOKENS."""
    return 2 if corpus_tokens <= LONG_CORPUS_TOKENS else 1


def default_init(corpus_tokens: int) -> str:
    """Initialization when the config leaves it open: "corpus" (its first tokens), or "compact"
    beyond LONG_CORPUS_TOKENS, where the first tokens are a small part of the corpus."""
    return "corpus" if corpus_tokens <= LONG_CORPUS_TOKENS else "compact"


def default_verify_fraction(corpus_tokens: int) -> float:
    """Share of yes/no ("verify") written conversations when the config leaves it open: 0, or
    0.2 beyond LONG_CORPUS_TOKENS (0.2 of the quarter more conversations there keeps about the
    yes/no conversations of 0.25 of one per 10 tokens)."""
    return 0.0 if corpus_tokens <= LONG_CORPUS_TOKENS else 0.2


def default_fact_fraction(corpus_tokens: int) -> float:
    """Share of fact conversations among the written ones other than verify and topic ones when
    the config leaves it open: 0, or 0.25 beyond LONG_CORPUS_TOKENS (with one conversation per 8
    tokens there, they come beside the recall ones: about as many recall conversations as one
    per 10 tokens gives)."""
    return 0.0 if corpus_tokens <= LONG_CORPUS_TOKENS else 0.25


def default_cloze_fraction(corpus_tokens: int) -> float:
    """Share of cloze among the recall and cloze conversations when the config leaves it open:
    0.5, or 0 (recall only) beyond LONG_CORPUS_TOKENS."""
    return 0.5 if corpus_tokens <= LONG_CORPUS_TOKENS else 0.0


class TrainConfig(BaseModel):
    """A self-study run's settings. Fields left None are decided from the corpus (`for_corpus`);
    unknown fields, wrong types (no strings for numbers, no booleans for integers) and values
    out of range are refused with a pydantic `ValidationError`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True,
                              populate_by_name=True, allow_inf_nan=False)

    # The cartridge
    num_tokens: int | None = Field(None, ge=1)
    """KV tokens of the cartridge (its memory is num_tokens x layers x 2 x kv_heads x head_dim).
    None (the default): an eighth of the corpus, in multiples of 16, at least 64 and at most 1024
    (`default_num_tokens`), which still keeps the KV over 8x smaller than the document in
    context and trained better cartridges than a fixed 256 tokens on every run screened
    (docs/experiments.md, "Do row weighting or a larger cartridge raise the recovered fraction
    over seeds?"). On a corpus beyond the context, 1024 tokens with one epoch scored as 2048 with
    two at half the training time (docs/experiments.md, "Which plan should a corpus beyond the
    context get by default?")."""
    num_frozen: int = Field(1, ge=0)
    """Leading tokens never trained (the attention sink). The default freezes only that first
    token: keeping more of the initialization unchanged (a quarter of the cartridge) lowered
    most of the runs it was tried on (docs/experiments.md, "Does giving each channel its own
    learning rate help, and do warmup or frozen tokens?")."""
    init: Init | None = None
    """Where the cartridge's initial KV comes from: "corpus", the KV cache of the first
    num_tokens tokens of the corpus; "spread", of num_tokens corpus tokens taken as 8 evenly
    spaced runs from all over it; "compact", the KV of the whole corpus compacted to num_tokens
    by attention matching (window by window: `cartridges.selfstudy.compaction`); "text", of an
    unrelated built-in text (repeated as needed).
    None (the default): "corpus", or "compact" for a corpus over LONG_CORPUS_TOKENS tokens
    (`default_init`). On a document that fits the context "spread" started lower and trained to
    a lower figure than "corpus" (docs/experiments.md, "Which learning rate, teacher window and
    initialization suit the tuning document?"). Beyond the context the first tokens are a small
    part of the corpus: under the long-corpus plan "compact" trained the tuning atlas' cartridge
    to 0.55 of the oracle's gain against 0.46 from "corpus", and tied on the held-out rulebook
    (0.55 against 0.54) and almanac (0.46 both, its weakest section 0.29 against 0.19)
    (docs/experiments.md, "Does the compact initialization hold on the held-out rulebook under
    the long-corpus defaults?" and the entry after it)."""
    objective: Objective = "distill"
    """What the cartridge is trained toward: "distill", context distillation on synthetic
    conversations (the method); "next_token", plain next-token loss on windows of the corpus
    (the ablation; no synthesis); "compact", no training at all: the cartridge is the whole
    corpus' KV compacted by attention matching (as `init="compact"`), in minutes where training
    takes an hour on a long corpus. The default is "distill", the method the experiments measure
    (docs/experiments.md, "Does self-study distillation recover a document's facts, and better
    than next-token training?"; "How much does attention-matching compaction recover without
    training?")."""

    # Synthesis
    num_samples: int | None = Field(None, ge=1)
    """Synthetic conversations (or corpus windows for next_token). None (the default): scaled to
    the corpus, one per 10 tokens (one per 8 for a corpus over LONG_CORPUS_TOKENS tokens) in
    batches of 16, at least 128 and at most 8192 (`default_num_samples`); twice as many with
    one epoch did not raise the mean over seeds (docs/experiments.md, "Do twice the
    conversations with one epoch remove the seed variance?")."""
    chunk_tokens: int = Field(512, ge=1)
    """What "A" reads to write its message: the corpus is cut into chunks of this many tokens
    that cover it evenly, one per batch of conversations (longer when there are too few
    batches for such chunks to cover the corpus)."""
    teacher_tokens: int = Field(1024, ge=0)
    """What "B", the teacher, has in context when it answers: the window of at most this many
    corpus tokens that holds the chunk (the whole corpus when it fits; clipped to the model's
    context). Its KV is computed once per window and shared by every batch reading it.
    0: the chunk alone. A teacher reading the whole document trained much worse cartridges
    than the default 1024-token window (docs/experiments.md, "Which learning rate, teacher
    window and initialization suit the tuning document?")."""
    written_fraction: float = Field(1.0, ge=0.0, le=1.0)
    """Share of the conversations written from the chunk itself rather than by A and B: "recall"
    (a sentence's start quoted, the rest asked for) and "cloze" (a number or name blanked out),
    in the shares `cloze_fraction` sets, with the document's own words as the answer, scored by
    the teacher. They carry the facts verbatim and cost no generation. The default, 1, leaves A
    and B out: with the default 135M model their conversations did not help and cost time;
    larger models, which write and answer better, may gain from some, e.g. 0.4
    (docs/experiments.md, "Which changes to synthesis make self-study carry the document's
    facts?")."""
    verify_fraction: float | None = Field(None, ge=0.0, le=1.0)
    """Share of the written conversations that are "verify": a sentence of the chunk as a
    statement, true or (at even odds) with one number or name swapped for another of the
    chunk's, and "Answer yes or no."; the teacher scores "Yes" or "No" with the chunk in
    context. Recall and cloze answers teach the facts as text to go on with; these keep the
    short answers users' yes/no questions want. None (the default): 0.2 for a corpus over
    LONG_CORPUS_TOKENS tokens (of one conversation per 8 tokens: about as many as 0.25 of one
    per 10), where they turned the yes/no questions from a loss into a gain, and 0 up to
    it, where they lowered the two short documents measured (`default_verify_fraction`;
    docs/experiments.md, "Do yes/no conversations stop the cartridge from losing yes/no
    questions?")."""
    verify_targets: VerifyTargets = "teacher"
    """What a "verify" conversation trains toward: "teacher" (the teacher's top-k at "Yes" or
    "No" with the chunk in context) or "label" (the written answer itself, "Yes" for the
    chunk's own sentence and "No" for one with a swapped number or name, with all the mass).
    The default model is near chance on such statements even with the text in context, and
    its cartridges lean to one answer for every yes/no question ("Yes" on the 53K chronicle,
    "No" on the atlas). "teacher" by default: on the tuning atlas the label left the replies
    at chance (10 of 24 right, as before) and the whole where it was (0.74 to 0.73 of the
    oracle's gain) (docs/experiments.md, "Do verify conversations trained toward their label
    teach a cartridge to tell true statements from false?")."""
    verify_style: VerifyStyle = "judge"
    """How a "verify" conversation is made: "judge" (a swap from the chunk itself, answered
    "Yes" or "No") or "correct" (a swap from the whole corpus, or the part being trained,
    preferring a name of as many words, and the answer goes on with the chunk's sentence: 'No.
    The document says: "..."'). Past four contexts most sections under the 0.3 floor are held
    there by one question answered with a sibling of the gold name taken from elsewhere in the
    corpus (docs/experiments.md, "What holds a long corpus' weak sections under the 0.3
    floor?"); "correct" meets such a swapped name with the right one. "judge" until measured
    better (docs/experiments.md, "Do verify conversations that correct a name swapped from
    elsewhere in the corpus lift the weakest sections?")."""
    cloze_fraction: float | None = Field(None, ge=0.0, le=1.0)
    """Share of the written conversations other than "verify" ones that are "cloze"; the rest
    are "recall". A cloze answer is a few tokens, a recall answer up to max_answer_tokens, so
    under the default loss_weighting the recall rows carry most of the signal. None (the
    default): 0.5 (even odds), or 0 for a corpus over LONG_CORPUS_TOKENS tokens
    (`default_cloze_fraction`), where recall in place of cloze doubled how often the corpus'
    text is recited and lifted the tuning atlas from 0.55 to 0.58 of the oracle's gain and the
    held-out rulebook from 0.55 to 0.62, its weakest section from 0.21 to 0.41, and the unseen
    almanac from 0.46 to 0.69, at the cost of the numeric questions on the atlas and the
    rulebook (computed from stated numbers, which cloze rows blank out) and about 28% more
    training tokens (docs/experiments.md, "Do recall conversations in place of cloze ones lift
    the long-corpus defaults?" and the entry after it). A fifth of cloze won back numeric
    questions but not the overall gain on the held-out documents ("Does a fifth of cloze hold
    its tuning gain on the held-out rulebook and almanac?")."""
    topic_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of the written conversations other than "verify" ones that are "topic": a phrase
    of two or three words from a sentence of the chunk named ('What does the document say
    about "crossing cottage"?'), and that sentence with the next one as the answer, scored by
    the teacher. Users ask about a part of a document by words of it; recall cues it by
    where a sentence starts. 0 by default: half of the recall conversations as topic ones left
    both held-out long documents where they were (docs/experiments.md, "Do conversations that
    reach a sentence by words of it lift the long-corpus defaults?")."""
    fact_fraction: float | None = Field(None, ge=0.0, le=1.0)
    """Share of the written conversations other than "verify" and "topic" ones that are
    "fact": a question about one number or name of a sentence of the chunk, written from the
    sentence (its first clause and the one that holds the fact, the fact replaced by "what",
    "how many <noun>", "what year"...), answered with the fact and then the sentence, scored
    by the teacher. Users ask for one fact in their own words and want it first; recall and
    cloze messages quote the sentence. None (the default): 0.25 for a corpus over
    LONG_CORPUS_TOKENS tokens, where they come beside the recall ones (with verify_fraction 0.2
    and one conversation per 8 tokens instead of 10, the recall conversations stay about as
    many): both held-out long documents rose under both seeds, the rulebook from 0.62 to 0.68
    of the oracle's gain and the almanac from 0.65 to 0.72 (two-seed means), for a quarter
    more training time (`default_fact_fraction`; docs/experiments.md, "Do fact conversations
    beside the recall ones keep the rulebook's paraphrase questions?"); 0 up to it. In place
    of recall ones instead, at 0.5 the tuning atlas rose from 0.54 to 0.71 while the held-out
    almanac fell under one seed of two (0.66 to 0.48, its yes/no replies starting with "- "),
    and at 0.25 the held-out rulebook fell (0.62 to 0.60, one section at 0.27), its paraphrase
    questions down under both seeds ("Do questions written from sentences lift the
    long-corpus defaults?" and "Does a quarter of fact conversations lift the long-corpus
    defaults?")."""
    joined_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of the conversations that join two parts of the corpus far apart (their centres
    at least a quarter of it apart, the chunks never overlapping): the message quotes the start of a sentence from each
    and asks for both to go on, word for word, and the teacher reads both chunks. They give
    questions that need two distant parts at once (multi-hop) something to learn from. 0 by
    default: a quarter of joined conversations left the atlas' multi-hop questions where they
    were (docs/experiments.md, "Do joined conversations teach multi-hop questions?")."""
    passages_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of the training conversations the student reads as the chat's `retrieval` option
    serves it: with the corpus' passages that BM25 ranks best for the message (`TRAIN_PASSAGES`
    of them, ~300 tokens each, `cartridges.retrieval`) in a system prompt after the cartridge,
    so that the cartridge also learns to be read beside passages. The teacher's targets are the
    same. Each such conversation costs about four times the training of one without. 0 by
    default: at 0.25 the composed mode's literal answers on the 53K-token chronicle rose to
    retrieval's (0.29 to 0.46 exact, retrieval 0.49) but its yes/no replies leaned to "Yes",
    and on the held-out 16K almanac its exact answers fell (0.35 to 0.30) (docs/experiments.md,
    "Does a cartridge trained to be read beside passages make the composed mode beat retrieval
    alone?")."""
    synthesis_batch_size: int = Field(16, ge=1)
    """Conversations generated together; they share their chunk and window (and their KV)."""
    question_temperature: float = Field(0.6, ge=0.0)
    """Sampling temperature of "A", who writes the user message."""
    answer_temperature: float = Field(0.0, ge=0.0)
    """Temperature of "B", who answers with the window in context (0: greedy)."""
    max_question_tokens: int = Field(48, ge=1)
    """The longest message "A" writes, in tokens."""
    max_answer_tokens: int = Field(128, ge=1)
    """The longest answer "B" writes, in tokens. Longer answers are cut here; an answer that
    ends in a loop (the same words over and over, which small models fall into) is cut where
    the loop starts. Shorter answers with more conversations trained worse
    (docs/experiments.md, "Which changes to synthesis make self-study carry the document's
    facts?")."""
    top_k: int = Field(20, ge=1)
    """Teacher log-probabilities kept per answer token."""
    quality_samples: int | None = Field(None, ge=0)
    """Held-out conversations for the quality report (never trained on; synthesized with
    their own random stream, so they change nothing of the training data). None: max(8,
    num_samples // 16), at most 32; 0: no report. Only for objective "distill"."""

    # Training
    learning_rate: float = Field(2e-2, gt=0.0, validation_alias=AliasChoices("learning_rate", "lr"))
    """Adam's learning rate: its peak, between the warmup and the cosine decay (`lr` is accepted
    as another name for it on input). The higher rates that gained on the tuning documents did not carry over to the held-out ones, so the
    default stays 2e-2 (docs/experiments.md, "Which learning rate, teacher window and
    initialization suit the tuning document?" and "Does giving each layer its own learning
    rate help?")."""
    epochs: int | None = Field(None, ge=1)
    """Passes over the conversations. None (the default): 2, or 1 for a corpus over
    LONG_CORPUS_TOKENS tokens (`default_epochs`). Two gained over one on the short tuning
    document and on the held-out ones under the default seed, and fit in the 10 minutes a
    2,500-token document gets (docs/experiments.md, "Does a second epoch help?"); beyond the
    context one epoch of a 1024-token cartridge scored as two of a 2048-token one at half the
    time (docs/experiments.md, "Which plan should a corpus beyond the context get by
    default?")."""
    batch_size: int = Field(4, ge=1)
    """Conversations per forward/backward."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches per optimizer step. The default, 1, trained better than 2
    (docs/experiments.md, "Where does the seed variance come from, and do token weighting,
    gradient accumulation, tail averaging or a soup remove it?")."""
    cosine: bool = True
    """Cosine decay of the learning rate to 0 over the run (after the warmup)."""
    warmup: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of the run's optimizer steps over which the learning rate rises linearly to lr
    (from lr / W at the first of its W steps). It tempers Adam's first steps, which move every
    value by about the full lr whatever the gradient's noise, but is off (0) by default: 0.1
    lifted one of the two runs nearest their initializations and dropped the other below its
    own (docs/experiments.md, "Does giving each channel its own learning rate help, and do
    warmup or frozen tokens?")."""
    anchor: float = Field(0.0, ge=0.0)
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
    loss_weighting: LossWeighting = "step"
    """How a step's loss is averaged over its conversations' answer tokens. "step": the step's
    mean per token, so within a step a recall answer (128 tokens) outweighs a cloze answer (a
    few) some 60 times. "token": the step's summed loss over the targets of an average step, so
    every token weighs the same across the run. "row": each conversation's mean per token,
    averaged over the step's conversations, so a short answer weighs as much as a long one.
    The default is "step": the other two recovered less on the held-out documents
    (docs/experiments.md, "Where does the seed variance come from, and do token weighting,
    gradient accumulation, tail averaging or a soup remove it?" and "Do row weighting or a
    larger cartridge raise the recovered fraction over seeds?")."""
    training_dtype: TrainingDtype = "auto"
    """The dtype of the forward and backward passes that train the cartridge: "model", the
    model's own; "bfloat16" or "float32", a twin of the model with its weights in that dtype;
    "auto" (the default), "bfloat16" for a float32 model on a device that multiplies bfloat16
    natively (a CPU with AVX-512 BF16 or AMX, a CUDA GPU from compute capability 8.0) and
    "model" anywhere else (`cartridges.training.resolved_training_dtype`; the cartridge records
    the one used). The cartridge's values and Adam's state stay float32 either way, and
    synthesis and the quality report run on the model itself (in bfloat16 training, the
    teacher's attention over its window runs in bfloat16 too where the CPU has AVX-512 BF16). On a CPU with AVX-512 BF16 a
    bfloat16 step takes about a third of the float32 one (the core's bfloat16 attention kernels
    included; benchmarks/README.md, "Training step against plain PyTorch"), and
    the cartridges it trained scored as the float32 ones on the documents measured
    (docs/experiments.md, "Does training in bfloat16 keep a cartridge's quality?"); without
    native support bfloat16 is slower."""
    companion_every: int = Field(3, ge=0)
    """Composition: every companion_every-th conversation is trained with a stand-in for another
    cartridge in front (the KV of unrelated text, as long as this cartridge), as it would be
    when composed with another, so that it keeps working then. Left out when the two would take
    more than half the model's context. 0: never. The default, 3, serves composition by
    concatenation; dropping it saves some training time and changed quality within one run's
    variation (docs/experiments.md, "Is the training-time companion still needed once
    composition is by mixture?")."""
    checkpoint_every: int = Field(0, ge=0)
    """Optimizer steps between checkpoints when train() gets a checkpoint path (0: every 10), and
    always at the end."""
    seed: int = 0
    """Chunks, seed prompts, A's sampling and the batch order all derive from it: the same
    seed on the same model and texts gives the same cartridge."""

    @model_validator(mode="before")
    @classmethod
    def _quality_samples_with_num_samples(cls, data: Any) -> Any:
        """quality_samples left open follows a num_samples that is given (else for_corpus decides).
        The learning rate by both its names is refused: which one was meant is unclear."""
        if isinstance(data, dict):
            for alias, name in field_aliases().items():
                if alias in data and name in data:
                    raise ValueError(f"{name} is given twice (also as {alias})")
        if isinstance(data, dict) and data.get("quality_samples") is None:
            num_samples = data.get("num_samples")
            if isinstance(num_samples, int) and not isinstance(num_samples, bool) and num_samples >= 1:
                data = {**data, "quality_samples": default_quality_samples(num_samples)}
        return data

    @field_validator("*")
    @classmethod
    def _integers_the_core_takes(cls, value: Any, info: ValidationInfo) -> Any:
        """Counts fit the C++ core's 32-bit ones, the seed its 64-bit one: a larger value is a
        clear error here, not an overflow there."""
        if isinstance(value, int) and not isinstance(value, bool):
            low, high = (-(2**63), 2**63 - 1) if info.field_name == "seed" else (-(2**31), 2**31 - 1)
            if value > high:
                raise ValueError(f"Input should be at most {high}")
            if value < low:
                raise ValueError(f"Input should be at least {low}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.num_frozen >= (self.num_tokens or default_num_tokens(0)):
            raise ValueError("num_frozen must be below num_tokens (num_tokens left to the corpus: at least "
                             f"{default_num_tokens(0)})")
        if self.anchor * self.learning_rate >= 1:
            raise ValueError("anchor * learning_rate must be below 1 (the share of the way back per step)")
        return self

    def replace(self, **changes: Any) -> TrainConfig:
        """This config with `changes`, validated like a new one."""
        return type(self).model_validate({**self.model_dump(), **changes})

    def for_corpus(self, corpus_tokens: int) -> TrainConfig:
        """This config with what it leaves to the corpus decided for a corpus of `corpus_tokens`
        tokens: num_tokens, num_samples (and with it quality_samples), epochs, verify_fraction,
        fact_fraction, cloze_fraction and init. A cartridge initialized from corpus tokens
        ("corpus", "spread") is never longer than the corpus. A config decided for a corpus stays
        as it is when decided again for the same one."""
        decided: dict[str, Any] = {}
        init = default_init(corpus_tokens) if self.init is None else self.init
        if init != self.init:
            decided["init"] = init
        if self.epochs is None:
            decided["epochs"] = default_epochs(corpus_tokens)
        if self.verify_fraction is None:
            decided["verify_fraction"] = default_verify_fraction(corpus_tokens)
        if self.cloze_fraction is None:
            decided["cloze_fraction"] = default_cloze_fraction(corpus_tokens)
        if self.fact_fraction is None:
            decided["fact_fraction"] = default_fact_fraction(corpus_tokens)
        num_tokens = default_num_tokens(corpus_tokens) if self.num_tokens is None else self.num_tokens
        if init in INITS_FROM_CORPUS:
            num_tokens = min(num_tokens, max(corpus_tokens, self.num_frozen + 1))
        if num_tokens != self.num_tokens:
            decided["num_tokens"] = num_tokens
        if self.num_samples is None:
            decided["num_samples"] = default_num_samples(corpus_tokens)
        return self.replace(**decided) if decided else self

    def to_dict(self) -> dict[str, Any]:
        """Every field by its name (the API's names: `learning_rate`)."""
        return self.model_dump()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """A config from a stored record: fields it no longer has are dropped (`lr` is read as
        `learning_rate`); its values are checked like a new config's."""
        known = set(cls.model_fields) | set(field_aliases())
        return cls.model_validate({k: v for k, v in d.items() if k in known})


def field_aliases() -> dict[str, str]:
    """The other names fields are read by, alias -> field (`lr` -> `learning_rate`): the
    fields' own validation aliases, for the CLI's flags and for reading records."""
    aliases = {}
    for name, info in TrainConfig.model_fields.items():
        if isinstance(info.validation_alias, AliasChoices):
            aliases.update({a: name for a in info.validation_alias.choices if isinstance(a, str) and a != name})
    return aliases


def field_summaries() -> dict[str, str]:
    """The first sentence of each field's description, for help texts."""
    summaries = {}
    for name, info in TrainConfig.model_fields.items():
        text = " ".join((info.description or "").split())
        summaries[name] = re.split(r"(?<=[.])\s(?=[A-Z\"(])", text, maxsplit=1)[0]
    return summaries


def describe(error: ValidationError) -> str:
    """A ValidationError as one line per problem, each naming its field: "epochs: Input
    should be greater than or equal to 1"."""
    lines = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {message}" if where else message)
    return "; ".join(lines)
