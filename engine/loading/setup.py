"""From EngineConfig to a ready model, tokenizer and KV pool (the slow, once-per-process part)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.core.config import EngineConfig, GiB, default_cache_dir
from engine.core.cpu import cpu_features
from engine.core.errors import ModelLoadError
from engine.core.memory import huge_page_bytes, return_freed_memory, transparent_huge_pages
from engine.executor.attention import use_cuda_sdpa_without_cudnn
from engine.executor.kernels import (
    NOT_BUILT,
    KernelBuild,
    build_cpu_kernels,
    kernel_cache_key,
    kernel_target,
)
from engine.executor.models import CausalLM
from engine.executor.quantization import HeadRowsEmbedding, WeightFormat
from engine.kvcache.block_pool import BlockPool, KVCacheSpec, num_blocks_for
from engine.loading import quantized_cache
from engine.loading.build import (
    kernel_weights,
    load_gguf_quantized,
    load_model_weights,
    on_meta,
    pack_model,
    restore_quantized_model,
)
from engine.loading.config_cache import transformers_version
from engine.loading.source import (
    ModelSource,
    direct_gguf,
    load_chat_template,
    load_float_weights,
    load_hf_config,
    load_tokenizer,
    resolve_model,
    shipped_weight_format,
)
from engine.text.chat import template_defaults
from engine.text.tool_format import tool_format_of, tool_prompt_of

logger = logging.getLogger(__name__)

# The default KV pool holds what the scheduler can ever use at once, max_num_seqs sequences of
# max_model_len tokens, capped by a share of memory. The old default, a flat 20% of RAM up to
# 4 GiB, let one SmolLM2 server reach 4.9 GB RSS on a 24 GiB machine.
DEFAULT_CPU_KV_SHARE = 0.1  # of total RAM, capped at DEFAULT_CPU_KV_CAP
DEFAULT_CPU_KV_CAP = 2 * GiB
DEFAULT_CUDA_KV_SHARE = 0.85  # of free device memory after the weights


@dataclass
class LoadedModel:
    name: str
    model: CausalLM
    tokenizer: Any
    pool: BlockPool
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    # decode attention and the layers' fused ops run engine/executor/kernels' C++ (built for
    # this CPU); `kernels` says whether they built, for which target, and why not
    has_cpu_kernels: bool = False
    kernels: KernelBuild = NOT_BUILT
    # A position's logits have the same bits in any batch and chunk: the C++ kernels with
    # the quantized weights on them (dense float weights go through oneDNN, whose GEMMs
    # change with the batch's shape, in float32 too: docs/architecture.md). Speculative
    # decoding's promise (the tokens without drafts) needs it.
    is_batch_invariant: bool = False
    # Everything that decides the bits of this engine's KV (engine/kv_snapshots.py): a
    # snapshot is used only where every entry is equal.
    kv_identity: dict[str, str] = dataclasses.field(default_factory=dict)


def load_model(config: EngineConfig) -> LoadedModel:
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    defaults: dict[str, Any] = {}
    if config.default_chat_template_kwargs is not None:  # checked before anything loads
        try:
            defaults = template_defaults(config.default_chat_template_kwargs)
        except ValueError as exc:
            raise ModelLoadError(f"--default-chat-template-kwargs: {exc}") from exc
    start = time.perf_counter()
    kernel_build = _start_kernel_build(config)
    source = resolve_model(config.model)
    hf_config = load_hf_config(source.path)
    tokenizer = load_tokenizer(source.path)
    # parsing tokenizer.json leaves its temporaries in the heap (Gemma 3's 262k-token one:
    # ~190 MB), which the weights' load would otherwise stack its own peak on
    return_freed_memory()
    if config.chat_template is not None:
        tokenizer.chat_template = load_chat_template(Path(config.chat_template))
        logger.info("chat template: from %s", config.chat_template)
    elif tokenizer.chat_template:
        logger.info("chat template: the model's own")
    else:
        logger.info("chat template: none (chat requests get a 400 naming --chat-template)")
    if defaults:
        tokenizer.template_defaults = defaults
        logger.info("chat template variables unless a request sets them: %s", defaults)
    if tokenizer.chat_template:
        tool_prompt = tool_prompt_of(tokenizer.chat_template)
        tool_format = tool_format_of(tokenizer.chat_template, tokenizer.get_added_vocab())
        logger.info(
            "tool calls: %s format (%s%s)",
            tool_format.name,
            tool_prompt.words,
            "; tags as tokens: " + " ".join(sorted(tag for tag, _ in tool_format.token_tags))
            if tool_format.token_tags
            else "",
        )
    max_model_len = _max_model_len(hf_config, config.max_model_len, source.path)
    spec = _kv_spec(config, on_meta(hf_config, 1, config.torch_dtype))
    num_blocks = config.num_kv_blocks or _blocks_from_memory(config, spec, max_model_len)
    max_model_len = _fitted_max_model_len(config, max_model_len, num_blocks)
    kernels = kernel_build.result() if kernel_build is not None else NOT_BUILT
    kernels_built = kernels.is_built
    if config.torch_device.type == "cuda":
        logger.info("attention on CUDA: %s", use_cuda_sdpa_without_cudnn())
    weights = weight_format(config, source, kernels_built)
    dtype = config.torch_dtype
    if weights.is_quantized:
        model = _quantized_model(hf_config, source, max_model_len, dtype, weights)
    else:
        model = load_model_weights(
            hf_config,
            load_float_weights(source, hf_config),
            max_model_len,
            dtype,
            config.torch_device,
            weights,
        )
    pack_model(model, config.torch_device, dtype)
    return_freed_memory()
    logger.info(
        "model %s (%s, %d layers%s) on %s [%s, %d threads], compute %s%s, %s, %s, loaded in %.1f s",
        source.name,
        hf_config.model_type,
        len(model.attention_layers()),
        f", sliding window {model.sliding_window} keys" if model.sliding_window else "",
        config.device,
        cpu_features().describe() if config.torch_device.type == "cpu" else "CUDA",
        torch.get_num_threads(),
        str(dtype).removeprefix("torch."),
        " (--dtype auto)" if config.dtype == "auto" else "",
        weights.describe(dtype) + _embedding_note(model),
        kernels.describe(),
        time.perf_counter() - start,
    )
    streamed = kernel_weights(model)
    if streamed:
        size = sum(t.nbytes for t in streamed)
        logger.info(
            "quantized weights: %d of %d MB on 2 MB pages (transparent huge pages: %s)",
            min(huge_page_bytes(streamed), size) >> 20,
            size >> 20,
            transparent_huge_pages() or "none",
        )
    del streamed
    pool = _make_pool(config, spec, num_blocks)
    has_cpu_kernels = kernels_built and model.head_dim % 8 == 0  # the kernels' width
    if weights.is_quantized and weights.dense_copies:
        logger.info("quantized linears run on their dense copies: no CPU kernels")
    return LoadedModel(
        name=source.name,
        model=model,
        tokenizer=tokenizer,
        pool=pool,
        max_model_len=max_model_len,
        eos_token_ids=_eos_token_ids(hf_config, tokenizer, source.path),
        vocab_size=int(hf_config.vocab_size),
        has_cpu_kernels=has_cpu_kernels,
        kernels=kernels,
        is_batch_invariant=has_cpu_kernels and weights.is_quantized and not weights.dense_copies,
        kv_identity=kv_identity(
            config, source, hf_config, max_model_len, weights, spec, has_cpu_kernels
        ),
    )


def _start_kernel_build(config: EngineConfig) -> Future[KernelBuild] | None:
    """The CPU kernels, built (about a minute on 2 cores, the first time on a machine) while
    the model is resolved: its compiler runs in child processes, as a GGUF's conversion does,
    and the weights' layout waits for the answer (the kernels or the dense copies). A daemon
    thread: a start that fails meanwhile exits without waiting for the compiler."""
    if not (config.enable_compile and config.torch_device.type == "cpu"):
        return None
    future: Future[KernelBuild] = Future()

    def build() -> None:
        try:
            future.set_result(build_cpu_kernels(default_cache_dir()))
        except BaseException as exc:  # handed to the waiting thread
            future.set_exception(exc)

    threading.Thread(target=build, name="kernel-build", daemon=True).start()
    return future


def kv_identity(
    config: EngineConfig,
    source: ModelSource,
    hf_config: Any,
    max_model_len: int,
    weights: WeightFormat,
    spec: KVCacheSpec,
    has_cpu_kernels: bool,
) -> dict[str, str]:
    """What decides the bits of the KV this engine computes, fact by fact (a snapshot's
    mismatch is logged by name). The weights are known as the quantized cache knows them
    (`ModelSource.weights_identity`: a GGUF by its content, a folder's files by name, size
    and mtime). The config (RoPE base and scaling, norms' eps), transformers (scaled RoPE's
    tables) and the context length (LongRoPE picks its factors by it) decide the rotation of
    every K."""
    digest = hashlib.sha256(source.weights_identity().encode())
    device = config.torch_device
    model_config = hashlib.sha256(hf_config.to_json_string(use_diff=False).encode())
    return {
        "model": source.name,
        "model_files": digest.hexdigest()[:32],
        "model_config": model_config.hexdigest()[:16],
        "max_model_len": str(max_model_len),
        "weights": weights.describe(config.torch_dtype),
        "compute_dtype": str(config.torch_dtype).removeprefix("torch."),
        "kv_cache": f"{str(spec.dtype).removeprefix('torch.')} {spec.num_layers}x{spec.block_size}"
        f"x{spec.num_kv_heads}x{spec.head_dim}",
        "kernels": f"{kernel_target()} {kernel_cache_key()}" if has_cpu_kernels else "torch",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": transformers_version(),
        "threads": str(torch.get_num_threads()),
        "code": _numeric_code_digest(),
    }


# The code that turns weights and tokens into K/V: another version of it (a kernel's reduction
# order, a layer's op) may give other bits, so its sources are part of the KV's identity.
_NUMERIC_CODE = (Path(__file__).parents[1] / "executor", Path(__file__).parent)


def _numeric_code_digest() -> str:
    digest = hashlib.sha256()
    for folder in _NUMERIC_CODE:
        for path in sorted(folder.rglob("*")):
            if path.suffix in (".py", ".cpp", ".h"):
                digest.update(path.relative_to(folder).as_posix().encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _quantized_model(
    hf_config: Any,
    source: ModelSource,
    max_model_len: int,
    dtype: torch.dtype,
    weights: WeightFormat,
) -> CausalLM:
    """A quantized model from its cache file, or quantized from the float weights and cached.

    A Llama-family GGUF's blocks are read straight into the kernel's layout, tensor by tensor
    (engine/gguf_weights.py); other sources are quantized from their float weights, read whole
    (the float32 model in memory at once). Cached either way: building takes ~1 s from a GGUF
    and much longer from floats, while the cached quantized weights and dense
    copies load at the size they serve at."""
    path = quantized_cache.cache_file(source, weights, dtype)
    if path.is_file():
        try:
            state = quantized_cache.read(path, weights)
            return restore_quantized_model(hf_config, state, max_model_len, dtype, weights)
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            logger.warning("ignoring the quantized cache %s: %s", path, exc)
    gguf = direct_gguf(source, hf_config)
    if gguf is not None:
        try:
            model = load_gguf_quantized(hf_config, gguf, max_model_len, dtype, weights)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read the weights of {source.gguf_path}: {exc}") from exc
    else:
        state = load_float_weights(source, hf_config)
        model = load_model_weights(
            hf_config, state, max_model_len, dtype, torch.device("cpu"), weights
        )
    quantized_cache.write(model, path)
    return model


def weight_format(config: EngineConfig, source: ModelSource, kernels_built: bool) -> WeightFormat:
    """`--quantization` resolved: auto keeps a GGUF file's own blocks on CPU (each linear at
    its type's width: engine.loading.source.shipped_weight_format) and a Hugging Face
    folder's float weights; int4 / int8 quantize at load. The quantized kernel is CPU-only: a
    GPU serves the float weights. Dense copies are kept only where the kernel is not built:
    every call takes one path."""
    choice = config.quantization
    if config.torch_device.type != "cpu":
        if choice in ("int4", "int8"):
            raise ModelLoadError(f"--quantization {choice} runs on CPU only")
        return WeightFormat()
    if choice == "auto":
        weights = shipped_weight_format(source)
    elif choice == "none":
        weights = WeightFormat()
    else:
        weights = WeightFormat(layers=choice, head="int8")
    return dataclasses.replace(weights, dense_copies=not kernels_built)


def _embedding_note(model: CausalLM) -> str:
    if isinstance(getattr(model, "embed_tokens", None), HeadRowsEmbedding):
        return " (the tied embedding read from the head's blocks: no float table)"
    return ""


def _max_model_len(hf_config: Any, requested: int | None, path: Path) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or hf_config.n_positions
    if requested is not None and requested > limit:
        raise ModelLoadError(
            f"max_model_len {requested} exceeds the model's limit {limit} ({path})"
        )
    return int(requested or limit)


def _kv_spec(config: EngineConfig, model: CausalLM) -> KVCacheSpec:
    """The KV cache's shape for `model` (built on the meta device: its attributes only)."""
    return KVCacheSpec(
        num_layers=len(model.attention_layers()),
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=config.block_size,
        dtype=config.kv_torch_dtype,
    )


