"""The training worker: `run_job(run_id, data_dir)` trains one datablock, reading everything
it needs from the store and writing progress, checkpoints and the cartridge back to it.

Run as `python -m cartridges.jobs.worker RUN_ID DATA_DIR` by the supervisor, one process per
job: whatever happens to it (a crash, out of memory, kill -9) the server and the store are
unharmed. It may stop at any moment: synthesis and training checkpoint into the job's
scratch directory, and a later run of the same job resumes from there.

Environment (set by the supervisor, not part of the entry point's contract):
  CARTRIDGES_WORKER_THREADS   intra-op threads (torch.set_num_threads); unset: torch's default
  CARTRIDGES_INT8_ACTIVATIONS "0": float32 activations on quantized CPU weights, as the
                              server was told (load_model's int8_activations); unset: on
  CARTRIDGES_WORKER_DEVICE    where the model trains: the server's training_device for a
                              local worker, "cuda" in a Ray task given GPUs (ray_backend.py);
                              unset: "cpu"
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("cartridges.jobs")

FILE_WAIT_POLL_S = 0.2
EXIT_BUSY = 75  # another worker holds this job
WORKER_DEVICE_ENV = "CARTRIDGES_WORKER_DEVICE"


class HeldElsewhere(Exception):
    """Another server sharing the store runs this job (its worker claimed it first)."""


class JobFailed(Exception):
    """The job cannot succeed; `code` and the message become the datablock's `error`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def run_job(run_id: str, data_dir: str | os.PathLike[str], database_url: str = "", blob_url: str = "") -> int:
    """Trains datablock `run_id` of the store in `data_dir` (its records in `database_url`, its
    blobs in `blob_url`: see open_store) to its end; returns an exit code."""
    from ..blobs import open_blob_mirror
    from ..store import core as compiled_core, open_store

    core = compiled_core()
    mirror = open_blob_mirror(blob_url)
    store = open_store(data_dir, database_url=database_url, blob_mirror=mirror)
    admin = core.Owner(0, True)
    try:
        record = store.get_datablock(admin, run_id)
        if record.status not in ("queued", "running"):
            return 0
        scratch = store.job_dir(admin, run_id)
        lock = _lock_job(scratch)
        if lock is None:
            return EXIT_BUSY
        owner = core.Owner(record.owner_id, False)  # the job acts as its owner from here on
        cancel = core.CancelToken()
        from .checkpoints import CheckpointSync
        from .progress import JobProgress

        progress = JobProgress(store, owner, run_id, cancel, core)
        # With a blob store the checkpoints live there too: a job another machine ran resumes.
        sync = CheckpointSync(mirror, run_id, scratch) if mirror is not None else None
        try:
            _train(store, owner, record, progress, cancel, sync)
        except HeldElsewhere:
            sync = None  # the claimant's checkpoints are not ours to touch
            return EXIT_BUSY
        except JobFailed as failure:
            _fail(store, owner, run_id, failure.code, str(failure))
        except (core.NotFoundError, core.ConflictError):
            return 0  # deleted or cancelled meanwhile
        except Exception as error:  # a bug or a resource failure: the job fails, with why
            if progress.stopped:
                return 0
            log.exception("job %s failed", run_id)
            _fail(store, owner, run_id, "training_failed", f"{type(error).__name__}: {error}")
        finally:
            progress.close()
            if sync is not None:
                _finish_checkpoints(sync, store, admin, run_id)
            os.close(lock)
        return 0
    except (core.NotFoundError, core.ConflictError):
        return 0  # deleted or cancelled meanwhile: nothing to do
    finally:
        store.close()


def _restore_checkpoints(sync: Any) -> None:
    """The blob store's checkpoints of the job, if any; without them (the store away) the job
    resumes from what this machine has."""
    try:
        sync.restore()
    except Exception as error:
        log.warning("checkpoints not restored from the blob store: %s", error)


def _finish_checkpoints(sync: Any, store: Any, admin: Any, run_id: str) -> None:
    """The job's checkpoints in the blob store: removed once it has ended, else brought up to
    date for whichever worker resumes it."""
    import cartridges_core as core

    try:
        ended = store.get_datablock(admin, run_id).status not in ("queued", "running")
    except core.NotFoundError:
        ended = True  # deleted
    except Exception:
        ended = False  # the database away: keep them
    try:
        sync.clear() if ended else sync.stop()
    except Exception as error:
        log.warning("checkpoints in the blob store not updated: %s", error)


