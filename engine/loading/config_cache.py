"""The model's config and tokenizer, resolved once by transformers' Auto classes, then read
from our cache without transformers.

Why: importing transformers costs 0.6-1.0 s of every start and every replica replacement on
a 2-vCPU machine, and its per-family config modules import most of the rest of it (the
Llama one reaches `torch.distributed.tensor` through its hub-kernels integration), for a few
dozen numbers and a Rust tokenizer.

- The config: the first read goes through `AutoConfig` (its defaults, RoPE-parameter
  standardisation and derived fields such as Gemma 3's `layer_types`), and the result, every
  field filled in, is stored as JSON keyed by the config file's bytes and transformers'
  version. Every read, the first included, returns a `ModelConfig` of that JSON
  (engine/core/model_config.py): the engine sees the same object whether or not the cache
  was warm, so the KV identity and the model built from it cannot differ between a first
  start and the next.
- The tokenizer: the first load goes through `AutoTokenizer`, and what it built (its Rust
  tokenizer, post-processor and all, its special tokens and chat template) is stored as a
  folder keyed by the model's tokenizer files and transformers' version; every load returns
  the engine's `Tokenizer` (engine/text/tokenizer.py) read from that folder.

transformers' version is read from its installed metadata, which does not import it. A
missing, unreadable or foreign cache entry is a fresh read through the Auto class; a cache
folder that cannot be written is a warning, never a failed start.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.core.errors import ModelLoadError
from engine.core.model_config import ModelConfig
from engine.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

FORMAT = 2  # of the stored entries: a change here makes every old entry a miss
# The files a tokenizer is built from (transformers reads no others for one).
TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.txt",
    "spiece.model",
    "tekken.json",
    "tiktoken.model",
)


def cached_hf_config(path: Path, cache_dir: Path) -> ModelConfig:
    """`path/config.json` as the engine uses it (see the module's docstring)."""
    config_path = path / "config.json"
    try:
        raw = config_path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
    key = hashlib.sha256(raw + f"|{transformers_version()}|{FORMAT}".encode()).hexdigest()
    entry_path = cache_dir / "configs" / f"{key[:32]}.json"
    entry = _read_entry(entry_path, key)
    if entry is None:
        entry = _fresh_entry(path, config_path, key)
        _write_entry(entry_path, entry)
    return rebuild(entry, path)


def cached_tokenizer(path: Path, cache_dir: Path) -> Tokenizer:
    """The tokenizer `AutoTokenizer.from_pretrained(path)` builds, as the engine's
    `Tokenizer`; transformers is imported only when the cache has no entry for it."""
    versions = f"{transformers_version()}|{_version('tokenizers')}|{FORMAT}"
    digest = hashlib.sha256(versions.encode())
    extra_templates = sorted((path / "additional_chat_templates").glob("*.jinja"))
    for file in [path / name for name in TOKENIZER_FILES] + extra_templates:
        digest.update(str(file.relative_to(path)).encode() + b"|" + _file_digest(file))
    entry = cache_dir / "tokenizers" / digest.hexdigest()[:32]
    if entry.is_dir():
        try:
            return Tokenizer.load(entry)
        except Exception as exc:  # the Rust tokenizer raises bare Exceptions
            logger.warning("cache entry %s unreadable (%s): resolving it afresh", entry, exc)
    tokenizer = Tokenizer.from_transformers(_auto_tokenizer(path))
    _write_tokenizer(entry, tokenizer)
    return tokenizer


def _file_digest(path: Path) -> bytes:
    """The file's SHA-256, read a MiB at a time: Gemma 3's 33 MB tokenizer.json read whole
    (and copied once more to hash) stayed in the heap as ~100 MB of RSS after being freed."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
    except FileNotFoundError:
        return b"absent"
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return digest.digest()


def _auto_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc


def _write_tokenizer(entry: Path, tokenizer: Tokenizer) -> None:
    """Written to a temporary folder and renamed: a reader sees a whole entry or none. A
    failed write (a full disk: the Rust tokenizer's save raises a bare Exception) is a
    warning; the start goes on with the tokenizer in memory."""
    temporary = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        temporary = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".entry-"))
        tokenizer.save(temporary)
        if entry.exists():  # an unreadable one: replaced
            shutil.rmtree(entry)
        os.replace(temporary, entry)
        temporary = None
    except Exception as exc:  # see the docstring
        logger.warning("cannot write the cache entry %s: %s", entry, exc)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)


def transformers_version() -> str:
    """The installed transformers' version, without importing it."""
    return _version("transformers")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def rebuild(entry: dict[str, Any], path: Path) -> ModelConfig:
    """A stored entry as the engine's config object for the model at `path`."""
    fields = dict(entry["config"])
    return ModelConfig(
        entry["class_name"], entry["model_type"], fields, entry["attribute_map"], str(path)
    )


def entry_of(config: PretrainedConfig, key: str) -> dict[str, Any]:
    """What is stored of a config transformers built: every field, and the class facts the
    fields do not carry."""
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
