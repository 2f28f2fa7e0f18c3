"""Group-wise int4/int8 weights: GGML's grids given back exactly, the quantized kernel's
integer dot products against the scheme written out in torch, and the per-call choice between
the kernel and the dense copy."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from engine.core.config import default_cache_dir
from engine.core.cpu import CpuFeatures, auto_dtype
from engine.executor.kernels import load_cpu_kernels
from engine.executor.quantization import (
    GROUP_SIZE,
    IQ4_LEVELS,
    QUANTIZE_ROWS,
    TILE_ROWS,
    QuantizedLinear,
    QuantizedWeight,
    ScaleFactors,
    WeightFormat,
    dequantize_rows,
    pack_weight,
    quantize_int4,
    quantize_int8,
    quantize_linears,
    quantize_weight,
)
from tests.engine.executor.cpu_flags import cpu_flags, linux_grants_amx

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


@pytest.fixture(scope="module")
def kernels() -> None:
    assert load_cpu_kernels(default_cache_dir()), "the C++ kernels did not build"


def _int8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation rounding: per group of 32, scale absmax / 127, codes rounded
    half away from zero."""
    groups = x.float().reshape(x.shape[0], -1, GROUP_SIZE)
    scale = groups.abs().amax(-1) / 127
    scaled = groups * torch.where(scale > 0, 1 / scale, 0)[..., None]
    codes = torch.trunc(scaled + torch.where(scaled < 0, -0.5, 0.5)).clamp(-127, 127)
    return codes, scale


def _reference(
    x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor
) -> torch.Tensor:
    """sum over groups of d * a * (code . q) + m * a * sum(q), in float64."""
    q, a = _int8_activations(x)
    dots = torch.einsum("ngj,mgj->mng", codes.double(), q.double())
    weighted = dots * d.double()[None] * a.double()[:, None, :]
    mins = m.double()[None] * (a.double() * q.double().sum(-1))[:, None, :]
    return (weighted + mins).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# The kernel serves 4-bit rows five at a time, then the rest in one block; 5- and 8-bit rows two
