"""The model's config and tokenizer class, resolved once by transformers' Auto classes, then
from our cache.

Why: transformers' per-family config modules import most of transformers on the way (the
Llama one reaches `torch.distributed.tensor` through its hub-kernels integration): 2.4-2.7 s
of every start and every replica replacement on a 2-vCPU machine, for a few dozen numbers.
The first read goes through `AutoConfig` (its defaults, rope-parameter standardisation and
derived fields such as Gemma 3's `layer_types`), and the result, every field filled in, is
stored as JSON keyed by the config file's bytes and transformers' version. Every read, the
first included, then returns the config rebuilt from that JSON on transformers' base class,
with the family's `model_type` and `attribute_map` (GPT-2's `n_embd` is its `hidden_size`):
the engine sees the same object whether or not the cache was warm, so the KV identity and
the model built from it cannot differ between a first start and the next.

`AutoTokenizer` resolves the tokenizer's class through the same config module, so the class
it picks is remembered too (keyed by the config and tokenizer_config files and the version)
and later loads call that class's own `from_pretrained`, as `AutoTokenizer` does once it
knows the class.

A missing, unreadable or foreign cache entry is a fresh read through the Auto class; a cache
folder that cannot be written is a warning, never a failed start.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.core.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FORMAT = 1  # of the stored entry: a change here makes every old entry a miss


def cached_hf_config(path: Path, cache_dir: Path) -> PretrainedConfig:
    """`path/config.json` as the engine uses it (see the module's docstring)."""
    import transformers

    config_path = path / "config.json"
    try:
        raw = config_path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
    key = hashlib.sha256(raw + f"|{transformers.__version__}|{FORMAT}".encode()).hexdigest()
    entry_path = cache_dir / "configs" / f"{key[:32]}.json"
    entry = _read_entry(entry_path, key)
    if entry is None:
        entry = _fresh_entry(path, config_path, key)
        _write_entry(entry_path, entry)
    config = rebuild(entry)
    config._name_or_path = str(path)  # as from_pretrained sets it (an entry serves any copy)
    return config


def cached_tokenizer(path: Path, cache_dir: Path) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(path)`, without its config-module imports once the class
    it resolves to is known."""
    import transformers

    digest = hashlib.sha256(f"{transformers.__version__}|{FORMAT}".encode())
    for name in ("config.json", "tokenizer_config.json"):
        try:
            digest.update(name.encode() + (path / name).read_bytes())
        except OSError:
            digest.update(name.encode() + b"|absent")
    key = digest.hexdigest()
    entry_path = cache_dir / "tokenizers" / f"{key[:32]}.json"
    entry = _read_entry(entry_path, key)
    if entry is not None:
        try:
            tokenizer_class = getattr(importlib.import_module(entry["module"]), entry["name"])
        except (ImportError, AttributeError, KeyError, TypeError) as exc:
            logger.warning(
                "tokenizer class in %s not importable (%s): resolving it afresh", entry_path, exc
            )
        else:
            return _tokenizer(tokenizer_class, path)
    from transformers import AutoTokenizer

    tokenizer = _tokenizer(AutoTokenizer, path)
    resolved = type(tokenizer)
    _write_entry(
        entry_path, {"key": key, "module": resolved.__module__, "name": resolved.__qualname__}
    )
    return tokenizer


def _tokenizer(loader: Any, path: Path) -> PreTrainedTokenizerBase:
    try:
        tokenizer: PreTrainedTokenizerBase = loader.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc
    return tokenizer


def rebuild(entry: dict[str, Any]) -> PretrainedConfig:
    """A stored entry as a config object: the base class under the family's name."""
    from transformers import PretrainedConfig

    family: type[PretrainedConfig] = type(
        entry["class_name"],
        (PretrainedConfig,),
        {"model_type": entry["model_type"], "attribute_map": dict(entry["attribute_map"])},
    )
    data = dict(entry["config"])
    config: PretrainedConfig = family.from_dict(data)
    present = config.to_dict()
    for key, value in data.items():  # what the base class takes as a keyword and drops
        if key not in present:  # (`use_cache`): kept, so the dict matches transformers' own
            setattr(config, key, value)
    return config


def entry_of(config: PretrainedConfig, key: str) -> dict[str, Any]:
    """What is stored of a config transformers built: every field, and the class facts the
    base class does not carry."""
    return {
        "key": key,
        "class_name": type(config).__name__,
        "model_type": config.model_type,
        "attribute_map": dict(getattr(type(config), "attribute_map", {}) or {}),
        "config": json.loads(config.to_json_string(use_diff=False)),
    }


def _fresh_entry(path: Path, config_path: Path, key: str) -> dict[str, Any]:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {config_path}: {exc}") from exc
    return entry_of(config, key)


def _read_entry(entry_path: Path, key: str) -> dict[str, Any] | None:
    try:
        entry = json.loads(entry_path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("cache entry %s unreadable (%s): resolving it afresh", entry_path, exc)
        return None
    if not isinstance(entry, dict) or entry.get("key") != key:
        logger.warning("cache entry %s is not this one's: resolving it afresh", entry_path)
        return None
    return entry


def _write_entry(entry_path: Path, entry: dict[str, Any]) -> None:
    """Written to a temporary file and renamed: a reader sees a whole entry or none."""
    temporary = None
    try:
        entry_path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=entry_path.parent, prefix=".entry-", suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump(entry, out)
        os.replace(temporary, entry_path)
    except OSError as exc:
        logger.warning("cannot write the cache entry %s: %s", entry_path, exc)
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
