"""The worker and the supervisor in process, on a store of our own: a training file still being
processed is waited for, one that fails processing fails the job, a job interrupted too many
times ends `failed/interrupted`."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from cartridges import Cartridge
from cartridges.jobs import Supervisor
from cartridges.selfstudy.chunking import corpus_digest
from cartridges.selfstudy.config import TrainConfig
from cartridges.jobs.supervisor import MAX_ATTEMPTS
from cartridges.jobs.worker import _training_texts, run_job
from cartridges.store import core, open_store

from .tiny_hf_model import DOCUMENT, TINY_TRAIN_CONFIG

pytestmark = pytest.mark.slow


@pytest.fixture
def store(tmp_path: Path):
    s = open_store(tmp_path / "data", sync=False)
    yield s
    s.close()


def queue_job(store, model_dir: Path, owner: object = None, **fields: object) -> tuple[object, str, str]:
    """A job of a new user alice (or of `owner`) on a file still to be processed."""
    owner = owner or core().Owner(store.create_user("alice").id, False)
    writer = store.begin_blob()
    writer.write(DOCUMENT.encode())
    file_id = store.create_file(owner, writer, "doc.txt", "cartridge-training").id  # status: uploaded
    config = TrainConfig.model_validate({**TINY_TRAIN_CONFIG, **fields})
    block = store.create_datablock(owner, project="default", model="tiny", model_path=str(model_dir),
                                   training_files=[file_id], config=json.dumps(config.to_dict()),
                                   num_tokens=config.num_tokens)
    return owner, file_id, block.run_id


def run_in_thread(run_id: str, data_dir: str) -> threading.Thread:
    thread = threading.Thread(target=run_job, args=(run_id, data_dir), daemon=True)
    thread.start()
    return thread


def test_a_file_still_processing_is_waited_for(store, tiny_model_dir: Path) -> None:
    owner, file_id, run_id = queue_job(store, tiny_model_dir)
    worker = run_in_thread(run_id, store.data_dir)
    time.sleep(1.0)
    assert store.get_datablock(owner, run_id).status == "queued"  # waiting for the text
    store.set_file_processed(owner, file_id, None)
    worker.join(timeout=120)
    record = store.get_datablock(owner, run_id)
    assert record.status == "succeeded", (record.error_code, record.error_message)
    assert record.fingerprint and record.attempts == 1
    # The quality report (docs/api.md §2 metrics.quality), also in the stored cartridge's file.
    quality = json.loads(record.metrics)["quality"]
    assert quality["held_out_conversations"] == TrainConfig.model_validate(TINY_TRAIN_CONFIG).quality_samples
    assert set(quality) >= {"loss", "init_loss", "teacher_floor", "recovered", "better_than_init"}
    shares = json.loads(record.metrics)["signal_by_part"]  # where in the corpus the training signal came from
    assert len(shares) == 10 and abs(sum(shares) - 1) < 1e-9
    store.verify_datablock(owner, run_id)
    assert Cartridge.load(store.datablock_cartridge_path(owner, run_id)).quality == quality


def test_a_compact_job_trains_nothing_and_succeeds(store, tiny_model_dir: Path, monkeypatch) -> None:
    from cartridges.jobs.progress import JobProgress

    stages = []
    update = JobProgress.update

    def recorded(self, stage, completed, total, **metrics):
        stages.append((stage, completed, total))
        return update(self, stage, completed, total, **metrics)

    monkeypatch.setattr(JobProgress, "update", recorded)
    owner, file_id, run_id = queue_job(store, tiny_model_dir, objective="compact", num_tokens=16)
    store.set_file_processed(owner, file_id, None)
    run_job(run_id, store.data_dir)
    # the corpus' windows are the progress, then saving
    assert stages[0] == ("compacting", 0, 0) and stages[-1][0] == "saving"
    windows = [s for s in stages if s[0] == "compacting" and s[1] > 0]
    assert windows and windows[-1][1] == windows[-1][2] and [s[1] for s in windows] == list(range(1, len(windows) + 1))
    record = store.get_datablock(owner, run_id)
    assert record.status == "succeeded", (record.error_code, record.error_message)
    metrics = json.loads(record.metrics)
    assert metrics["quality"] is None and metrics["loss"] is None
    cartridge = Cartridge.load(store.datablock_cartridge_path(owner, run_id))
    assert cartridge.num_tokens == 16 and cartridge.config["objective"] == "compact"
    assert cartridge.config["corpus_sha256"] == corpus_digest(DOCUMENT)  # what it was trained on, for import's check
    assert json.loads(record.progress)["stage"] == "done"


def queue_parts_job(store, model_dir: Path, **fields: object) -> tuple[object, object]:
    """A job of a new user alice in parts of at most 300 tokens (four of the tiny model's), on a processed file."""
    owner = core().Owner(store.create_user("alice").id, False)
    writer = store.begin_blob()
    writer.write(("# Quelmor\n\n" + "\n\n".join(f"## {n}.\n\n{DOCUMENT}" for n in range(1, 4))).encode())
    file_id = store.create_file(owner, writer, "doc.md", "cartridge-training").id
    store.set_file_processed(owner, file_id, None)
    config = TrainConfig.model_validate({**TINY_TRAIN_CONFIG, **fields}).to_dict()
    block = store.create_datablock(owner, project="default", model="tiny", model_path=str(model_dir),
                                   training_files=[file_id], num_tokens=0,
                                   config=json.dumps(config | {"parts": True, "part_tokens": 300}))
    return owner, block


class Killed(BaseException):
    """The worker process dying (no handler of the job's catches it)."""


def test_a_job_in_parts_stopped_in_its_second_part_resumes_there(store, tiny_model_dir: Path, monkeypatch) -> None:
    import cartridges.training
    from cartridges.cartridge import load_cartridges

    owner, block = queue_parts_job(store, tiny_model_dir)
    train = cartridges.training.train
    events: list[tuple[str, str]] = []

    def watched(model, corpus, config, progress, *, checkpoint, on_progress, kill_in=None, **kw):
        def seen(stage, done, total, loss):
            events.append((Path(checkpoint).name, stage))
            if kill_in is not None and kill_in in str(checkpoint) and stage == "training":
                raise Killed
            return on_progress(stage, done, total, loss)

        return train(model, corpus, config, progress, checkpoint=checkpoint, on_progress=seen, **kw)

    monkeypatch.setattr(cartridges.training, "train", lambda *a, **kw: watched(*a, kill_in="part2of", **kw))
    with pytest.raises(Killed):
        run_job(block.run_id, store.data_dir)
    assert store.get_datablock(owner, block.run_id).status == "running"
    first_run = list(events)
    assert {name for name, _ in first_run} == {"train.part1of4.ckpt", "train.part2of4.ckpt"}
    events.clear()
    monkeypatch.setattr(cartridges.training, "train", lambda *a, **kw: watched(*a, **kw))
    run_job(block.run_id, store.data_dir)  # as the supervisor restarts it
    record = store.get_datablock(owner, block.run_id)
    assert record.status == "succeeded", (record.error_code, record.error_message)
    # Parts 1 and 2 kept their conversations: resumed, they synthesize nothing (part 2 trains);
    # part 3 starts from nothing.
    assert ("train.part1of4.ckpt", "synthesis") not in events and ("train.part2of4.ckpt", "synthesis") not in events
    assert ("train.part2of4.ckpt", "training") in events and ("train.part3of4.ckpt", "synthesis") in events
    assert ("train.part1of4.ckpt", "synthesis") in first_run
    assert len(load_cartridges(store.datablock_cartridge_path(owner, block.run_id))) == 4


def test_a_job_in_parts_goes_through_the_stages_once_per_part(store, tiny_model_dir: Path, monkeypatch) -> None:
    from cartridges.cartridge import load_cartridges
    from cartridges.jobs.progress import JobProgress

    written = []
    progress = JobProgress.progress

    def recorded(self):
        written.append(progress(self))
        return written[-1]

    monkeypatch.setattr(JobProgress, "progress", recorded)
    owner, block = queue_parts_job(store, tiny_model_dir, objective="next_token")
    run_job(block.run_id, store.data_dir)
    record = store.get_datablock(owner, block.run_id)
    assert record.status == "succeeded", (record.error_code, record.error_message)
    parts = load_cartridges(store.datablock_cartridge_path(owner, block.run_id))
    count = len(parts)
    assert count >= 2 and record.num_tokens == 8 * count
    stored = json.loads(record.config)
    assert stored["parts"] is True and stored["part_tokens"] == 300 and stored["objective"] == "next_token"
    # Each part trains in turn, its stage counted from 0 (so that its time left is its own), then one saving.
    training = [w for w in written if w["stage"] == "training"]
    assert [w["part"] for w in training] == sorted(w["part"] for w in training)
    assert {w["part"] for w in training} == set(range(1, count + 1)) and {w["parts"] for w in training} == {count}
    firsts = [next(w for w in training if w["part"] == j) for j in range(1, count + 1)]
    assert all(w["completed"] == 0 and w["eta_seconds"] is None for w in firsts)
    done = json.loads(record.progress)
    assert done["stage"] == "done" and done["completed"] == done["total"] > 0 and "part" not in done
    assert [p["num_tokens"] for p in json.loads(record.metrics)["parts"]] == [8] * count


def test_several_training_files_are_read_in_order_under_their_names(store) -> None:
    owner = core().Owner(store.create_user("alice").id, False)
    ids = []
    for name, text in (("second.md", "Beta text."), ("first.txt", "Alpha text.")):
        writer = store.begin_blob()
        writer.write(text.encode())
        ids.append(store.create_file(owner, writer, name, "cartridge-training").id)
        store.set_file_processed(owner, ids[-1], None)
    block = store.create_datablock(owner, project="default", model="tiny", model_path="unused", training_files=ids,
                                   config="{}", num_tokens=64)
    texts = _training_texts(store, owner, block, progress=None)
    assert texts == ["# second.md\n\nBeta text.", "# first.txt\n\nAlpha text."]


def test_a_file_that_fails_processing_fails_the_job(store, tiny_model_dir: Path) -> None:
    owner, file_id, run_id = queue_job(store, tiny_model_dir)
    worker = run_in_thread(run_id, store.data_dir)
    time.sleep(0.5)
    store.set_file_error(owner, file_id, "not valid UTF-8")
    worker.join(timeout=60)
    record = store.get_datablock(owner, run_id)
    assert (record.status, record.error_code) == ("failed", "file_not_processed")
    assert record.error_message.endswith("could not be processed: not valid UTF-8")  # what to fix
    assert not (Path(store.data_dir) / "jobs" / run_id).exists()


def test_a_job_interrupted_too_often_ends_failed_interrupted(store, tiny_model_dir: Path) -> None:
    owner, _, run_id = queue_job(store, tiny_model_dir)
    for _ in range(MAX_ATTEMPTS):
        store.start_datablock(owner, run_id, "fp")  # three servers died while it ran
    supervisor = Supervisor(store, store.data_dir, poll_s=0.05)
    supervisor.start()
    try:
        deadline = time.monotonic() + 10
        while store.get_datablock(owner, run_id).status == "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert supervisor.worker_pids() == {}
    finally:
        supervisor.stop()
    record = store.get_datablock(owner, run_id)
    assert (record.status, record.error_code) == ("failed", "interrupted")


def test_a_job_held_by_another_servers_worker_is_passed_over(store, tiny_model_dir: Path) -> None:
    """Servers sharing a store: a supervisor does not start a worker for a job whose lock another
    server's worker holds (it would only exit busy, over and over), and takes it once released."""
    from cartridges.jobs.worker import _lock_job

    _, _, held = queue_job(store, tiny_model_dir)
    supervisor = Supervisor(store, store.data_dir)
    admin = core().Owner(0, True)
    fd = _lock_job(store.job_dir(admin, held))
    assert fd is not None
    try:
        assert supervisor._next_job() is None
    finally:
        os.close(fd)
    assert supervisor._next_job().run_id == held


def test_a_job_claimed_by_another_server_is_left_to_it_while_its_heartbeat_lasts(
        store, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers on other machines: the claimant recorded at start and the heartbeat keep a job
    to one worker; when the heartbeat stops, another server resumes it."""
    from cartridges.jobs import supervisor as supervisor_module
    from cartridges.jobs.worker import EXIT_BUSY

    owner, file_id, run_id = queue_job(store, tiny_model_dir)
    store.set_file_processed(owner, file_id, None)
    store.start_datablock(owner, run_id, "", claimant="elsewhere:/srv/data", lease_s=16)
    supervisor = Supervisor(store, store.data_dir)
    assert supervisor._next_job() is None  # its worker is alive on the other machine

    # A worker started here anyway (a race) finds it claimed and leaves it, counting nothing.
    assert run_job(run_id, store.data_dir) == EXIT_BUSY
    record = store.get_datablock(owner, run_id)
    assert (record.status, record.attempts, record.claimant) == ("running", 1, "elsewhere:/srv/data")

    # The other machine's worker died: once its heartbeat is older than the lease, this
    # server takes the job over and runs it to the end.
    from cartridges.jobs import progress as progress_module

    monkeypatch.setattr(supervisor_module, "LEASE_S", 1.0)
    monkeypatch.setattr(progress_module, "LEASE_S", 1.0)
    time.sleep(2.1)
    assert supervisor._next_job().run_id == run_id
    assert run_job(run_id, store.data_dir) == 0
    record = store.get_datablock(owner, run_id)
    assert (record.status, record.attempts) == ("succeeded", 2), (record.error_code, record.error_message)