# at a time; weight tiles two at a time, an odd one alone.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11])
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_the_kernel_computes_the_integer_dot_products_of_llama_cpp(
    kernels: None, bits: int, rows: int, dtype: torch.dtype
) -> None:
    """Against the scheme written out in torch: activations rounded to 8 bits per group, one
    integer dot product and one scale per group, the min term from the activations' sums."""
    gen = torch.Generator().manual_seed(bits * 10 + rows)
    n, k = 8 * 37, 3 * 128 + 64  # an odd number of tiles; K not a multiple of 8 groups
    low, high = {4: (0, 16), 5: (0, 32), 8: (-127, 128)}[bits]
    codes = torch.randint(low, high, (n, k // GROUP_SIZE, GROUP_SIZE), generator=gen)
    d = (torch.rand(n, k // GROUP_SIZE, generator=gen) * 0.02).half()
    m = (torch.randn(n, k // GROUP_SIZE, generator=gen) * 0.05).half()
    if bits == 8:
        m = torch.zeros_like(m)
    x = (torch.randn(rows, k, generator=gen) * 2).to(dtype)
    weight = pack_weight(codes, d, m, bits)
    got = weight.matmul(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = _reference(x, codes, d.float(), m.float())
    rtol = 1e-5 if dtype == torch.float32 else 2**-8  # bf16 output: one rounding
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * want.abs().max())


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_float32_scales_take_the_same_arithmetic(kernels: None, bits: int) -> None:
    """A K-quant's group scales are float32 products (super-block d times a 6-bit sub-scale):
    packed as float32, the same values give the float16 packing's bits exactly, and scales
    float16 cannot hold are applied as they are (against the scheme written out in torch)."""
    x, weight, (codes, d, m) = _integer_problem(bits, 8 * 5, 3 * 128 + 64, 9, seed=bits)
    wide = pack_weight(codes, d.float(), m.float(), bits)
    assert wide.scales.dtype == torch.float32 and weight.scales.dtype == torch.float16
    narrow_out = weight.matmul(x)
    wide_out = wide.matmul(x)
    assert torch.equal(wide_out.view(torch.int32), narrow_out.view(torch.int32))
    gen = torch.Generator().manual_seed(7)
    sub_scale = torch.randint(1, 64, d.shape, generator=gen).float()
    d_products, m_products = d.float() * sub_scale, -(m.float().abs() * sub_scale)
    assert not torch.equal(d_products.half().float(), d_products)  # beyond float16
    products = pack_weight(codes, d_products, m_products, bits)
    got = products.matmul(x)
    want = _reference(x, codes, d_products, m_products)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max())


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_d_per_half_group_scales_each_half_alone(
    kernels: None, bits: int, dtype: torch.dtype
) -> None:
    """Q6_K's 16-weight sub-blocks: each group's columns 0-15 and 16-31 scaled by their own
    d (float32), against the scheme written out in torch; every row count's rows give the
    bits they get alone (the halves keep the kernel batch invariant). Signed codes have no
    min (Q6_K's): the two d alone, no min row."""
    x, _, (codes, d, m) = _integer_problem(bits, 8 * 5, 3 * 128 + 64, 23, seed=bits + 40)
    gen = torch.Generator().manual_seed(8)
    halves = d.float()[..., None] * torch.randint(-128, 128, (*d.shape, 2), generator=gen).float()
    weight = pack_weight(codes, halves, m.float(), bits)
    rows = 2 if bits in (6, 8) else 3
    assert weight.halves and weight.num_mins == rows - 2
    assert weight.scales.shape == (3, 14, rows, 16) and weight.scales.dtype == torch.float32
    x = x.to(dtype)
    got = weight.matmul(x)
    q, a = _int8_activations(x)
    dots = torch.einsum("nghj,mghj->mngh", codes.double().unflatten(-1, (2, 16)),
                        q.double().unflatten(-1, (2, 16)))  # fmt: skip
    want = (dots * halves.double()[None] * a.double()[:, None, :, None]).sum((-1, -2))
    want += (m.double()[None] * (a.double() * q.double().sum(-1))[:, None, :]).sum(-1)
    _assert_scheme_and_rows_alone(x, weight, got, want)


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_m_per_half_group_takes_each_half_s_min_term_alone(
    kernels: None, bits: int, dtype: torch.dtype
) -> None:
    """Q2_K's 16-weight sub-blocks, each with its own d and its own min: each half's min term
    taken with that half's activation sum, against the scheme written out in torch; every
    row count's rows give the bits they get alone."""
    x, _, (codes, d, m) = _integer_problem(bits, 8 * 5, 3 * 128 + 64, 23, seed=bits + 60)
    halves, mins = _half_scales(d, m, seed=bits)
    weight = pack_weight(codes, halves, mins, bits)
    assert weight.scales.shape == (3, 14, 4, 16) and weight.scales.dtype == torch.float32
    x = x.to(dtype)
    got = weight.matmul(x)
    q, a = _int8_activations(x)
    q_halves = q.double().unflatten(-1, (2, 16))  # [M, G, 2, 16]
    dots = torch.einsum("nghj,mghj->mngh", codes.double().unflatten(-1, (2, 16)), q_halves)
    want = (dots * halves.double()[None] * a.double()[:, None, :, None]).sum((-1, -2))
    half_sums = a.double()[..., None] * q_halves.sum(-1)  # [M, G, 2]
    want += (mins.double()[None] * half_sums[:, None]).sum((-1, -2))
    _assert_scheme_and_rows_alone(x, weight, got, want)
    rows_wanted = torch.tensor([0, 9, 39, 17])
    dequantized = codes.float() * halves.repeat_interleave(16, -1) + mins.repeat_interleave(16, -1)
    assert torch.equal(dequantize_rows(weight, rows_wanted), dequantized[rows_wanted].flatten(1))


def _assert_scheme_and_rows_alone(
    x: torch.Tensor, weight: QuantizedWeight, got: torch.Tensor, want: torch.Tensor
) -> None:
    """`got` (the kernel on all of `x`) is the scheme's `want` to the activations' dtype, and
    the first rows of `x`, or one row, alone give the same bits as in `got`."""
    rtol = 1e-5 if x.dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * want.abs().max())
    for rows in (1, 2, 5, 7, 23):
        part = weight.matmul(x[:rows])
        assert torch.equal(part, got[:rows]), rows
    alone = weight.matmul(x[17:18])
    assert torch.equal(alone, got[17:18])


def _half_scales(d: torch.Tensor, m: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 d and m per 16-column half of each group (Q2_K's sub-blocks: the super-block's
    d and min times each sub-block's 4-bit scale and min), from a problem's d and m."""
    gen = torch.Generator().manual_seed(seed)
    sub_scales = torch.randint(0, 16, (*d.shape, 2), generator=gen).float()
    sub_mins = torch.randint(0, 16, (*d.shape, 2), generator=gen).float()
    return d.float()[..., None] * sub_scales, -(m.float().abs()[..., None] * sub_mins)


def _integer_problem(
    bits: int, n: int, k: int, rows: int, seed: int
) -> tuple[torch.Tensor, QuantizedWeight, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Activations, codes and scales drawn as integers and scaled by powers of two: the same
    values on every build of torch (its normal sampler has per-instruction-set paths). Returns
    the activations, the packed weight and its (codes, d, m)."""
    gen = torch.Generator().manual_seed(seed)
    low, high = {4: (0, 16), 5: (0, 32), 6: (-32, 32), 8: (-127, 128)}[bits]
    codes = torch.randint(low, high, (n, k // GROUP_SIZE, GROUP_SIZE), generator=gen)
    d = (torch.randint(1, 2000, (n, k // GROUP_SIZE), generator=gen).float() / 2**17).half()
    m = (torch.randint(-3000, 3000, (n, k // GROUP_SIZE), generator=gen).float() / 2**16).half()
    if bits in (6, 8):  # signed codes: symmetric, as Q6_K and Q8_0
        m = torch.zeros_like(m)
    x = torch.randint(-4096, 4096, (rows, k), generator=gen).float() / 1024
    return x, pack_weight(codes, d, m, bits), (codes, d, m)


def _digest(t: torch.Tensor) -> str:
    bits = t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)
    return hashlib.sha256(bits.contiguous().numpy().tobytes()).hexdigest()[:16]


# What the kernel computed for _integer_problem(bits, 296, 448, 512, seed=bits), float16
# scales, before it became a register-blocked GEMM (git 35eea45: one tile and up to four rows
# at a time, the AVX2 build). The GEMM, and every build (AVX2; AVX-512 with VNNI; the portable
# loop), must give these bits: a token's logits do not depend on the machine's instruction
# set or on the kernel's blocking. "halves": the same problem with a float32 d per 16-column
# half of each group (Q6_K's layout), pinned from the AVX2 build, which the portable build
# matched when they were taken (the commit adding halves).
PINNED_DIGESTS = {
    ("groups", 4, torch.float32): "97afd334ce48a027",
    ("groups", 4, torch.bfloat16): "fb7ea02c3d3a83f5",
    ("groups", 8, torch.float32): "db48d479611758af",
    ("groups", 8, torch.bfloat16): "7471c967a0561033",
    ("halves", 4, torch.float32): "ebff29b140459ea3",
    ("halves", 4, torch.bfloat16): "14b3dec0233dbbd2",
    ("halves", 8, torch.float32): "c3f6ab57aaf09f7b",
    ("halves", 8, torch.bfloat16): "d10beca0928449ef",
    # 5-bit codes (Q5_0, Q5_1, Q5_K in their own 5 bits), pinned from the AVX2 build when they
    # came; the portable build gave the same.
    ("groups", 5, torch.float32): "fcae66d888c52d10",
    ("groups", 5, torch.bfloat16): "652305a08da03ac0",
    ("halves", 5, torch.float32): "dde5017f02d2fe7b",
    ("halves", 5, torch.bfloat16): "9261e6858b6e56e5",
    # a d and an m per half (Q2_K's sub-blocks), pinned from the portable build when they came;
    # the AVX2, AVX-512 (VNNI) and AMX builds gave the same.
    ("half-mins", 4, torch.float32): "fe1a01745a683265",
    ("half-mins", 4, torch.bfloat16): "caf15bb8e7014f94",
    ("half-mins", 5, torch.float32): "078500db05eb195f",
    ("half-mins", 5, torch.bfloat16): "d8f3a84fe044ebbd",
    ("half-mins", 8, torch.float32): "7ca141116578ab1e",
    ("half-mins", 8, torch.bfloat16): "5978ba6b328001f3",
}


def _layout_problem(
    bits: int, layout: str, rows: int, seed: int, n: int = 8 * 5, k: int = 3 * 32
) -> tuple[torch.Tensor, QuantizedWeight]:
    """`_integer_problem`'s activations and weight in one of the scale layouts: a d per group
    ("groups"), a d per half group ("halves", Q6_K's and Q3_K's), or a d and an m per half
    ("half-mins", Q2_K's)."""
    x, weight, (codes, d, m) = _integer_problem(bits, n, k, rows, seed=seed)
    if layout == "halves":
        gen = torch.Generator().manual_seed(bits)
        sub_scales = torch.randint(-128, 128, (*d.shape, 2), generator=gen).float()
        weight = pack_weight(codes, d.float()[..., None] * sub_scales, m.float(), bits)
    if layout == "half-mins":
        weight = pack_weight(codes, *_half_scales(d, m, seed=bits), bits)
    return x, weight


@pytest.mark.parametrize("layout", ["groups", "halves", "half-mins"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_every_build_gives_the_pinned_bits(
    kernels: None, bits: int, dtype: torch.dtype, layout: str
) -> None:
    x, weight = _layout_problem(bits, layout, 512, seed=bits, n=8 * 37, k=14 * 32)
    out = weight.matmul(x.to(dtype))
    assert _digest(out) == PINNED_DIGESTS[(layout, bits, dtype)]


@pytest.mark.parametrize("layout", ["groups", "halves", "half-mins"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_six_bit_codes_give_the_bits_of_the_same_codes_in_8_bit_lanes(
    kernels: None, dtype: torch.dtype, layout: str
) -> None:
    """Q6_K's and Q3_K's codes (-32..31) in their own 6 bits, stored as w + 32 with 32 times
    the activation codes' sum taken off each integer sum: the same integers as the codes in
    8-bit lanes, so the same bits (the 8-bit lanes are pinned above, on every build), with
    float32 scales and with the K-quants' factored ones alike (8-bit codes with factored
    scales too: IQ4_XS's), for every row count from 1 to 40 (every register block, pair and
    tile width) and in every layout of the scales."""
    gen = torch.Generator().manual_seed(6)
    n, k = 8 * 6, 512
    groups = k // GROUP_SIZE
    codes = torch.randint(-32, 32, (n, groups, GROUP_SIZE), generator=gen).to(torch.int8)
    codes[0, 0], codes[1, 0] = -32, 31  # the extremes, a whole group each
    shape = (n, groups, 2) if layout != "groups" else (n, groups)
    d_sub = torch.randint(-128, 128, shape, generator=gen).to(torch.int8)
    m_sub = torch.randint(0, 64, shape if layout == "half-mins" else (n, groups), generator=gen)
    d_super = (torch.randint(1, 2000, (n, groups // 8), generator=gen).float() / 2**20).half()
    m_super = -(torch.randint(1, 2000, (n, groups // 8), generator=gen).float() / 2**18).half()
    if layout == "halves":  # Q6_K: no min
        m_sub, m_super = torch.zeros_like(m_sub), torch.full_like(m_super, -0.0)
    factors = ScaleFactors(d_sub, d_super, m_sub.to(torch.int8), m_super)

    def product(sub: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        factor = factor.float().repeat_interleave(8, 1)
        return sub.float() * (factor[..., None] if sub.dim() == 3 else factor)

    d, m = product(factors.d_sub, d_super), product(factors.m_sub, m_super)
    x = (torch.randint(-4096, 4096, (40, k), generator=gen).float() / 1024).to(dtype)
    wide = pack_weight(codes, d, m, 8)
    want = wide.matmul(x)
    six = pack_weight(codes, d, m, 6)
    six_factored = pack_weight(codes, d, m, 6, factors=factors)
    # IQ4_XS: levels as 8-bit codes with the factored scales
    eight_factored = pack_weight(codes, d, m, 8, factors=factors)
    assert six.codes.shape[-1] == 6 * 64 and six_factored.scales.dtype == torch.int8
    assert eight_factored.scales.dtype == torch.int8
    every = torch.arange(n)
    for weight in (six, six_factored, eight_factored):
        assert torch.equal(dequantize_rows(weight, every), dequantize_rows(wide, every))
    for rows in range(1, 41):
        for weight in (six, six_factored, eight_factored):
            got = weight.matmul(x[:rows])
            assert torch.equal(got, want[:rows]), (rows, weight.bits, weight.factors is None)


@pytest.mark.parametrize("form", ["half", "float", "factored"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_level_indices_give_the_bits_of_their_levels_in_8_bit_lanes(
    kernels: None, dtype: torch.dtype, form: str
) -> None:
    """IQ4_NL's and IQ4_XS's codes: 4-bit indices into 16 non-uniform levels, read as the
    levels they pick. The same integers as the levels stored as 8-bit codes, so the same bits
    (the 8-bit lanes are pinned above, on every build), at half the code bytes: with float16
    scales (IQ4_NL), float32 ones and factored ones (IQ4_XS's sub-scale times d), for every
    row count from 1 to 40 (every register block, pair and tile width) and at 512; and the
    same rows read back out (a tied embedding's)."""
    gen = torch.Generator().manual_seed(12)
    n, k = 8 * 5, 512  # an odd last tile: the 256-bit path beside the 512-bit one
    groups = k // GROUP_SIZE
    indices = torch.randint(0, 16, (n, groups, GROUP_SIZE), generator=gen).to(torch.uint8)
    indices[0, 0], indices[1, 0] = 0, 15  # the extreme levels, a whole group each
    levels = IQ4_LEVELS[indices.long()]
    factors = None
    if form == "factored":
        d_sub = torch.randint(-32, 32, (n, groups), generator=gen).to(torch.int8)
        d_super = (torch.randint(1, 2000, (n, groups // 8), generator=gen).float() / 2**20).half()
        factors = ScaleFactors(
            d_sub, d_super, torch.zeros_like(d_sub), torch.full_like(d_super, -0.0)
        )
        d = d_sub.float() * d_super.float().repeat_interleave(8, 1)
    else:
        d = torch.rand((n, groups), generator=gen) / 64 + 1e-4
        d = d.half() if form == "half" else d
    m = torch.full_like(d, -0.0)
    eight = pack_weight(levels, d, m, 8, factors=factors)
    four = pack_weight(indices, d, m, 4, factors=factors, levels=True)
    assert four.levels and four.codes.nbytes * 2 == eight.codes.nbytes
    x = (torch.randint(-4096, 4096, (512, k), generator=gen).float() / 1024).to(dtype)
    want = eight.matmul(x)
    for rows in [*range(1, 41), 512]:
        assert torch.equal(four.matmul(x[:rows]), want[:rows]), rows
    every = torch.arange(n)
    assert torch.equal(dequantize_rows(four, every), dequantize_rows(eight, every))
    assert torch.equal(four.rows(every), eight.rows(every))
    back = QuantizedWeight.from_state(dict(four.state("w")), "w", n)
    assert back.levels and torch.equal(back.matmul(x[:3]), want[:3])


def test_the_integer_dot_products_are_the_best_this_cpu_and_build_have(kernels: None) -> None:
    """The start-up line names the path (`KernelBuild.dot_products`): AMX tiles where the CPU
    has them, the build targets it and Linux grants them; VNNI where an AVX-512 build has it;
    else AVX2 or the portable loop. Every path gives the pinned bits above."""
    from engine.executor.kernels import kernel_target

    flags = cpu_flags()
    target = kernel_target()
    if target == "portable":
        want = "portable"
    elif target == "avx2" or not {"avx512_vnni", "avx512vl"} <= flags:
        want = "avx2"
    elif {"amx_tile", "amx_int8", "avx512dq"} <= flags and linux_grants_amx():
        want = "amx+avx512-vnni"
    else:
        want = "avx512-vnni"
    assert torch.ops.prefixgate.quant_matmul_path() == want


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_scales_without_a_min_row_give_the_bits_of_a_zero_min(kernels: None, bits: int) -> None:
    """Where every m is 0 (Q8_0, the int8 head) the scales are d alone and the kernel skips
    the min term: the same bits as with a row of zeros, a read of 1/18 fewer bytes per 8-bit
    weight."""
    x, _, (codes, d, m) = _integer_problem(bits, 8 * 5, 6 * 32, 40, seed=40 + bits)
    without = pack_weight(codes, d, torch.zeros_like(m), bits)
    assert without.scales.shape[2] == 1
    with_zeros = QuantizedWeight(
        without.codes,
        torch.cat([without.scales, torch.zeros_like(without.scales)], 2),
        bits,
        without.out_features,
    )
    got = without.matmul(x)
    want = with_zeros.matmul(x)
    assert got.view(torch.int32).equal(want.view(torch.int32))
    rows = torch.tensor([0, 9, 39, 17])
    assert (
        dequantize_rows(without, rows)
        .view(torch.int32)
        .equal(dequantize_rows(with_zeros, rows).view(torch.int32))
    )
    assert pack_weight(codes, d, m, bits).scales.shape[2] == (1 if bits == 8 else 2)


@pytest.mark.parametrize("layout", ["groups", "halves", "half-mins"])
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_every_row_count_from_1_to_512_gives_each_row_the_bits_it_gets_alone(
    kernels: None, bits: int, layout: str
) -> None:
    """Rows go in register blocks of several and in chunks that fit L1 (170 rows of K = 96,
    168 in the 512-bit path's blocks of 8), and on a CPU with AMX in blocks of 16 on its
    tiles, in chunks of 256, the rest on the vector path: every count from 1 to 512 crosses a
    different mix of blocks, tails and chunk ends, and none may change a row's bits (the
    tiles: two blocks of two and an odd one; an odd number of groups)."""
    x, weight = _layout_problem(bits, layout, 512, seed=20 + bits)
    whole = weight.matmul(x)
    alone = torch.cat([weight.matmul(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(whole, alone)
    for rows in range(1, len(x) + 1):
        got = weight.matmul(x[:rows])
        assert torch.equal(got, whole[:rows]), f"{rows} rows"
    for start in (1, 3, 7, 167, 169, 171):  # blocks that begin off a block or chunk boundary
        got = weight.matmul(x[start:])
        assert torch.equal(got, whole[start:]), f"from row {start}"


@pytest.mark.parametrize("layout", ["groups", "halves", "half-mins"])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_float_out_gives_the_unrounded_sums_of_bf16_activations(
    kernels: None, bits: int, layout: str
) -> None:
    """A head's logits (`float_out`): bf16 activations, float32 results. They are the sums the
    float32 activations of the same values give (the activations' rounding to 8 bits sees the
    same numbers), and rounded once to bf16 they are the bf16 call's bits, at every row count
    the blocks, tails and chunks cut differently (on AMX, from 16 rows the tiles)."""
    x, weight = _layout_problem(bits, layout, 40, seed=40 + bits)
    x16 = x.to(torch.bfloat16)
    for rows in (1, 2, 5, 8, 17, 40):
        wide = weight.matmul(x16[:rows], float_out=True)
        assert wide.dtype == torch.float32, rows
        assert torch.equal(wide, weight.matmul(x16[:rows].float())), rows
        assert torch.equal(wide.to(torch.bfloat16), weight.matmul(x16[:rows])), rows
    # not bf16's grid: the point of the float32 results
    assert not torch.equal(wide, wide.to(torch.bfloat16).float())


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_weights_past_a_weight_block_give_each_row_its_bits_alone(kernels: None, bits: int) -> None:
    """Tiles go in blocks of ~256 KB of weights that every row chunk passes before the next
    block (kWeightBlockBytes): a weight of several blocks a thread (K = 4096: 2 or 3 pairs of
    tiles a block) under rows that take several chunks, and the scheme's values, whatever
    rows come together."""
    n, k = 8 * 42, 4096
    gen = torch.Generator().manual_seed(bits)
    low, high = {4: (0, 16), 6: (-32, 32), 8: (-127, 128)}[bits]
    codes = torch.randint(low, high, (n, k // GROUP_SIZE, GROUP_SIZE), generator=gen)
    d = (torch.randint(1, 2000, (n, k // GROUP_SIZE), generator=gen).float() / 2**17).half()
    m = (torch.randint(-3000, 3000, d.shape, generator=gen).float() / 2**16).half()
    weight = pack_weight(codes, d, m, bits)
    x = torch.randint(-4096, 4096, (37, k), generator=gen).float() / 1024
    whole = weight.matmul(x)
    q, a = _int8_activations(x)
    dots = torch.einsum("ngj,mgj->mng", codes.double(), q.double())
    want = (dots * d.double()[None] * a.double()[:, None]).sum(-1)
    want += (m.double()[None] * (a.double() * q.double().sum(-1))[:, None]).sum(-1)
    torch.testing.assert_close(whole.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max())
    for rows in (1, 2, 5, 8, 13, 36):
        got = weight.matmul(x[:rows])
        assert torch.equal(got, whole[:rows]), rows
    alone = weight.matmul(x[30:31])
    assert torch.equal(alone, whole[30:31])


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(8, 32), (16, 32), (24, 64), (8, 1536), (40, 288)])
def test_ragged_shapes_give_each_row_its_own_bits_and_the_schemes_value(
    kernels: None, bits: int, n: int, k: int
) -> None:
    """One tile, one block of two, a block and an odd tile, one group, a long K."""
    x, weight, (codes, d, m) = _integer_problem(bits, n, k, 13, seed=n + k + bits)
    whole = weight.matmul(x)
    for i in range(len(x)):
        row = weight.matmul(x[i : i + 1])
        assert torch.equal(row, whole[i : i + 1])
    want = _reference(x, codes, d.float(), m.float())
    torch.testing.assert_close(whole.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max())


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_linear_stays_within_the_activation_rounding_of_its_weight(
    kernels: None, bits: int
) -> None:
    """The dense copy is the weight the codes stand for (one step of the grid from the
    original); the kernel's product differs from it by the 8-bit activations alone: per group
    at most half a step (absmax / 254) per element, times |w|."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(N, K, generator=gen) * 0.05
    quantized, dequantized = quantize_weight(weight, bits)
    step = (weight.max() - weight.min()) / (15 if bits == 4 else 254)
    assert (dequantized - weight).abs().max() <= step  # within one step of the grid
    layer = QuantizedLinear((quantized,), None, None)
    x = torch.randn(3, K, generator=gen)
    exact = x.double() @ dequantized.double().t()
    half_steps = x.reshape(3, -1, GROUP_SIZE).abs().amax(-1).repeat_interleave(GROUP_SIZE, 1) / 254
    bound = half_steps.double() @ dequantized.abs().double().t()
    error = (layer(x).double() - exact).abs()
    assert (error <= bound + 1e-5).all()
    assert error.max() > 0  # the kernel ran, not the dense copy


@pytest.mark.parametrize("bits", [4, 8])
def test_a_tall_weight_quantized_in_row_chunks_equals_it_quantized_whole(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of QUANTIZE_ROWS (the head's 49152 rows go 4096 at a time, to keep the first
    start's peak low) pack exactly as the whole weight would, a short last chunk included."""
    weight = torch.randn(2 * 128 + 48, K, generator=torch.Generator().manual_seed(7)) * 0.05
    whole_weight, whole = quantize_weight(weight, bits)
    monkeypatch.setattr("engine.executor.quantization.QUANTIZE_ROWS", 128)
    chunked_weight, chunked = quantize_weight(weight, bits, torch.bfloat16)
    assert QUANTIZE_ROWS % TILE_ROWS == 0
    assert chunked.dtype == torch.bfloat16 and torch.equal(chunked, whole.bfloat16())
    assert torch.equal(chunked_weight.codes, whole_weight.codes)
    assert torch.equal(chunked_weight.scales, whole_weight.scales)


def _packed_bytes(weight: QuantizedWeight) -> list[bytes]:
    return [bytes(t.contiguous().view(torch.uint8).numpy()) for t in weight.tensors()]


@pytest.mark.parametrize("kind", ["int4, an m in one late chunk only", "Q6_K-like, factors"])
def test_a_tall_weight_packs_in_row_chunks_as_it_packs_whole(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pack_weight` goes QUANTIZE_ROWS rows at a time into the whole weight's tensors (a
    1B's head whole took ~1 GB of temporaries), with one layout for all of it: the bytes are
    the unchunked packing's, an odd last tile included, even where only a late chunk has a
    nonzero m (the whole keeps its min row)."""
    gen = torch.Generator().manual_seed(11)
    rows, cols = 3 * 32 + 8, 256
    groups = cols // GROUP_SIZE
    if kind.startswith("int4"):
        bits = 4
        codes = torch.randint(0, 16, (rows, groups, GROUP_SIZE), generator=gen, dtype=torch.uint8)
        d = torch.rand(rows, groups, generator=gen).half()
        m = torch.zeros(rows, groups).half()
        m[70:75] = -torch.rand(5, groups, generator=gen).half()  # the third chunk of 32 only
        factors = None
    else:
        bits = 6
        codes = torch.randint(-32, 32, (rows, groups, GROUP_SIZE), generator=gen, dtype=torch.int8)
        d_sub = torch.randint(-128, 128, (rows, groups, 2), generator=gen, dtype=torch.int8)
        d_super = torch.rand(rows, cols // 256, generator=gen).half()
        d = d_sub.float() * d_super.float().repeat_interleave(8, 1)[..., None]
        m = torch.full((rows, groups), -0.0)
        zeros = torch.zeros(rows, groups, dtype=torch.int8)
        factors = ScaleFactors(d_sub, d_super, zeros, torch.zeros(rows, cols // 256).half())
    whole = pack_weight(codes, d, m, bits, factors=factors)
    monkeypatch.setattr("engine.executor.quantization.QUANTIZE_ROWS", 32)
    chunked = pack_weight(codes, d, m, bits, factors=factors)
    assert (chunked.bits, chunked.halves, chunked.out_features) == (bits, bits == 6, rows)
    assert chunked.num_mins == whole.num_mins == (1 if bits == 4 else 0)
    assert _packed_bytes(chunked) == _packed_bytes(whole)
    every = torch.arange(rows)
    assert torch.equal(dequantize_rows(chunked, every), dequantize_rows(whole, every))


def test_an_int4_chunk_whose_mins_are_all_zero_keeps_the_weights_layout(
    kernels: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Zero rows (a vocabulary's padding) fill a whole chunk: its mins are all 0, and it
    still packs a min row like the other chunks (one layout for the weight)."""
    monkeypatch.setattr("engine.executor.quantization.QUANTIZE_ROWS", 128)
    weight = torch.randn(3 * 128, K, generator=torch.Generator().manual_seed(9)) * 0.05
    weight[128:256] = 0
    quantized, _ = quantize_weight(weight, 4)
    assert quantized.scales.shape == (3 * 128 // 16, K // GROUP_SIZE, 2, 16)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(10))
    out = QuantizedLinear((quantized,), None, None)(x)
    assert torch.equal(out[:, 128:256], torch.zeros(2, 128))
    codes, scale, low = quantize_int4(weight)
    with pytest.raises(ValueError, match="some m is not 0"):
        pack_weight(codes, scale.half(), low.half(), 4, with_min=False)


def test_with_a_dense_copy_every_call_takes_it() -> None:
    """Where the kernel is not built, the dense copy (the dequantized weight) serves every
    row count."""
    gen = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(K, N, bias=True))
    quantize_linears(model, WeightFormat(layers="int4"), torch.float32)
    layer = model[0]
    assert isinstance(layer, QuantizedLinear) and layer.dense is not None
    for rows in (1, 9, 40):
        x = torch.randn(rows, K, generator=gen)
        assert torch.equal(layer(x), layer.dense(x))


def test_without_a_dense_copy_every_call_takes_the_kernel_row_by_row(kernels: None) -> None:
    """Where the kernel is built no copy is kept: prefill rows take the kernel too, and each
    row's result does not depend on the rows beside it (so a prompt's K/V do not depend on
    how it was split or batched)."""
    model = nn.Sequential(nn.Linear(K, N, bias=True))
    quantize_linears(model, WeightFormat(layers="int4", dense_copies=False), torch.float32)
    layer = model[0]
    assert isinstance(layer, QuantizedLinear) and layer.dense is None
    x = torch.randn(37, K, generator=torch.Generator().manual_seed(4))
    whole = layer(x)
    rows = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(whole, rows)
    assert torch.equal(layer(x[5:16]), whole[5:16])
    assert WeightFormat("int4", "int8", dense_copies=False).describe(torch.float32) == (
        "int4 layers, int8 head (group 32, no dense copies)"
    )


def test_the_kernel_rejects_a_layout_it_does_not_know(kernels: None) -> None:
    weight, _ = quantize_weight(torch.randn(N, K), 4)
    x = torch.randn(1, K)
    with pytest.raises(RuntimeError, match="codes must be"):
        torch.ops.prefixgate.quant_matmul(x, weight.codes, weight.scales, 8, N)
    with pytest.raises(RuntimeError, match="codes must be"):  # N beyond the codes' units
        torch.ops.prefixgate.quant_matmul(x, weight.codes, weight.scales, 4, N + 16)
    with pytest.raises(RuntimeError, match="N must be a multiple of 8"):
        torch.ops.prefixgate.quant_matmul(x, weight.codes, weight.scales, 4, N - 4)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        weight.matmul(torch.randn(1, 40))
    with pytest.raises(RuntimeError, match="a row is out of range"):  # N: past the last row
        weight.rows(torch.tensor([0, N]))
    with pytest.raises(RuntimeError, match="a row is out of range"):
        weight.rows(torch.tensor([-1]))
    # the scale rows a layout has: halves need two d, three rows need the halves
    d_alone, _ = quantize_weight(torch.randn(N, K), 8)
    with pytest.raises(RuntimeError, match="scale rows must be"):
        torch.ops.prefixgate.quant_matmul(x, d_alone.codes, d_alone.scales, 8, N, None, True)
    _, _, (codes, d, m) = _integer_problem(4, N, K, 1, seed=3)
    with_halves = pack_weight(codes, torch.stack((d, d), -1).float(), m.float(), 4)
    assert with_halves.scales.shape[2] == 3
    with pytest.raises(RuntimeError, match="scale rows must be"):
        torch.ops.prefixgate.quant_matmul(x, with_halves.codes, with_halves.scales, 4, N)


def test_linears_the_kernel_cannot_take_stay_dense() -> None:
    model = nn.Sequential(nn.Linear(K, N), nn.Linear(40, N), nn.Linear(K, 42))
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
    monkeypatch.setattr("engine.core.cpu.cpu_features", lambda: features)
    assert auto_dtype(torch.device("cpu")) == dtype
    assert auto_dtype(torch.device("cuda")) == torch.bfloat16
