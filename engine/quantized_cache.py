"""The quantized weights of a model, cached on disk so that only the first start quantizes.

Quantizing reads the whole float model first (the embedded one: 540 MB of float32, a 1.65 GB
peak RSS) and takes seconds; the cached planes and dense copies (in the compute dtype) load
at the size they serve at. A file is keyed by the model's weight files, the format, the dtype,
torch's version and the CPU capability; a damaged one is the caller's to ignore.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.loader import ModelSource, default_cache_dir, weight_files
from engine.models import CausalLM
from engine.quantization import WeightFormat, quantized_state

logger = logging.getLogger(__name__)

CACHE_VERSION = 1  # bump when quantized_state's layout changes


_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
}


def read(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file read into process memory with plain reads. safetensors' own loaders
    memory-map the file, and a mapped file stays resident (and counted in RSS) while any of
    its tensors lives: the quantized cache's dense copies, replaced by packing, kept ~270 MB
    of it mapped."""
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header: dict[str, Any] = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        base = 8 + header_len
        state = {}
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            tensor = torch.empty(end - start, dtype=torch.uint8)
            f.seek(base + start)
            if f.readinto(tensor.numpy()) != end - start:  # type: ignore[arg-type]
                raise ValueError(f"{path} is truncated at {name}")
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            state[name] = tensor.view(dtype).reshape(entry["shape"])
    return state


def cache_file(source: ModelSource, weights: WeightFormat, dtype: torch.dtype) -> Path:
    """Keyed by the weight files (name, size, mtime), the format, the dtype, torch's version
    and the CPU capability (the kernel's packed layout is torch's to choose)."""
    digest = hashlib.sha256(
        f"v{CACHE_VERSION}|{source.path}|{weights}|{dtype}|{torch.__version__}|"
        f"{torch.backends.cpu.get_cpu_capability()}".encode()
    )
    for file in weight_files(source.path):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    name = f"{source.path.name}-{digest.hexdigest()[:16]}.safetensors"
    return default_cache_dir() / "quantized" / name


def write(model: CausalLM, path: Path) -> None:
    assert isinstance(model, torch.nn.Module)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(quantized_state(model), tmp)
        os.replace(tmp, path)
        logger.info("cached the quantized weights at %s", path)
    except (OSError, RuntimeError) as exc:
        logger.warning("could not cache the quantized weights at %s: %s", path, exc)