def _fitted_max_model_len(config: EngineConfig, max_model_len: int, num_blocks: int) -> int:
    """`max_model_len`, or where the pool cannot hold one such sequence: half the pool when
    it is the model's own limit (Llama 3.2's 131072 against a 2 GiB default pool: the server
    starts, saying so, as llama.cpp starts with a smaller context; the other half is for
    other sequences and the registry's pinned prefixes, which must leave a max_model_len
    request room), an error when --max-model-len asked for it."""
    tokens = num_blocks * config.block_size
    if tokens >= max_model_len:
        return max_model_len
    if config.max_model_len is not None:
        raise ModelLoadError(
            f"the KV cache holds {tokens} tokens, less than one max_model_len sequence "
            f"({max_model_len}); raise --kv-cache-memory or lower --max-model-len"
        )
    served = max(1, num_blocks // 2) * config.block_size
    logger.warning(
        "max_model_len %d (the model's limit) is more than the KV cache holds (%d tokens): "
        "serving %d tokens a sequence, half of it (--max-model-len, --kv-cache-memory to "
        "choose)",
        max_model_len,
        tokens,
        served,
    )
    return served


def _make_pool(config: EngineConfig, spec: KVCacheSpec, num_blocks: int) -> BlockPool:
    pool = BlockPool(spec, num_blocks)
    logger.info(
        "KV cache: %d blocks of %d tokens in %s (%d tokens, %.2f GiB, %.1f KB/token)",
        num_blocks,
        config.block_size,
        str(spec.dtype).removeprefix("torch."),
        num_blocks * config.block_size,
        num_blocks * spec.bytes_per_block / GiB,
        spec.bytes_per_block / config.block_size / 1024,
    )
    return pool


def _blocks_from_memory(config: EngineConfig, spec: KVCacheSpec, max_model_len: int) -> int:
    if config.kv_cache_memory is not None:
        return max(1, config.kv_cache_memory // spec.bytes_per_block)
    wanted = config.max_num_seqs * num_blocks_for(max_model_len, config.block_size)
    if config.torch_device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(config.torch_device)
        cap, rule = int(free * DEFAULT_CUDA_KV_SHARE), f"{DEFAULT_CUDA_KV_SHARE:.0%} of free memory"
    else:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cap = min(int(ram * DEFAULT_CPU_KV_SHARE), DEFAULT_CPU_KV_CAP)
        rule = f"{DEFAULT_CPU_KV_SHARE:.0%} of RAM, at most {DEFAULT_CPU_KV_CAP / GiB:.0f} GiB"
    num_blocks = max(1, min(wanted, cap // spec.bytes_per_block))
    logger.info(
        "KV cache sized by default: max_num_seqs %d x max_model_len %d = %.2f GiB, capped at "
        "%.2f GiB (%s): %s (--kv-cache-memory or --num-kv-blocks to choose)",
        config.max_num_seqs,
        max_model_len,
        wanted * spec.bytes_per_block / GiB,
        cap / GiB,
        rule,
        "capped" if num_blocks < wanted else "not capped",
    )
    return num_blocks


def _eos_token_ids(hf_config: Any, tokenizer: Any, path: Path) -> frozenset[int]:
    ids: set[int] = set()
    for value in (
        getattr(hf_config, "eos_token_id", None),
        tokenizer.eos_token_id,
        _generation_eos(path),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _generation_eos(path: Path) -> Any:
    """`generation_config.json`'s `eos_token_id` (an id or a list), read as transformers'
    `GenerationConfig` reads it."""
    try:
        data = json.loads((path / "generation_config.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path / 'generation_config.json'}: {exc}") from exc
    return data.get("eos_token_id") if isinstance(data, dict) else None