def _train(store: Any, owner: Any, record: Any, progress: Any, cancel: Any, sync: Any = None) -> None:

    from ..selfstudy import Corpus
    from ..selfstudy.config import TrainConfig
    from ..cartridge import cartridges_to_bytes, native_model
    from ..parts import corpus_parts, default_part_tokens, in_parts_by_default, record_cut
    from ..training import TrainingCancelled, decided_config, train

    run_id = record.run_id
    stored = json.loads(record.config)
    config = TrainConfig.from_dict(stored)
    texts = _training_texts(store, owner, record, progress)
    if progress.stopped:
        return
    model = _load_model(record.model_path)
    if record.fingerprint and record.fingerprint != model.fingerprint:
        raise JobFailed("interrupted", "the server's base model changed since this job started; it cannot resume")
    # The corpus is tokenized here (trained in parts: each part too). Whether it trains in parts,
    # when the request left that to its length, and what the config leaves open (the cartridge's
    # length, the number of conversations, the dtype trained in) are decided once, here, for each
    # part, and the datablock shows them from now on.
    corpora = [Corpus.from_texts(model.tokenizer, texts)]
    in_parts = stored.get("parts")
    if in_parts is None:
        in_parts = in_parts_by_default(model, len(corpora[0]))
    parts: dict[str, Any] = {"parts": in_parts}
    if in_parts:
        parts["part_tokens"] = stored.get("part_tokens") or default_part_tokens(model)
        texts_of_parts = corpus_parts(model.tokenizer, texts, parts["part_tokens"])
        corpora = [Corpus.from_texts(model.tokenizer, [text]) for text in texts_of_parts]
    configs = [decided_config(config, len(corpus), native_model(model)) for corpus in corpora]
    shown = (configs[0] if len(configs) == 1 else config).to_dict() | parts
    from ..store import core
    from .progress import LEASE_S

    try:
        store.start_datablock(owner, run_id, model.fingerprint, json.dumps(shown), sum(c.num_tokens for c in configs),
                              claimant=claimant_id(store.data_dir), lease_s=int(LEASE_S))
    except core().ConflictError:
        if store.get_datablock(owner, run_id).status == "running":
            raise HeldElsewhere(run_id) from None  # another server's worker claimed it a moment ago
        raise
    progress.start()
    if sync is not None:  # the job is ours: its checkpoints from wherever it ran last, then ours kept
        _restore_checkpoints(sync)
        sync.start()
    scratch = Path(store.job_dir(owner, run_id))
    cartridges = []
    for j, (corpus, part_config) in enumerate(zip(corpora, configs), 1):
        if len(corpora) > 1:
            progress.set_part(j, len(corpora))
        checkpoint = scratch / ("train.ckpt" if len(corpora) == 1 else f"train.part{j}of{len(corpora)}.ckpt")
        try:
            cartridge = train(model, corpus, part_config, progress=False, checkpoint=checkpoint, resume=True,
                              cancel=cancel, on_progress=_stage_reporter(progress, part_config))
        except TrainingCancelled:
            return
        if progress.stopped or cartridge.stats["cancelled"]:
            return
        if len(corpora) > 1:
            record_cut(cartridge, parts["part_tokens"])
        cartridges.append(cartridge)
    steps = sum(c.stats["steps"] for c in cartridges)
    if len(cartridges) == 1:
        stats = cartridges[0].stats
        progress.update("saving", steps, steps, synthetic_samples=stats["num_conversations"],
                        train_tokens=stats["num_target_tokens"], loss=stats["losses"][-1] if stats["losses"] else None,
                        quality=stats["quality"], signal_by_part=stats["signal_by_part"])
    else:
        progress.update("saving", steps, steps, synthetic_samples=sum(c.stats["num_conversations"] for c in cartridges),
                        train_tokens=sum(c.stats["num_target_tokens"] for c in cartridges),
                        parts=[_part_metrics(c, corpus) for c, corpus in zip(cartridges, corpora)])
        progress.metrics["loss"] = None  # the last part's: each part's is in `parts`
    blob = store.begin_blob()
    blob.write(cartridges_to_bytes(cartridges))
    final = {"stage": "done", "completed": steps, "total": steps, "eta_seconds": 0}
    progress.close()  # no heartbeat after this: the last write is the status change
    store.succeed_datablock(owner, run_id, blob, json.dumps(final), json.dumps(progress.metrics))


