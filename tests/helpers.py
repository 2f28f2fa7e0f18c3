"""Helpers shared by engine tests: drive an LLMEngine step by step, check for leaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from starlette.applications import Starlette
from transformers import LlamaConfig, LlamaForCausalLM

from engine import AsyncEngine, EngineConfig, LLMEngine, RequestOutput, SamplingParams
from engine.loading.source import ModelSource, load_float_weights, load_hf_config
from gateway.app import create_app
from gateway.config import GatewayConfig

# The tiny Llama's shape, shared by the test models built from it: 2 layers, GQA (4 query
# heads, 2 KV heads), widths the quantized kernel takes (multiples of 32).
TINY_LLAMA_SHAPE: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def float_reference(source: ModelSource) -> Any:
    """transformers' model of `source` in float32 over its float weights: a GGUF's values
    dequantized from the file (its conversion keeps no float copy), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source.path, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    weights = load_float_weights(source, load_hf_config(source.path))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = ["lm_head.weight"] if config.tie_word_embeddings else []
    assert (missing, unexpected) == (tied, []), (missing, unexpected)
    return model


def save_tiny_llama(tokenizer: Any, path: Path, max_position_embeddings: int = 512) -> Path:
    """A seeded 2-layer Llama with GQA (4 query heads, 2 KV heads) over `tokenizer`'s
    vocabulary, saved with the tokenizer as an HF folder at `path`."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **TINY_LLAMA_SHAPE,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_engine(path: Path, **overrides: Any) -> LLMEngine:
    """An engine on a tiny test model: 4-token blocks, a 256-block pool, 64-token steps, and
    the block accounting checked after every step."""
    settings: dict[str, Any] = {
        "model": str(path),
        "dtype": "float32",  # exact comparisons with transformers, on every CPU
        "block_size": 4,
        "num_kv_blocks": 256,
        "max_num_batched_tokens": 64,
        "debug_check_integrity": True,
    }
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def run_staggered(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, arrivals: list[int]
) -> list[list[RequestOutput]]:
    """Add prompt i before step arrivals[i]; step until all finish; outputs per request."""
    outputs: dict[str, list[RequestOutput]] = {str(i): [] for i in range(len(prompts))}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                engine.add_request(str(i), prompts[i], params)
        for output in engine.step():
            outputs[output.request_id].append(output)
        step += 1
    return [outputs[str(i)] for i in range(len(prompts))]


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def assert_all_free(engine: LLMEngine) -> None:
    """No leak: the pool's invariants hold and every block is free again."""
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def tiny_app(path: Path, gateway: dict[str, Any] | None = None, **engine: Any) -> Starlette:
    """The whole gateway in-process over a ready engine on a tiny test model: 4-token blocks,
    a 512-block pool, a 512-token context; `engine` overrides EngineConfig fields, `gateway`
    GatewayConfig fields."""
    settings: dict[str, Any] = {
        "model": str(path),
        "dtype": "float32",
        "block_size": 4,
        "num_kv_blocks": 512,
        "max_model_len": 512,
        **engine,
    }
    config = EngineConfig(**settings)
    ready = AsyncEngine(config, engine=LLMEngine(config))
    return create_app(GatewayConfig(engine=config, **(gateway or {})), engine=ready)
