"""Group-wise int4/int8 weights: GGML's grids given back exactly, the kernel's planes equal to
the weights they stand for, and the per-call choice between the int4 kernel and the dense
copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.cpu import CpuFeatures, auto_dtype
from engine.quantization import (
    GROUP_SIZE,
    QUANTIZE_ROWS,
    QuantizedLinear,
    WeightFormat,
    quantize_int4,
    quantize_int8,
    quantize_linears,
    quantize_planes,
)

N, K = 48, 128


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()  # GGUF keeps scales and mins as fp16


def test_int4_gives_back_a_q4_1_grid_exactly() -> None:
    """Weights dequantized from Q4_1 (each group spans codes 0..15) quantize to the same
    codes: serving the GGUF's int4 layers loses nothing."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (N, K // GROUP_SIZE, GROUP_SIZE), generator=gen).float()
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 maps each group's min to 0 and max to 15
    scale = _fp16(torch.rand(N, K // GROUP_SIZE, generator=gen) * 0.01 + 1e-3)
    low = _fp16(torch.randn(N, K // GROUP_SIZE, generator=gen) * 0.05)
    weight = (codes * scale[..., None] + low[..., None]).flatten(1)
    got_codes, got_scale, got_low = quantize_int4(weight)
    assert torch.equal(got_codes, codes)
    assert torch.equal(got_low, low)
    torch.testing.assert_close(got_scale, scale, rtol=1e-6, atol=0)


def test_int8_gives_back_a_q8_0_grid_exactly() -> None:
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(-127, 128, (N, K // GROUP_SIZE, GROUP_SIZE), generator=gen).float()
    codes[..., 0] = 127  # Q8_0 maps each group's absmax to +-127
    scale = _fp16(torch.rand(N, K // GROUP_SIZE, generator=gen) * 0.01 + 1e-3)
    weight = (codes * scale[..., None]).flatten(1)
    got_codes, got_scale = quantize_int8(weight)
    assert torch.equal(got_codes, codes)
    assert torch.equal(got_scale, scale)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_multiplies_by_the_weight_the_planes_stand_for(bits: int) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(N, K, generator=gen) * 0.05
    planes, dequantized = quantize_planes(weight, bits)
    assert len(planes) == bits // 4
    step = (weight.max() - weight.min()) / (15 if bits == 4 else 254)
    assert (dequantized - weight).abs().max() <= step  # within one step of the grid
    layer = QuantizedLinear(planes, None, nn.Identity(), max_rows=8)
    x = torch.randn(3, K, generator=gen)
    reference = x.bfloat16().double() @ dequantized.double().t()
    torch.testing.assert_close(layer(x).double(), reference, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_tall_weight_quantized_in_row_chunks_equals_it_quantized_whole(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of QUANTIZE_ROWS (the head's 49152 rows go 4096 at a time, to keep the first
    start's peak low) pack exactly as the whole weight would, a short last chunk included."""
    weight = torch.randn(2 * 128 + 48, K, generator=torch.Generator().manual_seed(7)) * 0.05
    whole_planes, whole = quantize_planes(weight, bits)
    monkeypatch.setattr("engine.quantization.QUANTIZE_ROWS", 128)  # a multiple of the tile
    planes, chunked = quantize_planes(weight, bits, torch.bfloat16)
    assert QUANTIZE_ROWS % 64 == 0
    assert chunked.dtype == torch.bfloat16 and torch.equal(chunked, whole.bfloat16())
    assert len(planes) == len(whole_planes) == bits // 4
    for got, want in zip(planes, whole_planes, strict=True):
        assert torch.equal(got.packed, want.packed)
        assert torch.equal(got.scales_zeros, want.scales_zeros)


def test_rows_above_max_rows_take_the_dense_copy() -> None:
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(K, N, bias=True)
    model = nn.Sequential(linear)
    quantize_linears(model, WeightFormat(layers="int4"), torch.float32)
    layer = model[0]
    assert isinstance(layer, QuantizedLinear) and layer.max_rows >= 1
    big = torch.randn(layer.max_rows + 1, K, generator=gen)
    assert torch.equal(layer(big), layer.dense(big))
    small = torch.randn(1, K, generator=gen)
    torch.testing.assert_close(layer(small), layer.dense(small), rtol=0.02, atol=0.02)
    assert not torch.equal(layer(small), layer.dense(small))  # the int4 kernel's bf16 result


def test_linears_the_kernel_cannot_take_stay_dense() -> None:
    model = nn.Sequential(nn.Linear(K, N), nn.Linear(40, N), nn.Linear(K, 40))
    model.lm_head = nn.Linear(K, N)
    assert quantize_linears(model, WeightFormat(layers="int4", head="none"), torch.float32) == 1
    assert [type(m).__name__ for m in list(model)[:3]] == ["QuantizedLinear", "Linear", "Linear"]
    assert isinstance(model.lm_head, nn.Linear)
    assert (
        WeightFormat("int4", "int8").describe(torch.float32) == "int4 layers, int8 head (group 32)"
    )
    assert WeightFormat().describe(torch.bfloat16) == "bfloat16 weights"


@pytest.mark.parametrize(
    ("features", "dtype"),
    [
        (CpuFeatures("AVX512", True, False, True), torch.bfloat16),
        (CpuFeatures("AVX512", False, True, True), torch.bfloat16),  # AMX
        (CpuFeatures("AVX512", False, False, True), torch.float32),  # AVX-512 without BF16
        (CpuFeatures("AVX2", True, False, False), torch.float32),  # capped to AVX2
        (CpuFeatures("DEFAULT", False, False, False), torch.float32),
    ],
)
def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it(
    features: CpuFeatures, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("engine.cpu.cpu_features", lambda: features)
    assert auto_dtype(torch.device("cpu")) == dtype
    assert auto_dtype(torch.device("cuda")) == torch.bfloat16
