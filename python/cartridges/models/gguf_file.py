"""Reads a GGUF file's header (its metadata and tensor table), the tensors' bytes as views of
one read-only memory map.

The `gguf` package's `GGUFReader` builds a numpy view for every element of every metadata
array: about 5 s for the default model's 49,152 tokens and 48,900 merges, most of the time
of loading it. This reader decodes each array in one pass (numbers with one `frombuffer`),
which reads the same header in a few tens of milliseconds. Types, block sizes and names
still come from `gguf`. The layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_MAX_ARRAY_DEPTH = 8  # arrays of arrays: deeper nesting is refused, not recursed into
_SCALARS = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}


# Types whose data is read as numpy elements (as `gguf` reads them); the rest as bytes.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands, or it is damaged or cut short."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order ([rows, columns]), the reverse of GGUF's ne[]
    # A read-only view of the file: F32, F16 and integer types as elements of `shape`; block
    # formats and BF16 as uint8 [*shape[:-1], bytes per row].
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    version: int
    metadata: dict[str, Any]  # key → int, float, bool, str, or a list of them
    tensors: list[GGUFTensor]


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Reads the header of `path`; raises GGUFFormatError if it is not a valid GGUF file."""
    buffer = np.memmap(path, mode="r", dtype=np.uint8) if os.path.getsize(path) else np.zeros(0, np.uint8)
    cursor = _Cursor(buffer)
    if cursor.take(4).tobytes() != _MAGIC:
        raise GGUFFormatError("not a GGUF file (the magic bytes are not 'GGUF')")
    version = cursor.scalar("<I")
    if version & 0xFFFF == 0 and version >> 16:
        raise GGUFFormatError("big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version} (2 and 3 are read)")
    tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.value_type())

    infos, names = [], set()
    for _ in range(tensor_count):
        name = cursor.string()
        n_dims = cursor.scalar("<I")
        if n_dims > 4:
            raise GGUFFormatError(f"tensor '{name}' has {n_dims} dimensions (at most 4)")
        dims = [cursor.scalar("<Q") for _ in range(n_dims)]
        type_id, offset = cursor.scalar("<I"), cursor.scalar("<Q")
        try:
            tensor_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFFormatError(f"tensor '{name}' has an unknown type {type_id}") from None
        if name in names:
            raise GGUFFormatError(f"tensor '{name}' appears twice")
        names.add(name)
        infos.append((name, dims, tensor_type, offset))

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
    data_start = -(-cursor.position // alignment) * alignment
    tensors = [_tensor(buffer, data_start, *info) for info in infos]
    return GGUFFile(version=version, metadata=metadata, tensors=tensors)


def _tensor(buffer: np.ndarray, data_start: int, name: str, dims: list[int],
            tensor_type: GGMLQuantizationType, offset: int) -> GGUFTensor:
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    if not dims or any(d <= 0 for d in dims) or dims[0] % block_size:
        raise GGUFFormatError(f"tensor '{name}' has invalid dimensions {dims} for {tensor_type.name}")
    shape = tuple(reversed(dims))
    n_bytes = math.prod(dims) // block_size * type_size
    start = data_start + offset
    if start + n_bytes > buffer.size:
        raise GGUFFormatError(f"tensor '{name}' lies past the end of the file")
    raw = buffer[start:start + n_bytes]
    dtype = _ELEMENT_DTYPES.get(tensor_type)
    if dtype is not None:
        data = raw.view(dtype).reshape(shape)
    else:  # block formats and BF16: bytes, a row's elements in shape[-1] // block_size * type_size
        data = raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)
    return GGUFTensor(name=name, tensor_type=tensor_type, shape=shape, data=data)


class _Cursor:
    """Reads little-endian values from the buffer, checking each read against its end."""

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.bytes = memoryview(buffer) if buffer.size else memoryview(b"")
        self.position = 0

    def need(self, n: int) -> None:
        """Raise unless `n` more bytes are left."""
        if n < 0 or self.position + n > self.buffer.size:
            raise GGUFFormatError(f"the file ends at byte {self.buffer.size} inside its header")

    def take(self, n: int) -> np.ndarray:
        self.need(n)
        view = self.buffer[self.position:self.position + n]
        self.position += n
        return view

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.bytes, self.position)
        self.position += size
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        self.need(length)
        try:
            text = str(self.bytes[self.position:self.position + length], "utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"a string at byte {self.position} is not valid UTF-8") from None
        self.position += length
        return text

    def value_type(self) -> GGUFValueType:
        type_id = self.scalar("<I")
        try:
            return GGUFValueType(type_id)
        except ValueError:
            raise GGUFFormatError(f"unknown metadata value type {type_id}") from None

    def value(self, value_type: GGUFValueType, depth: int = 0) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            return self.array(depth + 1)
        dtype = _SCALARS[value_type]
        item = self.take(dtype.itemsize).view(dtype)[0].item()
        return bool(item) if value_type == GGUFValueType.BOOL else item

    def array(self, depth: int) -> list[Any]:
        if depth > _MAX_ARRAY_DEPTH:
            raise GGUFFormatError(f"metadata arrays nested more than {_MAX_ARRAY_DEPTH} deep")
        item_type, count = self.value_type(), self.scalar("<Q")
        if item_type in _SCALARS:
            dtype = _SCALARS[item_type]
            self.need(count * dtype.itemsize)
            items = self.take(count * dtype.itemsize).view(dtype).tolist()
            return [bool(i) for i in items] if item_type == GGUFValueType.BOOL else items
        self.need(count)  # every item takes at least one byte
        if item_type == GGUFValueType.STRING:
            return [self.string() for _ in range(count)]
        return [self.value(item_type, depth) for _ in range(count)]
