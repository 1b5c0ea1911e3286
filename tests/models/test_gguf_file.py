"""The GGUF header reader against the `gguf` package's own reader (the reference), and on
damaged or hostile files."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cartridges.models import ModelLoadError, default_model_path, load_gguf
from cartridges.models.gguf_file import GGUFFormatError, read_gguf


def _reference(path):
    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return metadata, reader.tensors


def _assert_same_as_reference(path, *, flattened: tuple[str, ...] = ()):
    """`flattened`: keys of arrays of arrays, which the reference returns flattened."""
    ours = read_gguf(path)
    metadata, tensors = _reference(path)
    for key in flattened:
        assert [x for inner in ours.metadata.pop(key) for x in inner] == metadata.pop(key)
    assert ours.metadata == metadata
    assert {k: type(v) for k, v in ours.metadata.items()} == {k: type(v) for k, v in metadata.items()}
    assert [t.name for t in ours.tensors] == [t.name for t in tensors]
    for mine, theirs in zip(ours.tensors, tensors):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name


@pytest.fixture
def every_kind_gguf(tmp_path):
    """A GGUF with a value of every metadata type, arrays of numbers, strings and arrays, and
    tensors in element and block formats."""
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("k.u8", 200)
    w.add_int8("k.i8", -100)
    w.add_uint16("k.u16", 60000)
    w.add_int16("k.i16", -30000)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -2_000_000_000)
    w.add_float32("k.f32", 0.125)
    w.add_uint64("k.u64", 2**63 + 5)
    w.add_int64("k.i64", -(2**62))
    w.add_float64("k.f64", 1e-300)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo ✓ <|im_start|>")
    w.add_string("k.empty", "")
    w.add_array("k.ints", [1, 2, 3, -4])
    w.add_array("k.floats", [0.5, -1.5])
    w.add_array("k.strings", ["a", "Ġb", "", "日本"])
    w.add_array("k.bools", [True, False, True])
    w.add_array("k.nested", [[1, 2], [3]])
    w.add_array("k.no_items", [])
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((8, 64)).astype(np.float32)
    w.add_tensor("f32", matrix)
    w.add_tensor("f16", matrix.astype(np.float16))
    w.add_tensor("vector", matrix[0])
    w.add_tensor("q8", gguf.quants.quantize(matrix, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("q4", gguf.quants.quantize(matrix, Q.Q4_1), raw_dtype=Q.Q4_1)
    w.add_tensor("bf16", matrix.view(np.uint8)[:, ::2].copy(), raw_dtype=Q.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_what_the_reference_reads(every_kind_gguf):
    _assert_same_as_reference(every_kind_gguf, flattened=("k.nested",))
    ours = read_gguf(every_kind_gguf)
    assert ours.metadata["k.u64"] == 2**63 + 5 and ours.metadata["k.nested"] == [[1, 2], [3]]
    assert ours.metadata["k.bools"] == [True, False, True]
    assert {t.name: t.shape for t in ours.tensors}["q4"] == (8, 64)


@pytest.mark.slow
def test_reads_the_default_model_as_the_reference_does():
    _assert_same_as_reference(default_model_path())


def test_every_truncation_is_a_format_error(every_kind_gguf, tmp_path):
    data = every_kind_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in range(0, len(data) - 1, 7):
        cut.write_bytes(data[:size])
        with pytest.raises(GGUFFormatError):
            read_gguf(cut)


def _header(*, version=3, tensors=0, kvs=1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, kvs)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize(("content", "reason"), [
    (b"GGML" + bytes(20), "not a GGUF file"),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    (_header(version=1), "unsupported GGUF version 1"),
    # An array that claims 2^60 strings: refused before any is read.
    (_header() + _key("a") + struct.pack("<IIQ", 9, 8, 2**60) + bytes(64), "ends at byte"),
    (_header() + _key("a") + struct.pack("<IIQ", 9, 4, 2**61) + bytes(64), "ends at byte"),
    (_header() + _key("a") + struct.pack("<I", 99), "unknown metadata value type 99"),
    (_header() + _key("k") + struct.pack("<IQ", 8, 2) + b"\xff\xfe", "not valid UTF-8"),
    (_header() + _key("general.alignment") + struct.pack("<II", 4, 3), "not a power of two"),
    # arrays of arrays 100 deep: refused before the reader recurses that far
    (_header() + _key("a") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 100 + bytes(64), "nested more than"),
])
def test_hostile_headers_are_format_errors(tmp_path, content, reason):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError, match=reason):
        read_gguf(path)


def test_tensor_table_damage_is_a_format_error(tmp_path):
    def tensor(name: str, dims: list[int], type_id: int, offset: int) -> bytes:
        return _key(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)

    path = tmp_path / "bad.gguf"
    cases = [
        ([tensor("t", [64], 0, 0)], "lies past the end"),
        ([tensor("t", [64], 0, 0), tensor("t", [64], 0, 256)], "appears twice"),
        ([tensor("t", [30, 2], 8, 0)], "invalid dimensions"),  # Q8_0 rows of 30 weights
        ([tensor("t", [64], 250, 0)], "unknown type 250"),
        ([tensor("t", [1] * 5, 0, 0)], "5 dimensions"),
    ]
    for tensors, reason in cases:
        path.write_bytes(_header(tensors=len(tensors), kvs=0) + b"".join(tensors) + bytes(64))
        with pytest.raises(GGUFFormatError, match=reason):
            read_gguf(path)


def test_the_loader_names_the_file_and_the_damage(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 7, 0, 0))
    with pytest.raises(ModelLoadError, match=r"m\.gguf: corrupt or truncated GGUF file \(unsupported GGUF version 7"):
        load_gguf(path)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_core_dequantization_equals_the_reference(kind):
    import torch

    from cartridges.store import core

    matrix = np.random.default_rng(1).standard_normal((300, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(matrix, kind)
    ours = core().dequantize_weight(kind.name, torch.from_numpy(blocks), 96)
    assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(blocks, kind)))
    with pytest.raises(RuntimeError, match="row of 64 weights takes"):
        core().dequantize_weight(kind.name, torch.from_numpy(blocks), 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        core().dequantize_weight(kind.name, torch.from_numpy(blocks), 95)


def test_damaged_headers_are_format_errors_or_read(every_kind_gguf, tmp_path):
    """Random byte changes in the header (lengths, counts, types, text): each file is read or
    refused with GGUFFormatError, never another exception."""
    import random

    data = every_kind_gguf.read_bytes()
    rng = random.Random(0)
    damaged = tmp_path / "damaged.gguf"
    for _ in range(1500):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(1024)] = rng.choice([rng.randrange(256), 0x00, 0xFF, 0x7F, 0x80])
        damaged.write_bytes(bytes(mutated))
        try:
            read_gguf(damaged)
        except GGUFFormatError:
            pass
