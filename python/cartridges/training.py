"""`train()`: self-study from texts to a `Cartridge`, with a progress bar."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

import cartridges_core

from .cartridge import Cartridge, native_model, model_fingerprint
from .quality import copy_params, quality_report
from .selfstudy import Corpus, TrainConfig, next_token_data, synthesize, training_data
from .selfstudy.config import CORE_TRAINING_FIELDS, INITS_FROM_CORPUS
from .selfstudy.checkpoint import ConversationLog
from .selfstudy.prompts import UNRELATED_TEXT
from .selfstudy.chunking import part_of
from .selfstudy.precision import multiplies_bfloat16_natively, resolved_training_dtype
from .selfstudy.synthesize import fitting, signal_by_part, student_passages


def unrelated_tokens(model: Any, n: int) -> list[int]:
    """`n` tokens of text unrelated to any corpus (repeated as needed)."""
    unrelated = model.tokenizer.encode(UNRELATED_TEXT)
    return (unrelated * (n // len(unrelated) + 1))[:n]


def spread_tokens(corpus: Corpus, n: int, pieces: int = 8) -> list[int]:
    """`n` corpus tokens from all over it: `pieces` evenly spaced runs, the first at its start."""
    if len(corpus) <= n:
        return list(corpus.tokens)
    lengths = [n // pieces + (i < n % pieces) for i in range(pieces)]
    starts = [round(i * (len(corpus) - lengths[i]) / (pieces - 1)) for i in range(pieces)]
    return [t for start, length in zip(starts, lengths) for t in corpus.tokens[start : start + length]]


def init_params(model: Any, corpus: Corpus, config: TrainConfig,
                on_window: Callable[[int, int], object] | None = None) -> cartridges_core.CartridgeParams:
    """The trainable prefix before training: the KV of the first `num_tokens` corpus tokens
    (fewer when the corpus is shorter), of `num_tokens` tokens spread over it ("spread"), the
    whole corpus' KV compacted by attention matching ("compact", `on_window(done, total)` after
    each of its windows), or of unrelated text repeated to `num_tokens`."""
    config = config.for_corpus(len(corpus))  # what it leaves open (init, num_tokens), as training decides it
    length = min(config.num_tokens, len(corpus)) if config.init in INITS_FROM_CORPUS else config.num_tokens
    if length <= config.num_frozen:
        raise ValueError(f"a cartridge needs more than num_frozen={config.num_frozen} tokens; it would have {length}")
    if config.init == "compact":
        from .selfstudy.compaction import compact_prefix

        prefix = compact_prefix(native_model(model), list(corpus.tokens), config.num_tokens, on_window=on_window)
    else:
        if config.init == "corpus":
            tokens = corpus.tokens[: config.num_tokens]
        elif config.init == "spread":
            tokens = spread_tokens(corpus, config.num_tokens)
        else:
            tokens = unrelated_tokens(model, config.num_tokens)
        prefix = native_model(model).prefix_from_tokens(torch.tensor(tokens, dtype=torch.long))
    return cartridges_core.CartridgeParams(prefix, config.num_frozen)


def companion_fits(native: Any, config: TrainConfig, params: cartridges_core.CartridgeParams) -> bool:
    """Whether conversations are trained behind a companion (config.companion_every): only when
    the two prefixes take at most half the model's context, leaving the rest to conversations
    (a cartridge that long is not meant to be composed)."""
    return bool(config.companion_every) and 4 * params.num_tokens <= native.config.max_position_embeddings


def train_options(config: TrainConfig) -> cartridges_core.TrainOptions:
    """The C++ loop's options from the config's training fields (companion and checkpoint apart)."""
    options = cartridges_core.TrainOptions()
    for name in CORE_TRAINING_FIELDS:
        setattr(options, name, getattr(config, name))
    return options


class TrainingCancelled(Exception):
    """train() was cancelled during synthesis, before any training: there is no cartridge."""


def prepare_data(
    model: Any,
    corpus: Corpus,
    config: TrainConfig,
    prefix_tokens: int,
    on_progress: Callable[[str, int, int], object] | None = None,
    **checkpointing: Any,
) -> cartridges_core.TrainingData:
    """The training data for `config.objective`: `prepare_datasets`'s first half, without
    making held-out conversations (the training data is the same either way).
    `checkpointing`: `prepare_datasets`'s synthesis_checkpoint, resume and cancel."""
    config = config.for_corpus(len(corpus)).replace(quality_samples=0)
    return prepare_datasets(model, corpus, config, prefix_tokens, on_progress, **checkpointing)[0]