def _stage_reporter(progress: Any, config: Any) -> Any:
    """train()'s on_progress for one cartridge (or part): its stages as the job's progress."""
    distill = config.objective == "distill"
    to_synthesize = config.num_samples + (config.quality_samples or 0) if distill else config.num_samples
    first_stage = "synthesizing" if distill else "training"
    if config.objective == "compact" or config.init == "compact":  # the corpus' windows, before anything else
        first_stage, to_synthesize = "compacting", 0
    progress.update(first_stage, 0, to_synthesize)

    def on_progress(stage: str, done: int, total: int, loss: float | None) -> bool:
        if stage == "compaction":
            progress.update("compacting", done, total)
        elif stage == "synthesis":
            # The held-out conversations of the quality report come last; they are not
            # training samples (metrics.quality counts them).
            progress.update("synthesizing", done, total, synthetic_samples=min(done, config.num_samples))
        else:
            progress.update("training", done, total, loss=loss)
        return not progress.stopped

    return on_progress


def _part_metrics(cartridge: Any, corpus: Any) -> dict[str, Any]:
    stats = cartridge.stats
    return {"corpus_tokens": len(corpus), "num_tokens": cartridge.num_tokens,
            "num_samples": cartridge.config["num_samples"], "loss": stats["losses"][-1] if stats["losses"] else None,
            "quality": stats["quality"], "signal_by_part": stats["signal_by_part"]}


def _training_texts(store: Any, owner: Any, record: Any, progress: Any) -> list[str]:
    """The files' extracted texts, several of them each under its filename as a heading
    (`named_texts`); a file still being processed is waited for."""
    import cartridges_core as core

    from ..selfstudy.chunking import named_texts

    files = []
    for file_id in record.training_files:
        while True:
            try:
                file = store.get_file(owner, file_id)
            except core.NotFoundError:
                raise JobFailed("file_not_found", f"training file '{file_id}' was deleted before training") from None
            if file.status == "processed":
                break
            if file.status == "error":
                reason = f": {file.status_details}" if file.status_details else ""
                raise JobFailed("file_not_processed", f"training file '{file_id}' could not be processed{reason}")
            store.get_datablock(owner, record.run_id)  # NotFoundError once deleted: stop waiting
            time.sleep(FILE_WAIT_POLL_S)
        try:
            files.append((file.filename, store.file_text(owner, file_id)))
        except core.NotFoundError:
            raise JobFailed("file_not_found", f"training file '{file_id}' was deleted before training") from None
        except core.CorruptError as error:
            raise JobFailed("file_damaged", str(error)) from None
    return named_texts(files)


def int8_activations_from_env(environ: Any = os.environ) -> bool:
    """The server's arithmetic setting as the supervisor passes it (see the module doc)."""
    return environ.get("CARTRIDGES_INT8_ACTIVATIONS", "1").lower() not in ("0", "false", "no", "off")


def _load_model(model_path: str) -> Any:
    from ..model import load_model
    from ..models import ModelLoadError

    try:
        return load_model(model_path or None, device=os.environ.get(WORKER_DEVICE_ENV) or "cpu",
                          int8_activations=int8_activations_from_env())
    except ModelLoadError as error:
        raise JobFailed("model_unavailable", str(error)) from None


def _fail(store: Any, owner: Any, run_id: str, code: str, message: str) -> None:
    import cartridges_core as core

    try:
        store.fail_datablock(owner, run_id, code, message[:2000])
    except (core.NotFoundError, core.ConflictError):
        pass  # deleted or cancelled meanwhile


def _lock_job(scratch: str) -> int | None:
    """An exclusive lock on the job's scratch directory: one worker per job, ever."""
    fd = os.open(os.path.join(scratch, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def claimant_id(data_dir: str | os.PathLike[str]) -> str:
    """Who runs a job, as recorded in the store: this machine and data directory, the scope in
    which the job's lock file keeps a second worker out."""
    return f"{socket.gethostname()}:{os.path.realpath(data_dir)}"


def job_is_locked(scratch: str) -> bool:
    """Whether a worker (of this server or of another sharing the data directory) holds the job."""
    fd = _lock_job(scratch)
    if fd is None:
        return True
    os.close(fd)
    return False


def _die_with_parent() -> None:
    """The worker must not outlive the server (a restarted server starts its own): Linux
    delivers SIGKILL to us when the parent dies."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m cartridges.jobs.worker RUN_ID DATA_DIR", file=sys.stderr)
        return 2
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    import torch

    threads = int(os.environ.get("CARTRIDGES_WORKER_THREADS") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    from ..store import BLOB_URL_ENV, DATABASE_URL_ENV

    return run_job(args[0], args[1], os.environ.get(DATABASE_URL_ENV, ""), os.environ.get(BLOB_URL_ENV, ""))


if __name__ == "__main__":
    sys.exit(main())
