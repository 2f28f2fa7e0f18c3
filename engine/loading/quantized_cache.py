"""The quantized weights of a model, cached on disk so that only the first start quantizes.

Quantizing reads the whole float model first (the embedded one: 540 MB of float32) and takes
seconds; the cached quantized weights and dense copies (in the compute dtype) load at the size
they serve at. A file is keyed by the model's weight files, the format, the dtype, torch's
version and the source of the code that lays the codes out; a damaged one is the caller's to
ignore.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

import torch

from engine.core.config import default_cache_dir
from engine.core.memory import huge_pages_available
from engine.core.unused_files import mark_used, remove_if_unused
from engine.executor import quantization
from engine.executor.models import CausalLM
from engine.executor.quantization import WeightFormat, quantized_state
from engine.loading import gguf, safetensors_io
from engine.loading.source import ModelSource

logger = logging.getLogger(__name__)

# bump when quantized_state's layout changes (3: a tied embedding may be absent, read from the
# head's rows; 4: no min row in the scales where every m is 0, 5-bit codes for the Q5 types;
# 5: tiles stored in pairs, group by group; 6: no min row beside a d per half where every m
# is 0, each weight's `halves` stored; 7: a fused linear of mixed file types as row blocks,
# each in its own layout)
CACHE_VERSION = 7
# The modules that decode a file's blocks and pack the kernel's layout: a cache written by other
# code is another key, so a layout changed without a version bump is never read as the new one
# (a Q5 tensor's first 5-bit layout read by the next one gave garbage tokens, in development).
_LAYOUT_SOURCES = (quantization.__file__, gguf.__file__)


# A model's other cache files kept beside the one in use: other dtypes, formats or servers on
# the host may load them. Beyond these, one unused for a week (engine/core/unused_files.py) is
# removed when a new one is written: each upgrade of the layout code or of torch keys a new
# file, and the old ones (the 1B Llama's: 0.8 GB each) would otherwise pile up for good.
KEEP_OTHERS = 2


def _layout_digest() -> str:
    digest = hashlib.sha256()
    for source in _LAYOUT_SOURCES:
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:16]


def read(path: Path, weights: WeightFormat) -> dict[str, torch.Tensor]:
    """A cached state, for `restore_quantized_model`; ValueError or OSError when damaged.
    Where the quantized kernel serves it (no dense copies), read onto huge pages if the
    kernel grants them (engine.core.memory.HugePageArena). Not with dense copies: packing
    replaces those, and the arena would keep their pages as long as the codes beside them."""
    huge_pages = not weights.dense_copies and huge_pages_available()
    state = safetensors_io.read(path, huge_pages=huge_pages)
    mark_used(path)  # for `prune`
    return state


def cache_file(source: ModelSource, weights: WeightFormat, dtype: torch.dtype) -> Path:
    """Keyed by the weights (`ModelSource.weights_identity`), the format, the dtype, torch's
    version and the layout code's source. The layout is ours
    (engine/executor/kernels/quant_matmul_kernel.h), the same on every CPU."""
    key = f"v{CACHE_VERSION}|{_layout_digest()}|{source.path}|{weights}|{dtype}|{torch.__version__}"
    digest = hashlib.sha256(key.encode())
    digest.update(source.weights_identity().encode())
    name = f"{source.path.name}-{digest.hexdigest()[:16]}.safetensors"
    return default_cache_dir() / "quantized" / name


def write(model: CausalLM, path: Path) -> None:
    assert isinstance(model, torch.nn.Module)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        safetensors_io.write(quantized_state(model), tmp)
        os.replace(tmp, path)
        logger.info("cached the quantized weights at %s", path)
    except (OSError, RuntimeError) as exc:
        logger.warning("could not cache the quantized weights at %s: %s", path, exc)
        return
    prune(path)


def prune(path: Path) -> None:
    """The cache files of `path`'s model (same name, other key) beyond the KEEP_OTHERS most
    recently used are removed if unused for a week. Never an error."""
    stem = path.name.rsplit("-", 1)[0]
    pattern = re.compile(rf"{re.escape(stem)}-[0-9a-f]{{16}}\.safetensors")
    try:
        others = [
            (entry.stat().st_mtime, entry)
            for entry in path.parent.iterdir()
            if entry != path and pattern.fullmatch(entry.name)
        ]
    except OSError as exc:
        logger.warning("could not list the quantized cache %s: %s", path.parent, exc)
        return
    for _, entry in sorted(others, reverse=True)[KEEP_OTHERS:]:
        remove_if_unused(entry)
