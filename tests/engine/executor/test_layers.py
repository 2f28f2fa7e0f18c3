"""The C++ layer ops (engine/kernels/layer_ops.cpp) against the torch code they replace, in
both compute dtypes, one row (the decode path) and many rows (the parallel prefill path)."""

from __future__ import annotations

import pytest
import torch

from engine.core.config import default_cache_dir
from engine.executor.attention import ForwardBatch, KernelPlan, TorchAttention
from engine.executor.kernels import load_cpu_kernels
from engine.executor.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    gelu_tanh_and_mul,
    rope_and_store,
    silu_and_mul,
)
from tests.engine.executor.test_models import phi3_longrope_config

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 3, 40]  # 40 > the ops' 16 rows per parallel task


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert load_cpu_kernels(default_cache_dir()), "the C++ kernels did not build"


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to one rounding of the dtype: float32 sums may be ordered differently."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = 1e-5 if actual.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def _norm(dtype: torch.dtype, hidden: int = 576) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=torch.Generator().manual_seed(1)) + 0.5)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_kernel_matches_torch(dtype: torch.dtype, rows: int) -> None:
    norm = _norm(dtype)
    x = (torch.randn(rows, 576, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    _close(norm(x, use_kernel=True), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_returns_the_sum_and_its_norm(dtype: torch.dtype, rows: int) -> None:
    norm = _norm(dtype)
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(2, rows, 576, generator=gen) * 2).to(dtype).unbind(0)
    normed, total = norm.add(x, residual, use_kernel=True)
    expected_normed, expected_total = norm.add(x, residual)
    assert torch.equal(total, expected_total)  # one rounding of the same float sum: exact
    assert torch.equal(total, residual + x)
    _close(normed, expected_normed)
    assert not torch.equal(residual, total)  # the inputs are left as they were


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_kernel_matches_torch(dtype: torch.dtype, rows: int) -> None:
    gate_up = (torch.randn(rows, 2 * 96, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    out = silu_and_mul(gate_up, use_kernel=True)
    assert out.shape == (rows, 96)
    _close(out, silu_and_mul(gate_up))
    gate, up = gate_up.float().chunk(2, dim=-1)
    _close(out, (torch.nn.functional.silu(gate) * up).to(dtype))  # float math, one rounding


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_gelu_tanh_and_mul_kernel_matches_torch(dtype: torch.dtype, rows: int) -> None:
    """GeGLU (Gemma), gates from -12 to 12 (both tails of the tanh) and the 7 values past the
    last vector of 8 (the scalar tail)."""
    gen = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(rows, 2 * 103, generator=gen) * 4).clamp(-12, 12).to(dtype)
    out = gelu_tanh_and_mul(gate_up, use_kernel=True)
    assert out.shape == (rows, 103)
    _close(out, gelu_tanh_and_mul(gate_up))
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)))
    _close(out, (exact * up).to(dtype))


def _batch(slots: list[int], use_kernels: bool) -> ForwardBatch:
    n = len(slots)
    none = torch.zeros(0, dtype=torch.long)
    attention = (
        KernelPlan(none.view(0, 0), none, none, none.view(0, 3), none, none, 0)  # RoPE reads none
        if use_kernels
        else TorchAttention([], 0, [])
    )
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.zeros(n, dtype=torch.long),
        slot_mapping=torch.tensor(slots),
        logits_indices=none,
        attention=attention,
    )


@pytest.mark.parametrize("rotary", [16, 12], ids=["full", "partial"])
@pytest.mark.parametrize("cache_dtype", [None, torch.float16], ids=["same", "float16-cache"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rope_and_store_kernel_rotates_and_writes_the_cache_like_torch(
    dtype: torch.dtype, rows: int, cache_dtype: torch.dtype | None, rotary: int
) -> None:
    """`rotary`: the dims RoPE turns, all 16 of a head or Phi-4-mini's 3/4 (12: the 8-lane
    loop and its tail), the rest passed as they are."""
    heads, kv_heads, dim, blocks, block_size = 6, 2, 16, 12, 4
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    angles = torch.rand(rows, 1, rotary // 2, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=gen)[:rows].tolist()
    results = []
    for use_kernel in (False, True):
        k_cache = torch.zeros(blocks, block_size, kv_heads, dim, dtype=cache_dtype or dtype)
        v_cache = torch.zeros_like(k_cache)
        q, k, v = rope_and_store(
            qkv.clone(), (cos, sin), k_cache, v_cache, _batch(slots, use_kernel), heads
        )
        results.append((q, k, v, k_cache, v_cache))
    for actual, expected in zip(results[1], results[0], strict=True):
        _close(actual.contiguous(), expected.contiguous())
    q, k, v, k_cache, v_cache = results[1]
    assert torch.equal(v, qkv[:, heads + kv_heads :])  # v is not rotated
    assert not torch.equal(q[..., :rotary], qkv[:, :heads, :rotary])
    assert torch.equal(q[..., rotary:], qkv[:, :heads, rotary:])  # past the rotary dims
    assert torch.equal(k[..., rotary:], qkv[:, heads : heads + kv_heads, rotary:])
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    assert torch.equal(flat_k[slots], k.to(k_cache.dtype))  # rounded to nearest even once
    assert torch.equal(flat_v[slots], v.to(v_cache.dtype))
    untouched = [s for s in range(blocks * block_size) if s not in slots]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@pytest.mark.parametrize("context", [3, 40], ids=["within-pretraining", "beyond"])
def test_longrope_factors_follow_the_served_context_for_every_position(context: int) -> None:
    """LongRoPE: the short factors when the served context fits the pretraining length (3),
    the long ones otherwise, for every position alike (transformers' rotary on a sequence of
    the context's length picks the same), with the attention factor of the extension."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cfg = phi3_longrope_config()
    ours = RotaryEmbedding(cfg, context, torch.float32)
    positions = torch.arange(context)
    cos, sin = Phi3RotaryEmbedding(cfg)(torch.zeros(1), positions[None])
    assert ours.cos.shape == (context, 12)  # 3/4 of head_dim 16
    assert torch.equal(ours(positions)[0][:, 0], cos[0])
    assert torch.equal(ours(positions)[1][:, 0], sin[0])
    other = RotaryEmbedding(cfg, 48 if context == 3 else 3, torch.float32)
    assert not torch.equal(other.cos[:3], ours.cos[:3])  # the other factors: other angles
