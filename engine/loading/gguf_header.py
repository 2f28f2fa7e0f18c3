"""A GGUF file's header, its metadata and tensor table, read in bulk without touching the
tensor data.

Why not the `gguf` package's `GGUFReader`: it builds one numpy view for every element of every
metadata array, so Gemma 3's 262,144-token vocabulary (tokens, scores, types) takes it ~10 s
and a Llama 3 vocabulary with its merges ~5 s, and a GGUF's first conversion read the header
that way three times (ours, then transformers' config and its tokenizer's). Here a numeric
array is one `frombuffer`, and an array of strings is walked only for its length unless asked
for. The layout is GGUF's own (version 2 and 3, little-endian: llama.cpp's ggml/docs/gguf.md);
the types' block sizes are the `gguf` package's (`GGML_QUANT_SIZES`), and the tests check this
reading against `GGUFReader`'s on crafted files holding every value type and on the embedded
model.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Container
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # what GGUFReader reads; v1 counted in 32 bits and is gone from the wild
_DEFAULT_ALIGNMENT = 32

_UINT32, _STRING, _ARRAY = 4, 8, 9
# The fixed-width value types: GGUFValueType's number -> struct format (little-endian).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_NUMPY = {code: np.dtype(fmt) for code, fmt in _SCALARS.items()}


@dataclass(frozen=True)
class HeaderTensor:
    """Where one tensor's data lies: `kind` is its ggml type's name (`GGMLQuantizationType`),
    `shape` in torch order (the file lists the fastest-moving dimension first), `offset` from
    the start of the file."""

    name: str
    kind: str
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """`metadata`: each key's value as `GGUFReader`'s `contents()` gives it (numbers, strings,
    arrays as lists), except arrays of strings not asked for, which are absent from it;
    `array_lengths`: every array's length, those included."""

    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[HeaderTensor, ...]

    @property
    def arch(self) -> str:
        return str(self.metadata["general.architecture"])


def read_header(path: Path, string_arrays: Container[str] = ()) -> GGUFHeader:
    """The header of the GGUF file at `path`, with the arrays of strings named in
    `string_arrays` read too. ValueError where the file is not a readable GGUF (magic,
    version, byte order, a count or length past its end, an unknown type)."""
    if path.stat().st_size < 24:
        raise ValueError(f"{path}: too short for a GGUF file")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        try:
            return _Parser(blob, string_arrays).header()
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise ValueError(f"{path}: a damaged GGUF header ({exc})") from exc
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc


class _Parser:
    def __init__(self, blob: mmap.mmap, string_arrays: Container[str]) -> None:
        self.blob = blob
        self.pos = 0
        self.string_arrays = string_arrays

    def header(self) -> GGUFHeader:
        if self.blob[:4] != _MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self.blob, 4)
        if version not in _VERSIONS:
            swapped = version & 0xFFFF == 0 and (version >> 24) in _VERSIONS
            raise ValueError(
                "a big-endian GGUF, which is not served (convert it little-endian)"
                if swapped
                else f"GGUF version {version}; versions {_VERSIONS} are read"
            )
        self.pos = 24
        metadata: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        for _ in range(self._count(kv_count, 12)):
            key = self._string()
            if key in metadata or key in lengths:
                raise ValueError(f"the metadata key {key!r} appears twice")
            kind = self._unpack("<I")
            if key == "general.alignment" and kind != _UINT32:
                raise ValueError("general.alignment is not a uint32")
            if kind == _ARRAY:
                item_kind, length = self._unpack("<I"), self._unpack("<Q")
                lengths[key] = length
                if item_kind == _STRING and key not in self.string_arrays:
                    self._skip_strings(length)
                    continue
                metadata[key] = self._array(item_kind, length)
            else:
                metadata[key] = self._value(kind)
        if "general.architecture" not in metadata:
            raise ValueError("no general.architecture in the metadata")
        entries = [self._tensor_entry() for _ in range(self._count(tensor_count, 24))]
        names = {name for name, *_ in entries}
        if len(names) < len(entries):
            raise ValueError("a tensor name appears twice")
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):  # a uint32, checked above
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-self.pos // alignment) * alignment
        tensors = tuple(
            HeaderTensor(name, kind, shape, data_start + offset, _num_bytes(kind, shape))
            for name, kind, shape, offset in entries
        )
        for tensor in tensors:
            if tensor.offset + tensor.num_bytes > len(self.blob):
                raise ValueError(
                    f"tensor {tensor.name!r} runs past the end of the file (truncated?)"
                )
        return GGUFHeader(metadata, lengths, tensors)

    def _tensor_entry(self) -> tuple[str, str, tuple[int, ...], int]:
        from gguf import GGMLQuantizationType

        name = self._string()
        dims = self._unpack("<I")
        shape = struct.unpack_from(f"<{self._count(dims, 8)}Q", self.blob, self.pos)
        self.pos += 8 * dims
        kind, offset = struct.unpack_from("<IQ", self.blob, self.pos)
        self.pos += 12
        try:
            type_name = GGMLQuantizationType(kind).name
        except ValueError:
            raise ValueError(f"tensor {name!r} has the unknown ggml type {kind}") from None
        return name, type_name, tuple(reversed(shape)), offset

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {kind}")
        return self._unpack(fmt)

    def _array(self, kind: int, length: int) -> list[Any]:
        if kind == _ARRAY:  # as llama.cpp's reader, which refuses them too
            raise ValueError("an array of arrays in the metadata")
        dtype = _NUMPY.get(kind)
        if dtype is None:  # strings
            return [self._value(kind) for _ in range(self._count(length, 8))]
        values = np.frombuffer(self.blob, dtype, self._count(length, dtype.itemsize), self.pos)
        self.pos += values.nbytes
        result: list[Any] = values.tolist()
        return result

    def _skip_strings(self, length: int) -> None:
        blob, pos = self.blob, self.pos
        for _ in range(self._count(length, 8)):
            pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
        if pos > len(blob):
            raise ValueError("an array of strings runs past the end of the file")
        self.pos = pos

    def _string(self) -> str:
        size = self._unpack("<Q")
        end = self.pos + self._count(size, 1)
        text = self.blob[self.pos : end].decode("utf-8")
        self.pos = end
        return text

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _count(self, count: int, item_bytes: int) -> int:
        """`count` items of at least `item_bytes` each, checked to fit in what is left of the
        file: a damaged count is an error here, not a loop of 2**63 steps."""
        if count * item_bytes > len(self.blob) - self.pos:
            raise ValueError(f"a count of {count} at byte {self.pos} runs past the end of the file")
        return count


def _num_bytes(kind: str, shape: tuple[int, ...]) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    if shape and shape[-1] % block:  # a row of whole blocks, as llama.cpp checks
        raise ValueError(f"a {kind} tensor of shape {shape}: rows not whole blocks of {block}")
    return prod(shape) // block * block_bytes


def tensor_values(path: Path, tensor: HeaderTensor) -> np.ndarray:
    """A small F32 or F16 tensor's values as float32 (RoPE factors), read from the file."""
    dtypes: dict[str, np.dtype[Any]] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2")}
    dtype = dtypes.get(tensor.kind)
    if dtype is None:
        raise ValueError(f"tensor {tensor.name!r} is {tensor.kind}, not F32 or F16")
    count = tensor.num_bytes // dtype.itemsize
    values = np.fromfile(path, dtype, count, offset=tensor.offset)
    if values.size != count:
        raise ValueError(f"{path} is truncated at tensor {tensor.name!r}")
    result: np.ndarray = values.astype(np.float32)
    return result