class Datasets(NamedTuple):
    data: cartridges_core.TrainingData
    held_out: cartridges_core.TrainingData | None
    signal_by_part: list[float] | None  # `synthesize.signal_by_part` of the training conversations
    held_out_parts: list[int] | None  # per held-out row, the tenth of the corpus its chunk is in


def prepare_datasets(
    model: Any,
    corpus: Corpus,
    config: TrainConfig,
    prefix_tokens: int,
    on_progress: Callable[[str, int, int], object] | None = None,
    *,
    synthesis_checkpoint: Path | None = None,
    resume: bool = False,
    cancel: cartridges_core.CancelToken | None = None,
) -> Datasets:
    """The training data for `config.objective`: self-study conversations with the teacher's
    top-k (distill), or windows of the corpus (next_token); where in the corpus the training
    signal comes from (the share per tenth; None for next_token); and the held-out data of the
    quality report: `config.quality_samples` more conversations made in the same synthesis
    run from their own random stream, never trained on (None when quality_samples is 0 or the
    objective is next_token). With `synthesis_checkpoint`, the conversations so far (training
    ones first, then held-out ones) are saved after each batch (and `resume` continues from
    them); `cancel` is checked between batches (TrainingCancelled). `config` is decided for
    the corpus already (`TrainConfig.for_corpus`)."""
    if config.num_tokens is None or config.num_samples is None:
        raise ValueError("prepare_datasets needs a config decided for the corpus: config.for_corpus(len(corpus))")
    if config.objective == "distill":
        report = (lambda done, total: on_progress("synthesis", done, total)) if on_progress else None
        log = ConversationLog(synthesis_checkpoint, resume) if synthesis_checkpoint is not None else None
        done = log.conversations if log is not None else []

        def after_batch(conversations: list[Any]) -> None:
            if log is not None:
                log.append(conversations[log.count :])  # the batch just made
            if cancel is not None and cancel.cancelled:
                raise TrainingCancelled("cancelled during synthesis")

        conversations = synthesize(model, corpus, config, report, done=done, on_batch=after_batch,
                                   held_out=config.quality_samples or 0)
        train_part, held_part = conversations[: config.num_samples], conversations[config.num_samples :]
        # Held out means never trained on: a written conversation (recall, cloze) can come out
        # the same as a training one when both quote the same sentence; such ones are dropped.
        seen = {(c.question, tuple(c.answer)) for c in train_part}
        held_part = [c for c in held_part if (c.question, tuple(c.answer)) not in seen]
        held_part = fitting(model, held_part, prefix_tokens)  # none fits next to the cartridge: no report
        held_out = training_data(model, held_part, prefix_tokens) if held_part else None
        # (Conversations of a synthesis checkpoint from before chunk spans were kept have none.)
        known = held_part and all(c.chunk_span[1] > 0 for c in held_part)
        parts = [part_of(c.chunk_span, len(corpus)) for c in held_part] if known else None
        passages = student_passages(model.tokenizer, corpus, train_part, config)
        return Datasets(training_data(model, train_part, prefix_tokens, passages), held_out,
                        signal_by_part(train_part, len(corpus)), parts)
    return Datasets(next_token_data(corpus, config, native_model(model).config.max_position_embeddings), None, None,
                    None)


_DATA_FIELDS = ("tokens", "lengths", "target_mask", "topk_ids", "topk_logprobs")
# Optimizer steps between training checkpoints when a run has a checkpoint path and its config
# says 0: a stopped run loses at most this many steps (a write of the cartridge and Adam's state
# every 10 steps costs about 1% of the time on the default model).
DEFAULT_CHECKPOINT_EVERY = 10


def _data_dict(data: cartridges_core.TrainingData) -> dict[str, torch.Tensor]:
    return {n: getattr(data, n) for n in _DATA_FIELDS}


_PARAM_FIELDS = ("frozen_keys", "frozen_values", "trainable_keys", "trainable_values")


