"""The synthesis checkpoint: batches appended as records, read back whole, a torn last record
dropped and cut off, the former whole-list layout still read."""

from __future__ import annotations

import os

import pytest
import torch

from cartridges.selfstudy.checkpoint import MAGIC, ConversationLog, load_conversations
from cartridges.selfstudy.synthesize import Conversation


def conversation(i: int) -> Conversation:
    g = torch.Generator().manual_seed(i)
    n = 3 + i % 4
    return Conversation(kind="recall", chunk=f"chunk {i}", question=f"question {i}?", answer=list(range(i, i + n)),
                        topk_ids=torch.randint(100, (n, 5), generator=g),
                        topk_logprobs=torch.randn(n, 5, generator=g), window=f"window {i}",
                        chunk_span=(i, i + 10), partner_span=(0, 0))


def same(a: list[Conversation], b: list[Conversation]) -> bool:
    return len(a) == len(b) and all(
        x.question == y.question and x.answer == y.answer and torch.equal(x.topk_ids, y.topk_ids)
        and torch.equal(x.topk_logprobs, y.topk_logprobs) and x.chunk_span == y.chunk_span for x, y in zip(a, b))


def test_batches_append_and_read_back_in_order(tmp_path):
    path = tmp_path / "run.synthesis.pt"
    log = ConversationLog(path, resume=False)
    made = [conversation(i) for i in range(7)]
    sizes = []
    for batch in (made[:3], made[3:5], made[5:]):
        before = path.read_bytes()
        log.append(batch)
        sizes.append(path.stat().st_size)
        assert path.read_bytes().startswith(before)  # what was there stays, byte for byte
    assert log.count == 7
    assert same(load_conversations(path), made)
    # The file grows by one record a batch (two conversations' record, not all seven's).
    assert sizes[2] - sizes[1] < sizes[1] - len(MAGIC)
    resumed = ConversationLog(path, resume=True)
    assert resumed.count == 7 and same(resumed.conversations, made)


def test_a_torn_last_record_is_dropped_and_cut_off(tmp_path):
    path = tmp_path / "run.synthesis.pt"
    log = ConversationLog(path, resume=False)
    made = [conversation(i) for i in range(6)]
    log.append(made[:4])
    whole = path.stat().st_size
    log.append(made[4:])
    os.truncate(path, path.stat().st_size - 10)  # a crash in the middle of the second record
    assert same(load_conversations(path), made[:4])
    resumed = ConversationLog(path, resume=True)
    assert resumed.count == 4 and path.stat().st_size == whole
    resumed.append(made[4:])
    assert same(load_conversations(path), made)


def test_without_resume_an_old_file_is_replaced(tmp_path):
    path = tmp_path / "run.synthesis.pt"
    ConversationLog(path, resume=False).append([conversation(0)])
    log = ConversationLog(path, resume=False)
    assert log.count == 0 and load_conversations(path) == []


def test_the_former_whole_list_layout_is_read_and_rewritten(tmp_path):
    path = tmp_path / "run.synthesis.pt"
    made = [conversation(i) for i in range(5)]
    fields = ("kind", "chunk", "question", "answer", "topk_ids", "topk_logprobs", "window", "chunk_span",
              "partner_span")
    torch.save([{name: getattr(c, name) for name in fields} for c in made[:3]], path)
    assert same(load_conversations(path), made[:3])
    log = ConversationLog(path, resume=True)
    assert log.count == 3
    log.append(made[3:])
    assert path.read_bytes().startswith(MAGIC)
    assert same(load_conversations(path), made)


def test_a_foreign_file_is_a_clear_error(tmp_path):
    path = tmp_path / "run.synthesis.pt"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="not a synthesis checkpoint"):
        ConversationLog(path, resume=True)
    assert path.read_bytes() == b"not a checkpoint at all"  # left as it was


def test_a_damaged_record_in_the_middle_is_a_clear_error(tmp_path):
    path = tmp_path / "run.synthesis.pt"
    log = ConversationLog(path, resume=False)
    log.append([conversation(i) for i in range(3)])
    log.append([conversation(i) for i in range(3, 5)])
    data = bytearray(path.read_bytes())
    body = len(MAGIC) + 8  # the first record's body: the start of its torch.save archive
    data[body : body + 64] = bytes(64)  # zeroed on disk, its length and the next record intact
    path.write_bytes(bytes(data))
    message = f"{path.name} is damaged: the record at byte {body - 8} cannot be read; delete the file"
    with pytest.raises(ValueError, match=message):
        ConversationLog(path, resume=True)
    with pytest.raises(ValueError, match="is damaged"):
        load_conversations(path)
    assert path.read_bytes() == bytes(data)  # left as it was
