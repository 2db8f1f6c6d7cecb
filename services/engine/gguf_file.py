"""A GGUF file's metadata and tensors, read in a fraction of the time `gguf.GGUFReader` takes.

`gguf.GGUFReader` builds a numpy view for every part of every metadata field. A model's tokenizer is
~100,000 strings (SmolLM2: 49,152 tokens and 48,900 merges), so it spends ~5.5 s of a 6.6 s load there, in
every process that opens the file: each prefill rank, each decode TP rank, the gateway. This reader walks
the same layout once with `struct` and returns plain Python values (what `ReaderField.contents()` gives)
and tensors as read-only numpy views of one memory map (what `ReaderTensor.data` holds: quantized types as
bytes shaped by `gguf.quants.quant_shape_to_byte_shape`, the others typed), so the rest of the loader is
unchanged. Little-endian GGUF v2 and v3, the only ones llama.cpp writes today; anything else is refused
naming the file and what was found.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types: their struct code and size (STRING = 8 and ARRAY = 9 are read apart).
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16}
_PLAIN_TYPES |= {"I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor: `shape` as GGUF stores it (innermost first), `data` as gguf.GGUFReader's tensors hold
    it."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    data: np.ndarray


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file's metadata (key -> value) and tensors, in file order."""

    meta: dict[str, Any]
    tensors: list[GgufTensor]


class _Cursor:
    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer, self.offset, self.path = buffer, 0, path

    def scalar(self, code: str, size: int) -> Any:
        if self.offset + size > len(self.buffer):
            raise ValueError(f"{self.path.name}: GGUF header ends early, at byte {self.offset}")
        (value,) = struct.unpack_from(code, self.buffer, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = self.scalar("<Q", 8)
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError(
                f"{self.path.name}: GGUF string runs past the end of the file at byte {self.offset}"
            )
        text = str(self.buffer[self.offset : end], "utf-8")
        self.offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I", 4), self.scalar("<Q", 8)
            if item_kind == _STRING:
                return [self.string() for _ in range(count)]
            if item_kind in _NUMPY:
                size = _SCALARS[item_kind][1] * count
                values = np.frombuffer(self.buffer, _NUMPY[item_kind], count, self.offset).tolist()
                self.offset += size
                return values
            return [self.value(item_kind) for _ in range(count)]  # arrays of arrays
        if kind not in _SCALARS:
            raise ValueError(f"{self.path.name}: unknown GGUF value type {kind} at byte {self.offset}")
        return self.scalar(*_SCALARS[kind])


def read_gguf(path: str | Path) -> GgufFile:
    """Reads a GGUF file's header and maps its tensors (nothing is copied or dequantized)."""
    import gguf

    path = Path(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped), path)
    magic = bytes(cursor.buffer[:4])
    if magic != _MAGIC:
        raise ValueError(f"{path.name}: not a GGUF file (starts with {magic!r}, expected {_MAGIC!r})")
    cursor.offset = 4
    version = cursor.scalar("<I", 4)
    if version not in (2, 3):
        raise ValueError(
            f"{path.name}: GGUF version {version} (byte order or version) is not read; 2 and 3 are"
        )
    n_tensors, n_fields = cursor.scalar("<Q", 8), cursor.scalar("<Q", 8)
    meta: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cursor.string()
        meta[key] = cursor.value(cursor.scalar("<I", 4))
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = tuple(cursor.scalar("<Q", 8) for _ in range(cursor.scalar("<I", 4)))
        infos.append((name, dims, cursor.scalar("<I", 4), cursor.scalar("<Q", 8)))
    alignment = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, dims, raw_type, offset in infos:
        kind = gguf.GGMLQuantizationType(raw_type)
        n_elements = int(np.prod(dims)) if dims else 1
        np_dims = tuple(reversed(dims))
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        plain = _PLAIN_TYPES.get(kind.name)
        first = start + offset
        if plain is not None:
            data = np.frombuffer(mapped, plain, n_elements, first).reshape(np_dims)
        else:
            n_bytes = n_elements * type_size // block
            byte_shape = gguf.quants.quant_shape_to_byte_shape(np_dims, kind)
            data = np.frombuffer(mapped, np.uint8, n_bytes, first).reshape(byte_shape)
        tensors.append(GgufTensor(name, kind, dims, n_elements, data))
    return GgufFile(meta, tensors)
