"""Engine configuration: one frozen dataclass; CLI flags map one-to-one onto its fields."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.core.cpu import auto_dtype, auto_kv_dtype
from engine.core.errors import InvalidRequestError

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)
KV_DTYPES: dict[str, torch.dtype] = {**DTYPES, "float16": torch.float16}
KV_DTYPE_CHOICES = ("auto", *KV_DTYPES)
QUANTIZATIONS = ("auto", "int4", "int8", "none")
GiB = 1 << 30
# A step's token budget bounds how long running decodes stall behind prefills, and how many
# waiting requests share one long step before any of them gets a token. On CPU a 100-token
# suffix prefill takes ~0.1 s; over HTTP at concurrency 8 on the intent workload (bf16, 2
# cores) 512 tokens gave TTFT p50 1.0 s, 256 gave 0.60 s at 99 tok/s, 128 gave 0.38 s at
# 89 tok/s (docs/benchmarks.md). Long uncached prompts pay ~10% more TTFT in 128-token chunks.
SPECULATIVE_CHOICES = ("auto", "off")
DEFAULT_TOKEN_BUDGET = {"cpu": 128, "cuda": 2048}


def option(default: Any, help: str, **cli: Any) -> Any:
    """A config field with its command-line help: `prefixgate`'s flags are generated from the
    config dataclasses (gateway/flags.py), so each setting is named and explained once.

    `cli` may hold `flag` (another flag name), `choices`, `size=True` (accepts 2GiB, 512M),
    `env` (environment variable that gives the default), `repeat=True` (a tuple field whose
    flag is given once per value)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    """How to build and run the engine.

    `model=None` serves the embedded default model. The KV pool is sized by `num_kv_blocks`
    when given, else by `kv_cache_memory` bytes, else by a default share of RAM (CPU) or of
    free device memory (CUDA). `max_model_len=None` takes the model's own limit.
    """

    model: str | None = option(
        None, "local HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)"
    )
    device: str = option("cpu", "cpu or cuda[:N]")
    dtype: str = option(
        "auto",
        "compute and KV cache dtype; auto: bfloat16 on CUDA and on CPUs with native bf16 "
        "(AVX512_BF16, AMX), float32 otherwise",
        choices=DTYPE_CHOICES,
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage, widened to the compute dtype as attention reads it; auto: bfloat16 "
        "where compute is bfloat16, else float16 on CPUs with F16C (every AVX2 CPU), else the "
        "compute dtype. 16 bits read half the bytes per step and hold twice the tokens",
        choices=KV_DTYPE_CHOICES,
    )
    quantization: str = option(
        "auto",
        "CPU linear weights: int4 (GGML Q4_1, group 32; int8 head), int8 (Q8_0) or none; "
        "auto: as a .gguf file ships them, none for a Hugging Face folder",
        choices=QUANTIZATIONS,
    )
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "KV pool size in blocks")
    kv_cache_memory: int | None = option(
        None,
        "KV pool size in bytes, e.g. 2GiB (default: max-num-seqs x max-model-len tokens, "
        "capped at 10%% of RAM and 2 GiB)",
        size=True,
    )
    max_num_seqs: int = option(32, "sequences decoded together at most")
    max_num_batched_tokens: int | None = option(
        None, "token budget of one step (chunked prefill); default 128 on CPU, 2048 on CUDA"
    )
    max_itl_ms: float = option(
        0.0,
        "pacing: target time between a stream's tokens while prompts are prefilled; a step "
        "that carries decodes gets only the prompt tokens that fit in it, at least a block "
        "(from a cost model of this machine's steps). 0 (default): the fixed token budget",
    )
    max_model_len: int | None = option(None, "context length (default: the model's own)")
    enable_prefix_cache: bool = option(
        True, "reuse computed KV blocks at all (registered prefixes and automatic caching)"
    )
    enable_auto_prefix_cache: bool = option(
        True,
        "cache every computed block by content for later prompts (off: registered prefixes only)",
    )
    enable_grammar_fast_forward: bool = option(
        True,
        "append the tokens a response's grammar forces (the only ones it allows next) without "
        "a decode step each: they are computed in the next forward, with the next position "
        "sampled; the same tokens as without (requests with logprobs, stop strings or a seed "
        "and a temperature take them one step each)",
    )
    speculative: str = option(
        "auto",
        "speculative decoding without a draft model: tokens drafted from the request's own "
        "prompt and output and from earlier answers in its scope (tenant, cache_salt, registry "
        "entry), verified in one forward; auto: where the compute path is batch invariant (the "
        "C++ CPU kernels on quantized weights), a draft joins a step when this machine's "
        "step cost model expects it to pay; off: never. The same tokens as without, greedy, "
        "or the same distribution, sampled (requests with penalties or a seed take no "
        "drafts)",
        choices=SPECULATIVE_CHOICES,
    )
    num_speculative_tokens: int = option(
        8, "most draft tokens one sequence verifies in a step (speculative decoding)"
    )
    enable_kv_snapshots: bool = option(
        True,
        "write each registered prefix's KV to disk once filled and read it back at the next "
        "start or reload instead of prefilling; a snapshot is used only when the model files, "
        "weight format, dtypes, kernels and token ids all match",
    )
    kv_snapshot_dir: str | None = option(
        None,
        "where KV snapshots are kept (default: $PREFIXGATE_KV_SNAPSHOT_DIR, else kv-snapshots "
        "in the cache directory)",
    )
    kv_snapshot_budget: int = option(
        256 << 20,
        "bytes of the most recently used automatically cached KV written at a graceful "
        "shutdown and restored at the next start, each block findable only in the scope "
        "(tenant, cache_salt) that computed it (0: none)",
        size=True,
    )
    enable_compile: bool = option(
        True,
        "build the C++ CPU kernels (paged decode attention, fused layer ops) for this CPU on "
        "first start, cached on disk; off (--no-compile): torch operations only, for debugging",
    )
    chat_template: str | None = option(
        None,
        "a Jinja chat template file for chat requests: for a model without one (a base model), "
        "or instead of its own",
    )
    default_chat_template_kwargs: str | None = option(
        None,
        "a JSON object of variables for the chat template of every chat prompt, the registry's "
        "chat entries included; a request's chat_template_kwargs override them (e.g. "
        "'{\"enable_thinking\": false}': Qwen3 and SmolLM3 answer without thinking unless asked)",
    )
    prefix_file: str | None = option(
        None, "prefix registry YAML (watched and hot-reloaded)", flag="--prefixes"
    )
    prefix_watch_interval: float = option(1.0, "seconds between polls of the prefix file")
    num_threads: int | None = option(None, "torch intra-op threads")
    seed: int = option(0, "seed of the engine's default random generator")
    debug_check_integrity: bool = option(False, "check the KV block accounting every step")
    # Not a flag: the gateway sets it from its API keys' names (gateway/tenants.py). A prefix
    # file whose `tenants:` names anything else fails like any bad file: a misspelt name would
    # leave the entry unreachable for the tenant meant, silently. None: not checked (the
    # engine without a gateway: `prefixgate generate`, tests).
    tenant_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise InvalidRequestError(f"dtype must be one of {DTYPE_CHOICES}", param="dtype")
        if self.kv_cache_dtype not in KV_DTYPE_CHOICES:
            raise InvalidRequestError(
                f"kv_cache_dtype must be one of {KV_DTYPE_CHOICES}", param="kv_cache_dtype"
            )
        if self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(
                f"quantization must be one of {QUANTIZATIONS}", param="quantization"
            )
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise InvalidRequestError("device must be cpu or cuda[:N]", param="device")
        if self.speculative not in SPECULATIVE_CHOICES:
            raise InvalidRequestError(
                f"speculative must be one of {SPECULATIVE_CHOICES}", param="speculative"
            )
        _positive(self.num_speculative_tokens, "num_speculative_tokens")
        _positive(self.block_size, "block_size")
        _positive(self.max_num_seqs, "max_num_seqs")
        if not (isinstance(self.max_itl_ms, int | float) and 0 <= self.max_itl_ms < float("inf")):
            raise InvalidRequestError(
                f"max_itl_ms must be a number >= 0 (0: off), got {self.max_itl_ms!r}",
                param="max_itl_ms",
            )
        if not isinstance(self.kv_snapshot_budget, int) or self.kv_snapshot_budget < 0:
            raise InvalidRequestError(
                f"kv_snapshot_budget must be bytes >= 0, got {self.kv_snapshot_budget!r}",
                param="kv_snapshot_budget",
            )
        for name in (
            "max_num_batched_tokens",
            "num_kv_blocks",
            "kv_cache_memory",
            "max_model_len",
            "num_threads",
        ):
            value = getattr(self, name)
            if value is not None:
                _positive(value, name)

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype`, with auto resolved for this machine (see `engine.cpu.auto_dtype`)."""
        if self.dtype == "auto":
            return auto_dtype(self.torch_device)
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """`kv_cache_dtype`, auto resolved for this machine (`engine.core.cpu.auto_kv_dtype`)."""
        if self.kv_cache_dtype == "auto":
            return auto_kv_dtype(self.torch_device, self.torch_dtype)
        return KV_DTYPES[self.kv_cache_dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def token_budget(self) -> int:
        """Tokens one step may compute: `max_num_batched_tokens` or the device's default."""
        return self.max_num_batched_tokens or DEFAULT_TOKEN_BUDGET[self.torch_device.type]

    @property
    def named_kv_snapshot_dir(self) -> str | None:
        """The snapshot folder the flag or $PREFIXGATE_KV_SNAPSHOT_DIR names, if any."""
        return self.kv_snapshot_dir or os.environ.get("PREFIXGATE_KV_SNAPSHOT_DIR")

    @property
    def kv_snapshot_path(self) -> Path:
        folder = self.named_kv_snapshot_dir
        return Path(folder).expanduser() if folder else default_cache_dir() / "kv-snapshots"

    @property
    def is_speculative(self) -> bool:
        return self.speculative != "off"

    @property
    def max_itl(self) -> float | None:
        """Pacing's target in seconds, None when off."""
        return self.max_itl_ms / 1000 if self.max_itl_ms > 0 else None


def _positive(value: int, name: str) -> None:
    if not isinstance(value, int) or value < 1:
        raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)


def default_cache_dir() -> Path:
    """Where everything built once per machine lives (converted GGUF models, quantized
    weights, compiled kernels): `$PREFIXGATE_CACHE_DIR` or `~/.cache/prefixgate`."""
    env = os.environ.get("PREFIXGATE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prefixgate"
