"""safetensors files read and written through process memory, tensor by tensor.

Why not the safetensors package's own functions: its loaders memory-map the file, and a
mapped file stays resident (counted in RSS) while any tensor points into it, so the float32
weights of a model being quantized could not be freed linear by linear (a 1.64 GB first-start
peak for the embedded model); its `save_file` first copies every tensor into a bytes object.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from engine.core.memory import HugePageArena

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def read(path: Path, huge_pages: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the file, each in memory of its own (with `huge_pages`, all in one
    `HugePageArena`: read straight onto 2 MB pages, not copied there later). Raises
    ValueError on a damaged or unsupported file, OSError when it cannot be read."""
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        try:
            header: dict[str, Any] = json.loads(f.read(header_len))
        except ValueError as exc:
            raise ValueError(f"{path}: not a safetensors file ({exc})") from exc
        header.pop("__metadata__", None)
        base = 8 + header_len
        state = {}
        sizes = [_data_bytes(path, name, entry) for name, entry in header.items()]
        if sum(sizes) > path.stat().st_size - base:
            raise ValueError(f"{path} is truncated: its header lists {sum(sizes)} bytes of data")
        arena = HugePageArena(sum(map(HugePageArena.span, sizes))) if huge_pages else None
        for (name, entry), size in zip(header.items(), sizes, strict=True):
            raw = arena.empty(size) if arena else torch.empty(size, dtype=torch.uint8)
            f.seek(base + entry["data_offsets"][0])
            if f.readinto(raw.numpy()) != size:  # type: ignore[arg-type]
                raise ValueError(f"{path} is truncated at {name}")
            state[name] = raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return state


def _data_bytes(path: Path, name: str, entry: Any) -> int:
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        raise ValueError(f"{path}: {name} has unsupported dtype {dtype}")
    start, end = entry.get("data_offsets", (0, -1))
    if not 0 <= start <= end:
        raise ValueError(f"{path}: {name} has data offsets {start}..{end}")
    return int(end - start)


def write(state: dict[str, torch.Tensor], path: Path) -> None:
    """The tensors (CPU, any layout) as one safetensors file, written from their own memory."""
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}
    write_stream(specs, iter(state.values()), path)


def write_stream(
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    tensors: Iterable[torch.Tensor],
    path: Path,
) -> None:
    """A safetensors file whose tensors are made one at a time, in `specs`' order, so that
    only one is ever in memory: the header, written first, needs only their dtypes and
    shapes. A tensor that does not match its spec is an error."""
    header: dict[str, Any] = {}
    offset = 0
    expected = []
    for name, (dtype, shape) in specs.items():
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        expected.append((name, dtype, tuple(shape)))
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    with path.open("wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for (name, dtype, shape), tensor in zip(expected, tensors, strict=True):
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: got {tensor.dtype} {list(tensor.shape)}")
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            f.write(flat.numpy().data)