def _starting_params(model: Any, corpus: Corpus, config: TrainConfig, checkpoint: str | os.PathLike[str] | None,
                     resume: bool, bar: _Bar,
                     cancel: cartridges_core.CancelToken | None) -> cartridges_core.CartridgeParams:
    """`init_params`; a compaction (minutes on a long corpus) is kept beside the checkpoint
    (CHECKPOINT.init.pt, written whole or not at all) so that a resumed run reads it back."""
    path = Path(f"{checkpoint}.init.pt") if checkpoint is not None and config.init == "compact" else None
    if resume and path is not None and path.exists():
        saved = torch.load(path, weights_only=True)
        return cartridges_core.CartridgeParams(*(saved[name] for name in _PARAM_FIELDS))
    params = init_params(model, corpus, config, _compaction_progress(bar, cancel))
    if path is not None:
        tmp = path.with_name(path.name + ".tmp")
        torch.save({name: [t.clone() for t in getattr(params, name)] for name in _PARAM_FIELDS}, tmp)
        os.replace(tmp, path)
    return params


class CheckpointMismatch(ValueError):
    """A resume found checkpoint files made for another model, corpus or config."""


def _checkpoint_key(model: Any, corpus: Corpus, config: TrainConfig) -> str:
    """What a run's checkpoint files depend on: the model, the corpus' tokens and the config as
    asked (before what it leaves open is decided: the training dtype may be decided otherwise
    on another machine, which changes none of the files), less the checkpoint cadence."""
    fields = config.to_dict()
    fields.pop("checkpoint_every", None)
    digest = hashlib.sha256(json.dumps([model_fingerprint(model), fields], sort_keys=True).encode())
    digest.update(torch.tensor(corpus.tokens, dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()


def _claim_checkpoint(checkpoint: str | os.PathLike[str], key: str, resume: bool) -> None:
    """CHECKPOINT.key records what the checkpoint files beside it were made from. A resume
    whose model, corpus or config differ stops with a clear error instead of mixing that run's
    conversations, initialization or optimizer state into this one; a checkpoint without the
    file (made before it existed) is trusted as before. A run without resume removes the files
    of an earlier run first (CHECKPOINT itself only when its key is there)."""
    path = Path(f"{checkpoint}.key")
    if resume and path.exists():
        saved = path.read_text().strip()
        if saved != key:
            raise CheckpointMismatch(
                f"the checkpoint {checkpoint} was made for another model, corpus or config; "
                "train with the same ones to resume it, or without resume (or with another checkpoint path) to start over")
        return
    if not resume:  # a run that starts over leaves nothing of an earlier one for a later resume to trust
        for kind in ("init", "synthesis", "data"):
            Path(f"{checkpoint}.{kind}.pt").unlink(missing_ok=True)
        if path.exists():  # CHECKPOINT itself only when a key proves it is ours, never a file of the user's
            Path(checkpoint).unlink(missing_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(key + "\n")
    os.replace(tmp, path)


def _save_datasets(path: Path, datasets: Datasets) -> None:
    """The synthesized datasets in one file, written whole or not at all (a resume never reads
    half a file)."""
    saved = _data_dict(datasets.data)
    if datasets.held_out is not None:
        saved["held_out"] = _data_dict(datasets.held_out)
    if datasets.signal_by_part is not None:
        saved["signal_by_part"] = torch.tensor(datasets.signal_by_part, dtype=torch.float64)
    if datasets.held_out_parts is not None:
        saved["held_out_parts"] = torch.tensor(datasets.held_out_parts, dtype=torch.long)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(saved, tmp)
    os.replace(tmp, path)


def _load_datasets(path: Path) -> Datasets:
    """What `_save_datasets` wrote."""
    saved = torch.load(path, weights_only=True)
    held = saved.pop("held_out", None)
    signal = saved.pop("signal_by_part", None)
    parts = saved.pop("held_out_parts", None)
    return Datasets(cartridges_core.TrainingData(**saved),
                    cartridges_core.TrainingData(**held) if held is not None else None,
                    signal.tolist() if signal is not None else None,
                    parts.tolist() if parts is not None else None)


def decided_config(config: TrainConfig, corpus_tokens: int, native: cartridges_core.LlamaModel) -> TrainConfig:
    """`config` with everything it leaves open decided, as training records it: what depends on
    the corpus (`TrainConfig.for_corpus`) and, for a run that trains, the dtype it trains in."""
    config = config.for_corpus(corpus_tokens)
    if config.objective == "compact":  # no training
        return config
    return config.replace(training_dtype=resolved_training_dtype(native, config.training_dtype))


def training_twin(native: cartridges_core.LlamaModel, training_dtype: str) -> cartridges_core.LlamaModel:
    """The model the training passes run on: `native` itself ("model", or its own dtype), or its
    twin with the weights in `training_dtype` ("auto" decided by `resolved_training_dtype`)."""
    training_dtype = resolved_training_dtype(native, training_dtype)
    if training_dtype in ("model", native.dtype):
        return native
    return native.with_dtype(training_dtype)


def _loop_options(model: Any, trainer: cartridges_core.LlamaModel, config: TrainConfig,
                  params: cartridges_core.CartridgeParams, data: cartridges_core.TrainingData,
                  checkpoint: str | os.PathLike[str] | None, resume: bool) -> cartridges_core.TrainOptions:
    """The C++ loop's options: the config's training fields, the companion when it fits (its KV
    from `trainer`, the model that trains), and the checkpoint's path and cadence."""
    options = train_options(config)
    if companion_fits(trainer, config, params):
        # The stand-in for another cartridge in front: KV of unrelated text, as long as this one.
        companion = unrelated_tokens(model, params.num_tokens)
        options.companion = trainer.prefix_from_tokens(torch.tensor(companion, dtype=torch.long))
        options.companion_every = config.companion_every
    if checkpoint is not None:
        options.checkpoint_path = str(checkpoint)
        options.checkpoint_every = config.checkpoint_every or DEFAULT_CHECKPOINT_EVERY
        options.resume = resume
    return options


class _Bar:
    """A tqdm bar per stage when `enabled` and attached to a terminal or notebook."""

    def __init__(self, enabled: bool, callback: Callable[[str, int, int, float | None], object] | None) -> None:
        self.enabled = enabled
        self.callback = callback
        self.bar = None
        self.stage = ""

    def update(self, stage: str, done: int, total: int, loss: float | None = None) -> None:
        if self.callback is not None:
            self.callback(stage, done, total, loss)
        if not self.enabled:
            return
        if stage != self.stage:
            self.close()
            from tqdm.auto import tqdm

            unit = {"synthesis": "conv", "compaction": "window"}.get(stage, "step")
            self.bar = tqdm(total=total, desc=stage, unit=unit, disable=None)
            self.stage = stage
        assert self.bar is not None
        self.bar.n = done
        if loss is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _compaction_progress(bar: _Bar, cancel: cartridges_core.CancelToken | None) -> Callable[[int, int], None]:
    """Reports each compacted window as the stage "compaction", and stops between windows once
    `cancel` is cancelled (TrainingCancelled)."""

    def on_window(done: int, total: int) -> None:
        bar.update("compaction", done, total)
        if cancel is not None and cancel.cancelled:
            raise TrainingCancelled("cancelled during compaction")

    return on_window


def recorded_config(config: TrainConfig, corpus: Corpus) -> dict[str, Any]:
    """What a cartridge keeps in its config: `config` as decided for `corpus`, and the digest of the
    text it was trained on (`corpus_sha256`, `cartridges.selfstudy.chunking.corpus_digest`) where
    the corpus has its texts, so that the files it is later used with can be checked against it."""
    digest = corpus.digest()
    return config.to_dict() | ({"corpus_sha256": digest} if digest else {})


def _compacted(model: Any, corpus: Corpus, config: TrainConfig, bar: _Bar,
               cancel: cartridges_core.CancelToken | None) -> Cartridge:
    """objective="compact": the corpus' KV compacted by attention matching, untrained."""
    started = time.perf_counter()
    try:
        params = init_params(model, corpus, config.replace(init="compact"), _compaction_progress(bar, cancel))
    finally:
        bar.close()
    cartridge = Cartridge.from_params(params, model_fingerprint(model), recorded_config(config, corpus))
    cartridge.stats = {"losses": [], "steps": 0, "cancelled": False, "num_conversations": 0,
                       "num_target_tokens": 0, "init_s": time.perf_counter() - started, "synthesis_s": 0.0,
                       "training_s": 0.0,
                       "quality_s": 0.0, "quality": None, "signal_by_part": None, "held_out_parts": None,
                       "data": None, "held_out": None}
    return cartridge


# Longer than 60 lines for its docstring and the order of the stages (data, loop options, training,
# quality report) with their timings; each stage is a function of its own.
def train(
    model: Any,
    texts: str | Sequence[str] | Corpus,
    config: TrainConfig | None = None,
    progress: bool = True,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    resume: bool = False,
    cancel: cartridges_core.CancelToken | None = None,
    on_progress: Callable[[str, int, int, float | None], object] | None = None,
    data: cartridges_core.TrainingData | None = None,
    held_out: cartridges_core.TrainingData | None = None,
) -> Cartridge:
    """Train a cartridge for `texts` on `model` by self-study. `texts` is one text, several
    (joined as `Corpus.from_texts` joins them) or a `Corpus` tokenized already.

    `progress` shows a bar (stage, step, loss) in a terminal or notebook; `on_progress(stage,
    done, total, loss)` is called as well, stage being "compaction" (windows of the corpus
    compacted, with `init` or `objective` "compact"), "synthesis" or "training". With
    `checkpoint`, synthesis saves its conversations after each batch (CHECKPOINT.synthesis.pt),
    the synthesized data is kept beside it (CHECKPOINT.data.pt), so is a compacted
    initialization (CHECKPOINT.init.pt), and training state is written
    every `config.checkpoint_every` steps and at the end; `resume` continues from them, and
    stops with `CheckpointMismatch` if they were made for another model, corpus or config
    (CHECKPOINT.key records which).
    `cancel.cancel()` stops synthesis between batches (TrainingCancelled) and training within a
    step; the cartridge is then the last completed step's.
    `data` reuses training data made earlier (`prepare_data`, or `stats["data"]` of an earlier
    cartridge) instead of synthesizing it again, e.g. to compare learning rates; `held_out`
    (`stats["held_out"]`) likewise for the quality report, which is left out without it.

    The returned cartridge's `stats` holds losses, wall times, the training data (`data`), the
    held-out data (`held_out`, None without) and the quality report (`quality`, see
    `cartridges.quality.quality_report`; None when quality_samples is 0, for the next_token
    objective, or when training was cancelled), which `save` also writes into the file."""
    config = config or TrainConfig()
    native = native_model(model)
    if isinstance(texts, Corpus):
        corpus = texts
    else:
        corpus = Corpus.from_texts(model.tokenizer, [texts] if isinstance(texts, str) else texts)
    # The cartridge records what was decided: the number of conversations made, the dtype trained in.
    asked, config = config, decided_config(config, len(corpus), native)
    bar = _Bar(progress, on_progress)
    if config.objective == "compact":
        return _compacted(model, corpus, config, bar, cancel)
    if checkpoint is not None:
        _claim_checkpoint(checkpoint, _checkpoint_key(model, corpus, asked), resume)
    quality = None
    signal = parts = None  # unknown for data made elsewhere
    try:
        started = time.perf_counter()
        params = _starting_params(model, corpus, config, checkpoint, resume, bar, cancel)
        data_path = Path(f"{checkpoint}.data.pt") if checkpoint is not None else None
        synthesis_path = Path(f"{checkpoint}.synthesis.pt") if checkpoint is not None else None
        t0 = time.perf_counter()
        if resume and data_path is not None and data_path.exists():
            data, held_out, signal, parts = _load_datasets(data_path)
        elif data is None:
            # Conversations trained behind the companion have both prefixes in front.
            prefix_tokens = params.num_tokens * (2 if companion_fits(native, config, params) else 1)
            data, held_out, signal, parts = prepare_datasets(model, corpus, config, prefix_tokens, bar.update,
                                                             synthesis_checkpoint=synthesis_path, resume=resume,
                                                             cancel=cancel)
        if data_path is not None and not (resume and data_path.exists()):
            _save_datasets(data_path, Datasets(data, held_out, signal, parts))
            if synthesis_path is not None:
                synthesis_path.unlink(missing_ok=True)  # the data supersedes it
        t1 = time.perf_counter()

        trainer = training_twin(native, config.training_dtype)
        options = _loop_options(model, trainer, config, params, data, checkpoint, resume)

        def report(p: cartridges_core.TrainProgress) -> None:
            bar.update("training", p.step, p.total, p.loss)

        init = copy_params(params) if held_out is not None else None
        result = cartridges_core.train_cartridge(trainer, params, data, options, report, cancel)
        del trainer
        t2 = time.perf_counter()
        if init is not None and not result.cancelled:
            quality = quality_report(native, params, init, held_out, config.batch_size, parts)
        t3 = time.perf_counter()
    finally:
        bar.close()
    cartridge = Cartridge.from_params(params, model_fingerprint(model), recorded_config(config, corpus))
    cartridge.stats = {
        "losses": list(result.losses),
        "steps": result.steps,
        "cancelled": result.cancelled,
        "num_conversations": int(data.tokens.shape[0]),
        "num_target_tokens": int(data.topk_ids.shape[0]),
        "init_s": t0 - started,
        "synthesis_s": t1 - t0,
        "training_s": t2 - t1,
        "quality_s": t3 - t2,
        "quality": quality,
        "signal_by_part": signal,
        "held_out_parts": parts,
        "data": data,
        "held_out": held_out,
    }
    return cartridge
