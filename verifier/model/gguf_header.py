"""A GGUF file's metadata and tensor table, read without its string arrays' contents.

gguf-py's `GGUFReader` builds a numpy view per element of every array, the tokenizer's tens of
thousands of strings included (seconds: docs/performance.md, "Load and import times"), where
Tercel needs only their count (the vocabulary size) but at a tokenizer's first conversion
(`verifier.model.gguf_convert`). This reads the
same fields and tensors in the shape the loader reads from `GGUFReader` (`fields[key].contents()`,
`tensors[i].name / tensor_type / shape / data_offset / n_bytes`), a string array's contents as
`StringCount` (its length only; `strings(key)` reads one when asked, as the tokenizer's builder
does). The format: github.com/ggml-org/ggml, docs/gguf.md.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from math import prod

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(frozen=True)
class StringCount:
    """A string array left unread: only its length."""
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class Field:
    value: object

    def contents(self):
        return self.value


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]        # ggml's order: the fastest-moving dimension first
    data_offset: int              # from the start of the file
    n_bytes: int


class GGUFHeader:
    """`fields` (key -> Field), `spans` (key -> where the field's bytes lie in the file) and
    `tensors` (TensorInfo, in file order) of a GGUF file."""

    def __init__(self, path: str):
        self.path = str(path)
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        if bytes(self.data[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", self.data, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not read here (2 and 3 are)")
        self._pos = 24
        self.fields, self.spans = {}, {}
        for _ in range(n_fields):
            start, key = self._pos, self._string()
            self.fields[key] = Field(self._value(self._u32()))
            self.spans[key] = (start, self._pos)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = -(-self._pos // align) * align
        self.tensors = [TensorInfo(name, GGMLQuantizationType(kind), dims, start + offset, _nbytes(kind, dims))
                        for name, dims, kind, offset in infos]

    def strings(self, key: str) -> list[str]:
        """The contents of string array `key` (read from its span; the header skipped them)."""
        start, end = self.spans[key]
        raw = bytes(self.data[start:end])          # one copy: indexing the map per string is slow
        pos = 8 + struct.unpack_from("<Q", raw, 0)[0]       # past the key
        kind, item, count = struct.unpack_from("<IIQ", raw, pos)
        if kind != _ARRAY or item != _STRING:
            raise ValueError(f"{self.path}: {key} is not an array of strings")
        pos, out = pos + 16, []
        for _ in range(count):
            n = struct.unpack_from("<Q", raw, pos)[0]
            out.append(raw[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        return out

    def _take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.data, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _u32(self) -> int:
        return self._take("<I")

    def _string(self) -> str:
        n = self._take("<Q")
        s = bytes(self.data[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._take(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        item, count = self._take("<I"), self._take("<Q")
        if item == _STRING:                   # skipped: each length read, no string built
            for _ in range(count):
                self._pos += 8 + struct.unpack_from("<Q", self.data, self._pos)[0]
            return StringCount(count)
        if item in _NUMPY:
            size = np.dtype(_NUMPY[item]).itemsize * count
            values = np.frombuffer(self.data, _NUMPY[item], count, self._pos).tolist()
            self._pos += size
            return values
        return [self._value(item) for _ in range(count)]         # arrays of arrays

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._take("<Q") for _ in range(self._u32()))
        kind = self._u32()
        return name, dims, kind, self._take("<Q")


def _nbytes(kind: int, dims: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    return prod(dims) // block * size
