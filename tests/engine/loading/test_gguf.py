"""engine.loading.gguf on tiny GGUF files written here with the gguf package: names, llama's
q/k row permutation, each block type, and the quantized state against the float route."""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    Phi3Config,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from engine.core.config import default_cache_dir
from engine.core.errors import ModelLoadError
from engine.executor.kernels import load_cpu_kernels
from engine.executor.quantization import (
    FILE_BLOCKS,
    HeadRowsEmbedding,
    QuantizedLinear,
    WeightFormat,
    dequantize_rows,
    pack_weight,
    parts_from_state,
)
from engine.executor.quantization import quantized_state as float_route_state
from engine.loading import setup as model_setup
from engine.loading.build import load_gguf_quantized, load_model_weights, on_meta
from engine.loading.gguf import (
    EXACT_BLOCKS,
    TABLE_RECORD,
    GGUFTable,
    GGUFWeights,
    GroupCodes,
    block_group_codes,
    blocks_quantized_state,
    complete_config,
    gguf_table,
    hf_tensor_name,
    rope_parameters,
    row_blocks,
)
from engine.loading.source import ModelSource, shipped_weight_format
from tests.engine.executor.test_models import ARCHITECTURES, PagedHarness, _reference_logits
from tests.helpers import TINY_LLAMA_SHAPE

Q = GGMLQuantizationType


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: the rotary halves of each head interleaved row by row."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _config(model_type: str) -> Any:
    if model_type == "qwen3":  # head_dim as the others' (Qwen3's own default is 128)
        head_dim = TINY_LLAMA_SHAPE["hidden_size"] // TINY_LLAMA_SHAPE["num_attention_heads"]
        return Qwen3Config(
            vocab_size=96, tie_word_embeddings=True, head_dim=head_dim, **TINY_LLAMA_SHAPE
        )
    if model_type == "phi3":
        return Phi3Config(
            vocab_size=96, tie_word_embeddings=True, pad_token_id=None, **TINY_LLAMA_SHAPE
        )
    if model_type == "smollm3":
        return SmolLM3Config(
            vocab_size=96, tie_word_embeddings=True, pad_token_id=None, **TINY_LLAMA_SHAPE
        )
    cls = LlamaConfig if model_type == "llama" else Qwen2Config
    return cls(vocab_size=96, tie_word_embeddings=True, **TINY_LLAMA_SHAPE)


def _write_gguf(
    path: Path,
    model_type: str,
    layer_type: GGMLQuantizationType,
    head_type: GGMLQuantizationType,
    per_tensor: dict[str, GGMLQuantizationType] | None = None,
) -> dict[str, torch.Tensor]:
    """A tiny model's random weights as a GGUF (linears as `layer_type` unless `per_tensor`
    names them, e.g. "blk.0.attn_q": the tied embedding as `head_type`); returns the Hugging
    Face state its file holds, dequantized."""
    per_tensor = per_tensor or {}
    cfg = _config(model_type)
    gen = np.random.default_rng(0)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q_rows, kv_rows = hidden, hidden // cfg.num_attention_heads * cfg.num_key_value_heads
    shapes = {
        "attn_q": (q_rows, hidden),
        "attn_k": (kv_rows, hidden),
        "attn_v": (kv_rows, hidden),
        "attn_output": (hidden, q_rows),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }
    if model_type == "phi3":  # q/k/v and gate/up stored fused
        for part in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
            del shapes[part]
        shapes = {
            "attn_qkv": (q_rows + 2 * kv_rows, hidden),
            **shapes,
            "ffn_up": (2 * inter, hidden),
        }
    writer = GGUFWriter(path, model_type)
    expected: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, w: np.ndarray, qtype: GGMLQuantizationType) -> None:
        stored = w
        permuted = model_type in ("llama", "smollm3")  # llama.cpp's LlamaModel converter
        if permuted and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in gguf_name else cfg.num_key_value_heads
            stored = _llama_permute(w, heads)
        data = quantize(stored, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        values = dequantize(data, qtype).reshape(w.shape)  # what the file holds, its row order
        if stored is not w:  # file row r holds HF row source[r]
            source = _llama_permute(np.arange(w.shape[0])[:, None], heads)[:, 0]
            hf_order = np.empty_like(values)
            hf_order[source] = values
            values = hf_order
        name = hf_tensor_name(gguf_name, model_type)
        assert name is not None
        expected[name] = torch.from_numpy(np.asarray(values, dtype=np.float32))

    add("token_embd.weight", gen.standard_normal((cfg.vocab_size, hidden), np.float32), head_type)
    add("output_norm.weight", gen.standard_normal(hidden, np.float32), Q.F32)
    for i in range(cfg.num_hidden_layers):
        for part, shape in shapes.items():
            kind = per_tensor.get(f"blk.{i}.{part}", layer_type)
            add(f"blk.{i}.{part}.weight", gen.standard_normal(shape, np.float32), kind)
        if model_type == "qwen2":
            for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                add(f"blk.{i}.{part}.bias", gen.standard_normal(rows, np.float32), Q.F32)
        if model_type == "qwen3":
            head_dim = hidden // cfg.num_attention_heads
            for part in ("attn_q_norm", "attn_k_norm"):
                add(f"blk.{i}.{part}.weight", gen.standard_normal(head_dim, np.float32), Q.F32)
        add(f"blk.{i}.attn_norm.weight", gen.standard_normal(hidden, np.float32), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", gen.standard_normal(hidden, np.float32), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _open(path: Path, cfg: Any) -> GGUFWeights:
    return GGUFWeights(path, GGUFTable.parse(path), cfg)


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output.weight", "lm_head.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight"),
        ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias"),
        ("blk.12.ffn_down.weight", "model.layers.12.mlp.down_proj.weight"),
        ("blk.1.ffn_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
        ("blk.2.attn_q_norm.weight", "model.layers.2.self_attn.q_norm.weight"),
        ("rope_freqs.weight", None),
        ("blk.0.ffn_gate_exps.weight", None),
    ],
)
def test_gguf_names_map_to_hugging_face_names(gguf_name: str, hf_name: str | None) -> None:
    assert hf_tensor_name(gguf_name) == hf_name


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("blk.1.attn_norm.weight", "model.layers.1.input_layernorm.weight"),
        ("blk.1.post_attention_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
        ("blk.1.ffn_norm.weight", "model.layers.1.pre_feedforward_layernorm.weight"),
        ("blk.1.post_ffw_norm.weight", "model.layers.1.post_feedforward_layernorm.weight"),
        ("blk.1.attn_k_norm.weight", "model.layers.1.self_attn.k_norm.weight"),
        ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
    ],
)
def test_gemma3_names_its_four_norms(gguf_name: str, hf_name: str) -> None:
    assert hf_tensor_name(gguf_name, "gemma3") == hf_name


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("blk.2.attn_qkv.weight", "model.layers.2.self_attn.qkv_proj.weight"),
        ("blk.2.ffn_up.weight", "model.layers.2.mlp.gate_up_proj.weight"),
        ("blk.2.ffn_down.weight", "model.layers.2.mlp.down_proj.weight"),
        ("rope_factors_long.weight", None),
    ],
)
def test_phi3_names_its_fused_projections(gguf_name: str, hf_name: str | None) -> None:
    assert hf_tensor_name(gguf_name, "phi3") == hf_name


def test_gemma3_norms_are_read_as_hugging_face_holds_them(tmp_path: Path) -> None:
    """llama.cpp's converter stores Gemma's norm weights as 1 + w; read back, they are w (the
    model adds 1, as transformers does), and nothing else is shifted."""
    path = tmp_path / "gemma3.gguf"
    writer = GGUFWriter(path, "gemma3")
    norm = np.array([0.5, 1.0, 1.25, -0.75] * 8, np.float32)  # exact in float32 minus 1
    writer.add_tensor("blk.0.ffn_norm.weight", norm)
    writer.add_tensor("output_norm.weight", norm)
    linear = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_up.weight", linear)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gguf = _open(path, _config("llama"))
    for name in ("model.layers.0.pre_feedforward_layernorm.weight", "model.norm.weight"):
        assert torch.equal(gguf.dequantize(name), torch.from_numpy(norm - 1))
    assert torch.equal(
        gguf.dequantize("model.layers.0.mlp.up_proj.weight"), torch.from_numpy(linear)
    )


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("layer_type", [Q.Q4_1, Q.Q4_0, Q.Q8_0, Q.Q5_0, Q.F16])
def test_dequantized_tensors_are_the_files_values_in_hf_row_order(
    tmp_path: Path, model_type: str, layer_type: GGMLQuantizationType
) -> None:
    path = tmp_path / "tiny.gguf"
    expected = _write_gguf(path, model_type, layer_type, Q.Q8_0)
    gguf = _open(path, _config(model_type))
    assert sorted(gguf.names()) == sorted(expected)
    for name, values in expected.items():
        assert torch.equal(gguf.dequantize(name), values), name
        assert gguf.dequantize(name, torch.bfloat16).equal(values.to(torch.bfloat16)), name


@pytest.mark.parametrize(
    ("qtype", "bits"),
    [
        (Q.Q4_1, 4),
        (Q.Q4_0, 4),
        (Q.Q8_0, 8),
        (Q.Q5_0, 5),
        (Q.Q5_1, 5),
        (Q.F16, None),
        (Q.F32, None),
    ],
)
def test_group_codes_are_the_files_blocks(
    tmp_path: Path, qtype: GGMLQuantizationType, bits: int | None
) -> None:
    path = tmp_path / "tiny.gguf"
    expected = _write_gguf(path, "llama", qtype, Q.Q8_0)
    gguf = _open(path, _config("llama"))
    name = "model.layers.1.self_attn.q_proj.weight"  # permuted rows
    codes = gguf.group_codes(name)
    if bits is None:  # not one of the kernel's schemes
        assert codes is None
        return
    assert codes is not None and codes.bits == bits
    assert codes.codes.shape == (64, 2, 32) and codes.d.dtype == codes.m.dtype == torch.float16
    low, high = {4: (0, 15), 5: (0, 31), 8: (-127, 127)}[bits]
    assert low <= int(codes.codes.min()) and int(codes.codes.max()) <= high
    assert torch.equal(codes.dequantize(torch.float32), expected[name])


def test_group_codes_of_different_widths_fuse_at_the_wider_one() -> None:
    gen = torch.Generator().manual_seed(0)
    scale, low = torch.rand(8, 2, generator=gen).half(), -torch.rand(8, 2, generator=gen).half()
    four = GroupCodes(
        torch.randint(0, 16, (8, 2, 32), generator=gen, dtype=torch.uint8), scale, low, 4
    )
    codes = torch.randint(-127, 128, (16, 2, 32), generator=gen, dtype=torch.int8)
    eight = GroupCodes(codes, torch.rand(16, 2, generator=gen).half(), torch.zeros(16, 2).half(), 8)
    fused = GroupCodes.cat([four, eight])
    assert fused.bits == 8 and fused.codes.dtype == torch.int8
    expected = torch.cat([four.dequantize(torch.float32), eight.dequantize(torch.float32)])
    assert torch.equal(fused.dequantize(torch.float32), expected)
    with pytest.raises(ValueError, match="do not fit"):
        eight.widened(4)
    beyond = GroupCodes(four.codes, scale, torch.full((8, 2), -65504.0 * 16), 4)  # f32 m
    assert GroupCodes.cat([beyond, eight]).m[:8].eq(-65504.0 * 16).all()
    five = GroupCodes(four.codes | 16, scale, low, 5)
    assert GroupCodes.cat([four, five]).bits == 5
    fused = GroupCodes.cat([five, eight])
    assert fused.bits == 8 and torch.equal(fused.codes[:8], (four.codes | 16).to(torch.int8))
    with pytest.raises(ValueError, match="do not fit"):
        five.widened(4)


def _k_quant_codes(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> GroupCodes:
    """A K-quant tensor of random blocks with sane super-block scales, as the loader reads it."""
    block_bytes = EXACT_BLOCKS[qtype.name].block_bytes
    gen = np.random.default_rng(seed)
    blocks = gen.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
    scales = gen.uniform(1e-4, 2e-3, (rows, cols // 256, 2)).astype(np.float16)  # d, dmin
    if qtype in (Q.Q3_K, Q.Q6_K):  # d last; no dmin
        blocks[..., -2:] = scales[..., :1].view(np.uint8).reshape(rows, cols // 256, 2)
    else:
        blocks[..., :4] = scales.view(np.uint8).reshape(rows, cols // 256, 4)
    return block_group_codes(qtype.name, torch.from_numpy(blocks.reshape(-1)), rows, cols)


@pytest.mark.parametrize("kind", sorted(EXACT_BLOCKS))
def test_blocks_decoded_in_row_chunks_are_the_blocks_decoded_whole(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`block_group_codes` decodes QUANTIZE_ROWS rows at a time into the whole's tensors (a
    1B's Q6_K head decoded whole took ~2 GB of temporaries): the same bits, a short last
    chunk included (random blocks: NaN scales too, whose payloads are no one's values), and
    Q4_0's and Q5_0's m in float32 for all rows where one chunk's needs it."""
    block = EXACT_BLOCKS[kind]
    rows, cols = 20, 2 * block.block_weights
    gen = np.random.default_rng(3)
    raw = torch.from_numpy(
        gen.integers(0, 256, rows * cols // block.block_weights * block.block_bytes, dtype=np.uint8)
    )
    if kind in ("Q4_0", "Q5_0"):  # d finite everywhere, and past float16 / 16 in row 17 only
        d = gen.uniform(-1e-3, 1e-3, (rows, cols // 32)).astype(np.float16)
        d[17, 0] = 20000.0
        raw.view(rows, cols // 32, block.block_bytes)[..., :2] = torch.from_numpy(
            d.view(np.uint8).reshape(rows, cols // 32, 2)
        )
    whole = block_group_codes(kind, raw, rows, cols)
    monkeypatch.setattr("engine.loading.gguf.QUANTIZE_ROWS", 8)
    chunked = block_group_codes(kind, raw, rows, cols)
    if kind in ("Q4_0", "Q5_0"):
        assert whole.m.dtype == chunked.m.dtype == torch.float32
    assert chunked.bits == whole.bits and len(chunked.tensors()) == len(whole.tensors())
    for got, want in zip(chunked.tensors(), whole.tensors(), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        if got.is_floating_point():
            finite = want.isfinite()
            assert torch.equal(got.isfinite(), finite)
            got, want = got[finite], want[finite]
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def test_a_fused_linears_tensors_of_other_layouts_stay_row_blocks_in_their_own() -> None:
    """Q4_K q and k beside a Q6_K v (llama.cpp's Q4_K_M, half of a Llama's layers): two row
    blocks, q and k joined in 4 bits, v in 6, in 42 of the 57 KB one 6-bit layout takes; the
    same values; each row's product alone is its product in the batch. A run that would not
    hold whole tiles of 8 rows joins every tensor at the widest width."""
    q, k, v = (
        _k_quant_codes(t, n, 512, s)
        for t, n, s in ((Q.Q4_K, 64, 1), (Q.Q4_K, 32, 2), (Q.Q6_K, 32, 3))
    )
    blocks = row_blocks([q, k, v])
    assert [(b.bits, len(b.codes)) for b in blocks] == [(4, 96), (6, 32)]
    parts = [pack_weight(b.codes, b.d, b.m, b.bits, factors=b.factors) for b in blocks]
    one = GroupCodes.cat([q, k, v])
    joined = pack_weight(one.codes, one.d, one.m, one.bits, factors=one.factors)
    # bytes per 256 weights: 4-bit codes 128 + int8 d, m 16 + their factors 4; 6-bit codes 192
    # + a d per half 16 + factors 4; joined: 192 + d, d, m 24 + factors 6
    assert [p.num_bytes for p in parts] == [96 * 2 * 148, 32 * 2 * 212]
    assert joined.num_bytes == 128 * 2 * 222
    dense = torch.cat([b.dequantize(torch.float32) for b in blocks])
    assert torch.equal(dense.view(torch.int32), one.dequantize(torch.float32).view(torch.int32))
    assert load_cpu_kernels(default_cache_dir())
    linear = QuantizedLinear(parts, None, None)
    assert (linear.in_features, linear.out_features) == (512, 128)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    out = linear(x)
    reference = x @ dense.T
    torch.testing.assert_close(out, reference, rtol=0.02, atol=0.02 * reference.abs().max())
    for i in range(5):
        assert torch.equal(linear(x[i : i + 1]), out[i : i + 1])
    with pytest.raises(ValueError, match="row blocks"):
        _ = linear.quantized
    ragged = row_blocks([q, _k_quant_codes(Q.Q4_K, 36, 512, 4), _k_quant_codes(Q.Q6_K, 28, 512, 5)])
    assert [(b.bits, len(b.codes)) for b in ragged] == [(6, 128)]


# d values a block may carry: ordinary, negative, zero, subnormal, the largest finite f16.
_EDGE_D = np.array([0.0125, -0.003, 0.0, -0.0, 6e-8, 1e-5, -65504.0, 65504.0], np.float16)


IQ4 = (Q.IQ4_NL, Q.IQ4_XS)  # served exactly: 4-bit indices of their levels


@pytest.mark.parametrize(
    "qtype",
    [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, *IQ4],
)
def test_crafted_blocks_dequantize_to_ggmls_values_bit_for_bit(qtype: GGMLQuantizationType) -> None:
    """Random block bytes with edge d and m (or dmin) values (zero, subnormal, the f16
    extremes, both signs): codes * d + m in float32 is `gguf.quants.dequantize`'s value, bit
    for bit (the sign of zero too), except Q4_0 and Q5_0, whose m = -8 d or -16 d turns a
    zero weight into +0 (m is float32 where float16 cannot hold it: the f16 extremes of d).
    K-quants: every 6-bit sub-scale and sub-min, their groups' d and m float32; Q3_K's high
    bits both ways, its signed sub-scales' extremes (0 and 63: -32 and +31); Q2_K's 4-bit
    sub-scales and sub-mins, a d and an m per 16-weight half. IQ4_NL and IQ4_XS: their
    non-uniform levels as 8-bit codes, IQ4_XS's every 6-bit sub-scale."""
    block = EXACT_BLOCKS[qtype.name]
    block_bytes, block_weights = block.block_bytes, block.block_weights
    gen = np.random.default_rng(int(qtype))
    blocks = gen.integers(0, 256, (64, 4, block_bytes), dtype=np.uint8)
    d = _EDGE_D[gen.integers(0, len(_EDGE_D), (64, 4))]
    halves = qtype in (Q.Q2_K, Q.Q3_K, Q.Q6_K)  # a d per 16-weight half
    d_at = {Q.Q2_K: block_bytes - 4, Q.Q3_K: block_bytes - 2, Q.Q6_K: block_bytes - 2}.get(qtype, 0)
    blocks[..., d_at : d_at + 2] = d.view(np.uint8).reshape(64, 4, 2)
    if qtype in (Q.Q4_1, Q.Q5_1, Q.Q2_K, Q.Q4_K, Q.Q5_K):  # m or dmin: f16, extremes included
        m = _EDGE_D[gen.integers(0, len(_EDGE_D), (64, 4))] * np.float16(-1)
        blocks[..., d_at + 2 : d_at + 4] = m.view(np.uint8).reshape(64, 4, 2)
    codes = block_group_codes(qtype.name, torch.from_numpy(blocks), 64, 4 * block_weights)
    assert codes.codes.shape == (64, 4 * block_weights // 32, 32)
    assert codes.d.dim() == (3 if halves else 2)
    assert codes.m.dim() == (3 if qtype == Q.Q2_K else 2)
    assert codes.d.dtype == (torch.float32 if block_weights > 32 else torch.float16)
    if qtype in (Q.Q4_0, Q.Q5_0):  # the f16 extremes' -8 d and -16 d need float32
        assert codes.m.dtype == torch.float32
    low_code, high_code = {4: (0, 15), 5: (0, 31), 6: (-32, 31), 8: (-128, 127)}[block.bits]
    in_range = low_code <= int(codes.codes.min()) and int(codes.codes.max()) <= high_code
    assert in_range or qtype == Q.Q8_0
    # a K-quant's two levels (what the kernel reads) multiply out to d and m bit for bit
    assert (codes.factors is not None) == (block_weights > 32)
    if codes.factors is not None:
        f = codes.factors

        def product(sub: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
            factor = factor.float().repeat_interleave(8, 1)
            return sub.float() * (factor[..., None] if sub.dim() == 3 else factor)

        for value, sub, factor in ((codes.d, f.d_sub, f.d_super), (codes.m, f.m_sub, f.m_super)):
            assert sub.dtype == torch.int8 and factor.dtype == torch.float16
            assert torch.equal(product(sub, factor).view(torch.int32), value.view(torch.int32))
    ours = codes.dequantize(torch.float32)
    ggml = torch.from_numpy(dequantize(blocks.reshape(64, -1), qtype).astype(np.float32))
    if qtype in (Q.Q4_0, Q.Q5_0):
        assert torch.equal(ours, ggml)  # -0 == +0
    else:
        assert torch.equal(ours.view(torch.int32), ggml.view(torch.int32))
    # read back out of the kernel's layout (a tied embedding's rows), in torch and on the
    # kernel: the same floats, edge values included
    assert codes.levels == (qtype in IQ4)
    packed = pack_weight(
        codes.codes, codes.d, codes.m, codes.bits, factors=codes.factors, levels=codes.levels
    )
    order = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    assert load_cpu_kernels(default_cache_dir())
    for rows in (dequantize_rows(packed, order), packed.rows(order)):
        assert torch.equal(rows.view(torch.int32), ours[order].view(torch.int32))


@pytest.mark.parametrize(
    ("qtype", "bits"),
    [(Q.Q2_K, 4), (Q.Q3_K, 6), (Q.Q4_K, 4), (Q.Q5_K, 5), (Q.Q6_K, 6), (Q.IQ4_XS, 4)],
)
def test_k_quant_tensors_are_served_in_their_own_blocks(
    tmp_path: Path, qtype: GGMLQuantizationType, bits: int
) -> None:
    """A K-quant tensor (written as raw super-blocks: gguf cannot quantize to them; IQ4_XS's
    levels as 8-bit codes) read as the kernel's groups: float32 group scales, the file's
    values exactly, and the kernel on its packing computing them (to its 8-bit activations'
    rounding). Packed in the file's own two levels (int8 sub-scales, a float16 factor per
    super-block), the scales are the same numbers, and the kernel's results the same bits as
    from the float32 products."""
    block_bytes = EXACT_BLOCKS[qtype.name].block_bytes
    rows, cols = 32, 512
    gen = np.random.default_rng(5)
    blocks = gen.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
    scales = gen.uniform(1e-4, 2e-3, (rows, cols // 256, 2)).astype(np.float16)  # d, dmin
    if qtype in (Q.Q3_K, Q.Q6_K):  # d last; no dmin
        blocks[..., -2:] = scales[..., :1].view(np.uint8).reshape(rows, cols // 256, 2)
    elif qtype == Q.Q2_K:  # d, dmin last
        blocks[..., -4:] = scales.view(np.uint8).reshape(rows, cols // 256, 4)
    else:
        blocks[..., :4] = scales.view(np.uint8).reshape(rows, cols // 256, 4)
    writer = GGUFWriter(tmp_path / "k.gguf", "llama")
    writer.add_tensor("blk.0.ffn_down.weight", blocks.reshape(rows, -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gguf = _open(tmp_path / "k.gguf", _config("llama"))
    name = "model.layers.0.mlp.down_proj.weight"
    codes = gguf.group_codes(name)
    assert codes is not None and codes.bits == bits == gguf.bits_of(name)
    assert codes.d.dtype == codes.m.dtype == torch.float32
    expected = torch.from_numpy(dequantize(blocks.reshape(rows, -1), qtype).astype(np.float32))
    dense = codes.dequantize(torch.float32)
    assert torch.equal(dense.view(torch.int32), expected.view(torch.int32))
    packed = pack_weight(codes.codes, codes.d, codes.m, codes.bits, levels=codes.levels)
    assert packed.scales.dtype == torch.float32
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
    unpacked = dequantize_rows(packed, order)  # the rows back out of the kernel's layout
    assert torch.equal(unpacked.view(torch.int32), dense[order].view(torch.int32))
    assert load_cpu_kernels(default_cache_dir())
    # the op reads the same values (a tied embedding's rows, on the kernel)
    assert torch.equal(packed.rows(order).view(torch.int32), dense[order].view(torch.int32))
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0))
    out = packed.matmul(x)
    reference = x @ dense.T
    torch.testing.assert_close(out, reference, rtol=0.02, atol=0.02 * reference.abs().max())

    assert codes.factors is not None
    factored = pack_weight(
        codes.codes, codes.d, codes.m, codes.bits, factors=codes.factors, levels=codes.levels
    )
    assert factored.scales.dtype == torch.int8 and factored.factors is not None
    assert factored.factors.dtype == torch.float16
    # a byte per scale and 2 a factor per 8 of them: 5/16 of float32's 4 bytes a scale
    assert factored.scales.nbytes + factored.factors.nbytes == packed.scales.nbytes * 5 // 16
    every = torch.arange(rows)
    products = factored.float_scales(every)
    assert torch.equal(products.view(torch.int32), packed.float_scales(every).view(torch.int32))
    assert torch.equal(
        dequantize_rows(factored, order).view(torch.int32), dense[order].view(torch.int32)
    )
    assert torch.equal(factored.rows(order).view(torch.int32), dense[order].view(torch.int32))
    for batch in (1, 3, 17):  # the register blocks of every width, and row chunks
        x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
        for dtype in (torch.float32, torch.bfloat16):
            want = packed.matmul(x.to(dtype))
            got = factored.matmul(x.to(dtype))
            assert torch.equal(got, want), (batch, dtype)


def test_a_file_mixing_types_per_tensor_is_served_in_its_own_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Q4_K_M-like file (types differ by tensor, within a fused q/k/v and gate/up too):
    each tensor keeps its own code width, a fused linear's tensors of different widths as
    row blocks (tensors of one width one block), every part the file's values exactly; a type
    the kernel does not hold (F16 here) is re-quantized with a warning naming it; the kernel
    on those codes computes the file's weights (to its 8-bit activations' rounding)."""
    mixed = {
        "blk.0.attn_q": Q.Q5_0, "blk.0.attn_k": Q.Q4_0, "blk.0.attn_v": Q.Q8_0,
        "blk.0.attn_output": Q.Q4_1, "blk.0.ffn_gate": Q.Q5_1, "blk.0.ffn_up": Q.Q4_1,
        "blk.0.ffn_down": Q.Q5_0, "blk.1.ffn_down": Q.F16,
    }  # fmt: skip
    path = tmp_path / "mixed.gguf"
    floats = _write_gguf(path, "llama", Q.Q4_1, Q.Q8_0, mixed)
    source = ModelSource(name="mixed", path=tmp_path, gguf_path=path)
    weights = shipped_weight_format(source)
    types = {
        "Q4_0": 1,
        "Q4_1": 2 + 6,
        "Q5_0": 2,
        "Q5_1": 1,
        "Q8_0": 1 + 1,
    }  # layer 1: Q4_1 but down
    assert weights == WeightFormat(FILE_BLOCKS, FILE_BLOCKS, file_types=tuple(types.items()))
    assert weights.describe(torch.float32) == (
        "weights: Q4_0 x 1, Q4_1 x 8, Q5_0 x 2, Q5_1 x 1, Q8_0 x 2 (the file's blocks, group 32)"
    )
    cfg = _config("llama")
    with caplog.at_level("WARNING", logger="engine.loading.gguf"):
        state = blocks_quantized_state(
            on_meta(cfg, 64, torch.float32), _open(path, cfg), weights, torch.float32
        )
    assert "re-quantized from their values (a second rounding): F16 x 1" in caplog.text
    widths = {
        "layers.0.self_attn.qkv_proj": [5, 4, 8], "layers.0.self_attn.o_proj": [4],
        "layers.0.mlp.gate_up_proj": [5, 4], "layers.0.mlp.down_proj": [5],
        "layers.1.self_attn.qkv_proj": [4], "layers.1.mlp.gate_up_proj": [4],
        "layers.1.mlp.down_proj": [8], "lm_head": [8],
    }  # fmt: skip
    rows = {"layers.0.self_attn.qkv_proj": [64, 32, 32], "layers.0.mlp.gate_up_proj": [128, 128]}
    for linear, bits in widths.items():
        out_features = len(state[f"{linear}.dense.weight"])
        parts = parts_from_state(dict(state), f"{linear}.quantized", out_features)
        assert [part.bits for part in parts] == bits, linear
        assert [part.out_features for part in parts] == rows.get(linear, [out_features]), linear
    exact = {
        "layers.0.self_attn.qkv_proj": [f"model.layers.0.self_attn.{x}_proj" for x in "qkv"],
        "layers.0.mlp.gate_up_proj": ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
        "layers.0.mlp.down_proj": ["model.layers.0.mlp.down_proj"],
        "layers.0.self_attn.o_proj": ["model.layers.0.self_attn.o_proj"],
        "lm_head": ["model.embed_tokens"],
    }
    for linear, parts in exact.items():
        expected = torch.cat([floats[f"{part}.weight"] for part in parts])
        assert torch.equal(state[f"{linear}.dense.weight"], expected), linear
    assert load_cpu_kernels(default_cache_dir())
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for linear in ("layers.0.self_attn.qkv_proj", "layers.0.mlp.gate_up_proj", "lm_head"):
        dense = state[f"{linear}.dense.weight"]
        parts = parts_from_state(dict(state), f"{linear}.quantized", len(dense))
        out = QuantizedLinear(parts, None, None)(x)
        reference = x @ dense.T
        torch.testing.assert_close(out, reference, rtol=0.02, atol=0.02 * reference.abs().max())


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "phi3", "smollm3"])
@pytest.mark.parametrize(
    ("layer_type", "head_type", "weights"),
    [
        (Q.Q4_1, Q.Q8_0, WeightFormat("int4", "int8", dense_copies=True)),
        (Q.Q4_1, Q.Q8_0, WeightFormat("int4", "int8", dense_copies=False)),
        (Q.Q8_0, Q.Q8_0, WeightFormat("int4", "int8", dense_copies=False)),  # re-quantized
        (Q.F16, Q.F16, WeightFormat("int8", "int8", dense_copies=True)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_state_from_blocks_equals_quantizing_the_dequantized_floats(
    tmp_path: Path,
    model_type: str,
    layer_type: GGMLQuantizationType,
    head_type: GGMLQuantizationType,
    weights: WeightFormat,
    dtype: torch.dtype,
) -> None:
    """The GGUF route and the float route (the file dequantized, then quantized at load) give
    the same model, tensor for tensor: the file's own codes where its blocks are the
    kernel's schemes, the same re-quantization where they are not; the tied embedding read
    from the head's blocks where they are its values."""
    path = tmp_path / "tiny.gguf"
    floats = _write_gguf(path, model_type, layer_type, head_type)
    cfg = _config(model_type)
    direct = blocks_quantized_state(on_meta(cfg, 64, dtype), _open(path, cfg), weights, dtype)
    model = load_model_weights(cfg, dict(floats), 64, dtype, torch.device("cpu"), weights)
    reference = float_route_state(model)
    # a Q8_0 head in its own blocks holds the tied embedding's values: no float copy of it
    assert ("embed_tokens.weight" in direct) == (head_type == Q.F16)
    if head_type != Q.F16:
        del reference["embed_tokens.weight"]
    assert sorted(direct) == sorted(reference)
    for name, tensor in reference.items():
        assert direct[name].dtype == tensor.dtype, name
        assert torch.equal(direct[name], tensor), name


@pytest.mark.parametrize("layer_type", [Q.Q4_0, Q.Q4_1])
def test_quantized_weights_are_exactly_the_files(
    tmp_path: Path, layer_type: GGMLQuantizationType
) -> None:
    """Each quantized linear stands for the file's values exactly (fused q/k/v in HF row
    order): Q4_0's grid too, which re-quantizing its floats as Q4_1 would not keep."""
    path = tmp_path / "tiny.gguf"
    floats = _write_gguf(path, "llama", layer_type, Q.Q8_0)
    cfg = _config("llama")
    weights = WeightFormat("int4", "int8", dense_copies=True)
    model = on_meta(cfg, 64, torch.float32)
    state = blocks_quantized_state(model, _open(path, cfg), weights, torch.float32)
    layer = "model.layers.1"
    qkv = torch.cat([floats[f"{layer}.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(state["layers.1.self_attn.qkv_proj.dense.weight"], qkv)
    assert torch.equal(
        state["layers.1.mlp.down_proj.dense.weight"], floats[f"{layer}.mlp.down_proj.weight"]
    )
    assert torch.equal(state["lm_head.dense.weight"], floats["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("head_type", "from_head"), [(Q.Q8_0, True), (Q.Q4_1, True), (Q.Q4_0, True), (Q.F16, False)]
)
def test_a_tied_embedding_is_read_from_the_heads_blocks_where_they_are_its_values(
    tmp_path: Path, head_type: GGMLQuantizationType, from_head: bool
) -> None:
    """A tied head served in the file's own blocks holds the embedding's values exactly: the
    model reads the embedding from those rows (no float table, no float copy in the state),
    bit for bit the float table it would otherwise hold. A head re-quantized from its floats
    (F16 here) does not: the float embedding stays."""
    path = tmp_path / "tiny.gguf"
    floats = _write_gguf(path, "llama", Q.Q4_1, head_type)
    cfg = _config("llama")
    weights = WeightFormat(FILE_BLOCKS, FILE_BLOCKS, dense_copies=False)
    state = blocks_quantized_state(
        on_meta(cfg, 64, torch.float32), _open(path, cfg), weights, torch.float32
    )
    assert ("embed_tokens.weight" not in state) == from_head
    model = load_gguf_quantized(cfg, _open(path, cfg), 64, torch.float32, weights)
    embedding = model.embed_tokens  # type: ignore[attr-defined]
    assert isinstance(embedding, HeadRowsEmbedding) == from_head
    ids = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(2))
    rows = embedding(ids)
    expected = floats["model.embed_tokens.weight"][ids]
    if not from_head:  # the re-quantized head; the embedding is the file's floats
        assert torch.equal(rows, expected)
        return
    # the head's own weight, wherever loading moved it (huge pages)
    assert embedding.head is model.lm_head.quantized  # type: ignore[attr-defined]
    assert rows.dtype == torch.float32
    assert torch.equal(rows, expected)  # the file's values (Q4_0's zeros may be -0 there)
    table = _open(path, cfg).dequantize("model.embed_tokens.weight")  # the table it replaces
    assert torch.equal(rows.view(torch.int32), table[ids].view(torch.int32))


def test_a_model_without_gguf_fusion_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", Q.Q4_1, Q.Q8_0)
    with pytest.raises(ValueError, match="cannot load GGUF tensors directly"):
        gguf = _open(path, _config("llama"))
        blocks_quantized_state(
            torch.nn.Linear(32, 8), gguf, WeightFormat("int4", "int8"), torch.float32
        )


def test_other_architectures_are_not_read_directly(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gpt2' is not read directly"):
        _open(path, _config("llama"))


def test_the_tensor_table_is_parsed_once_and_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "qwen2", Q.Q4_1, Q.Q8_0)
    parsed = GGUFTable.parse(path)
    assert parsed.arch == "qwen2"
    assert parsed.tensors["blk.0.attn_q.weight"].kind == "Q4_1"
    assert parsed.tensors["blk.0.attn_q.weight"].shape == (64, 64)
    assert parsed.tensors["blk.0.attn_q.bias"].kind == "F32"
    assert GGUFTable.from_json(parsed.to_json()) == parsed
    folder = tmp_path / "conversion"
    folder.mkdir()
    assert gguf_table(path, folder) == parsed
    assert (folder / TABLE_RECORD).is_file()
    monkeypatch.setattr(GGUFTable, "parse", _never_parse)
    assert gguf_table(path, folder) == parsed  # from the record
    (folder / TABLE_RECORD).write_text('{"arch": "llama"}')  # damaged: parsed again
    with pytest.raises(AssertionError, match="parsed again"):
        gguf_table(path, folder)


def _never_parse(path: Path) -> GGUFTable:
    raise AssertionError(f"{path} was parsed again")


def test_a_truncated_file_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", Q.Q4_1, Q.Q8_0)
    gguf = _open(path, _config("llama"))
    path.write_bytes(path.read_bytes()[:-100])  # the last tensor's tail
    last = max(gguf.entries, key=lambda name: gguf.entries[name].offset)
    with pytest.raises(ValueError, match="truncated"):
        gguf.dequantize(last)


def test_a_damaged_gguf_fails_the_load_with_a_model_load_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's load reads the file's blocks; a truncated file is a clear ModelLoadError,
    not a traceback from deep inside the reader."""
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", Q.Q4_1, Q.Q8_0)
    folder = tmp_path / "conversion"
    folder.mkdir()
    gguf_table(path, folder)  # what the conversion recorded
    path.write_bytes(path.read_bytes()[:-100])
    monkeypatch.setenv("PREFIXGATE_CACHE_DIR", str(tmp_path / "cache"))
    source = ModelSource(name="tiny", path=folder, gguf_path=path)
    with pytest.raises(ModelLoadError, match=r"cannot read the weights of .*tiny\.gguf"):
        model_setup._quantized_model(
            _config("llama"), source, 64, torch.float32, WeightFormat("int4", "int8")
        )


# --- RoPE as llama.cpp's converter writes it ----------------------------------------------------


def _llama3_factors(cfg: Any) -> np.ndarray:
    """Llama 3.x's per-frequency divisors as llama.cpp's converter computes `rope_freqs`."""
    rope = cfg.rope_parameters
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old = rope["original_max_position_embeddings"]
    low, high = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _add_tokenizer(writer: GGUFWriter, tokenizer: PreTrainedTokenizerBase) -> None:
    """A byte-level BPE tokenizer as llama.cpp's converter writes one (`gpt2`): the tokens in
    id order, their types, the merges, the special ids and the chat template."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokenizer))])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def _write_like_llama_cpp(
    path: Path, hf: Any, arch: str, tokenizer: PreTrainedTokenizerBase | None = None
) -> None:
    """`hf`'s float32 weights and config as llama.cpp's converter writes them for `arch`:
    its metadata keys, llama's permuted q/k rows (SmolLM3's too: its converter is Llama's),
    Phi-3's fused qkv and gate_up, RoPE scaling as factor tensors (llama's `rope_freqs`, Phi's
    long and short factors with the pretraining length and attention factor); `tokenizer`'s
    fields where given."""
    cfg = hf.config
    rope = cfg.rope_parameters
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = GGUFWriter(path, arch)
    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:  # as the converter states it
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}

    def add(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[f"{p}input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[f"{p}post_attention_layernorm.weight"])
        add(f"blk.{i}.attn_output.weight", sd[f"{p}self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", sd[f"{p}mlp.down_proj.weight"])
        if arch == "phi3":
            add(f"blk.{i}.attn_qkv.weight", sd[f"{p}self_attn.qkv_proj.weight"])
            add(f"blk.{i}.ffn_up.weight", sd[f"{p}mlp.gate_up_proj.weight"])
            continue
        # llama.cpp's Llama converter (SmolLM3's too) permutes q/k; Qwen's does not
        permuted = arch in ("llama", "smollm3")
        heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads}
        for x in "qkv":
            w = sd[f"{p}self_attn.{x}_proj.weight"]
            if permuted and x in heads:
                w = _llama_permute(w, heads[x])
            add(f"blk.{i}.attn_{x}.weight", w)
        if arch == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", sd[f"{p}self_attn.q_norm.weight"])
            add(f"blk.{i}.attn_k_norm.weight", sd[f"{p}self_attn.k_norm.weight"])
        add(f"blk.{i}.ffn_gate.weight", sd[f"{p}mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", sd[f"{p}mlp.up_proj.weight"])
    if rope["rope_type"] == "llama3":
        add("rope_freqs.weight", _llama3_factors(cfg))
    elif rope["rope_type"] == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_type(RopeScalingType.LONGROPE)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        add("rope_factors_long.weight", np.array(rope["long_factor"]))
        add("rope_factors_short.weight", np.array(rope["short_factor"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("arch", "model"), [("llama", "llama3-rope-tied"), ("phi3", "phi3-longrope-partial")]
)
def test_a_gguf_keeps_its_rope_through_conversion(tmp_path: Path, arch: str, model: str) -> None:
    """A tiny Llama 3.x (RoPE scaling stored as `rope_freqs`) and Phi-4-mini-shaped model
    (LongRoPE factors as tensors, partial rotary as `rope.dimension_count`, fused qkv and
    gate_up) written as llama.cpp writes them: transformers' reading of the file's config
    drops that RoPE; completed (`complete_config`) and read back as the conversion saves it,
    the engine built from the config and the file's tensors gives the original model's
    logits, in a batch mixing prefill, chunks over cached blocks and decodes."""
    torch.manual_seed(0)
    hf = ARCHITECTURES[model]().eval()
    path = tmp_path / "tiny.gguf"
    _write_like_llama_cpp(path, hf, arch)
    read = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    table = GGUFTable.parse(path)
    assert GGUFTable.from_json(table.to_json()) == table  # the record keeps the RoPE

    completed = copy.deepcopy(read)
    complete_config(table, completed)
    saved = type(completed).from_dict(completed.to_dict())  # as the conversion's config.json
    assert saved.rope_parameters == completed.rope_parameters
    assert saved.rope_parameters["rope_type"] == "longrope"
    ours_a, ours_b, expected_a, expected_b = _file_and_reference_logits(path, table, saved, hf)
    torch.testing.assert_close(ours_a, expected_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_b, expected_b, rtol=1e-4, atol=1e-4)
    # the config as transformers reads it alone is another model
    plain_a, _, expected_a, _ = _file_and_reference_logits(path, table, read, hf)
    assert not torch.allclose(plain_a, expected_a, rtol=1e-3, atol=1e-3)


def _file_and_reference_logits(
    path: Path, table: GGUFTable, config: Any, hf: Any
) -> list[torch.Tensor]:
    """The logits of every position of two sequences on the paged engine built from `config`
    and the file's tensors, in a batch mixing prefill, a chunk over cached blocks and decodes;
    then `hf`'s for the same sequences."""
    config.pad_token_id = None  # the reader's default is outside the tiny vocabulary
    weights = GGUFWeights(path, table, config)
    rebuilt = AutoModelForCausalLM.from_config(config).eval()
    rebuilt.load_state_dict({n: weights.dequantize(n) for n in weights.names()}, strict=False)
    harness = PagedHarness(rebuilt)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (9, 17)]
    a, b = (harness.add(str(i), p) for i, p in enumerate(prompts))
    harness.run([(a, 9), (b, 6)])
    harness.run([(b, 11)])
    for _ in range(3):
        for seq in (a, b):
            seq.token_ids.append(int(torch.randint(0, 300, (), generator=gen)))
        harness.run([(a, 1), (b, 1)])
    return [harness.all_logits(s) for s in (a, b)] + [
        _reference_logits(hf, s.token_ids) for s in (a, b)
    ]


def test_a_smollm3_gguf_is_served_as_llama_cpp_reads_it(
    tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerBase
) -> None:
    """transformers' GGUF reader refuses llama.cpp's `smollm3` architecture. A tiny SmolLM3
    (4 layers: the fourth without RoPE, as llama.cpp fixes it and transformers' default says)
    written as llama.cpp's converter writes it, tokenizer included, converts into a folder
    whose config is SmolLM3's (the layers without RoPE named), whose tokenizer is the
    original's, and from which the engine gives the original model's logits over the file's
    tensors (its q/k rows un-permuted)."""
    from engine.loading import source

    cfg = SmolLM3Config(
        vocab_size=len(tiny_tokenizer),
        **{**TINY_LLAMA_SHAPE, "num_hidden_layers": 4},
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    assert cfg.no_rope_layers == [1, 1, 1, 0]
    torch.manual_seed(0)
    hf = SmolLM3ForCausalLM(cfg).eval()
    path = tmp_path / "tiny-smollm3.gguf"
    _write_like_llama_cpp(path, hf, "smollm3", tiny_tokenizer)
    out = tmp_path / "converted"
    out.mkdir()
    source._convert_gguf(path, out)  # what the conversion's child process runs

    config = AutoConfig.from_pretrained(out, local_files_only=True)
    assert config.model_type == "smollm3"
    assert config.no_rope_layers == [1, 1, 1, 0]
    assert config.tie_word_embeddings
    assert (config.num_key_value_heads, config.head_dim) == (2, 16)
    tokenizer = source.load_tokenizer(out)
    text = "Hello there, how are the tokens today?\n  indented"
    assert tokenizer.encode(text) == tiny_tokenizer.encode(text)
    assert tokenizer.chat_template == tiny_tokenizer.chat_template

    table = gguf_table(path, out)
    ours_a, ours_b, expected_a, expected_b = _file_and_reference_logits(path, table, config, hf)
    torch.testing.assert_close(ours_a, expected_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_b, expected_b, rtol=1e-4, atol=1e-4)
    # RoPE in every layer (the config transformers' default interval would not give) differs
    every_layer = copy.deepcopy(config)
    every_layer.no_rope_layers = [1, 1, 1, 1]
    rotated_a, _, expected_a, _ = _file_and_reference_logits(path, table, every_layer, hf)
    assert not torch.allclose(rotated_a, expected_a, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("arch", "model"),
    [("llama", "llama-gqa"), ("qwen3", "qwen3-qk-norm"), ("phi3", "phi3-longrope-partial")],
)
def test_a_conversion_keeps_the_weights_in_the_file(
    tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerBase, arch: str, model: str
) -> None:
    """A file read directly converts to its config and tokenizer alone: no float32 copy of
    its weights (a 1B Q4_K_M's was 4.7 GB beside the 0.8 GB file). Its float weights, where
    a start wants them, are the file's values read from it; its tokenizer is the class
    `AutoTokenizer` picks for the file (Qwen's own for Qwen3), with the same vocabulary,
    although it was picked without reading the file's config a second time. Tools that serve
    a float folder get one written from the file (`export_float_folder`)."""
    from engine.loading import source

    torch.manual_seed(0)
    hf = ARCHITECTURES[model]().eval()
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_like_llama_cpp(path, hf, arch, tiny_tokenizer)
    out = tmp_path / "converted"
    out.mkdir()
    source._convert_gguf(path, out)
    assert not list(out.glob("*.safetensors"))

    expected = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == type(expected).__name__
    assert (arch == "qwen3") == (type(expected).__name__ == "Qwen2Tokenizer")
    text = "Hello there, how are the tokens today?\n  indented"
    assert source.load_tokenizer(out, tmp_path / "cache").encode(text) == expected.encode(text)

    converted = ModelSource(name="tiny", path=out, gguf_path=path)
    config = source.load_hf_config(out, tmp_path / "cache")
    weights = source.load_float_weights(converted, config)
    originals = hf.state_dict()
    if config.tie_word_embeddings:
        del originals["lm_head.weight"]
    assert weights.keys() == originals.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, originals[name]), name
    # a float folder for tools that serve one (tools/peers.py), written once
    exported = source.export_float_folder(converted, tmp_path / "peers")
    written = (exported / "model.safetensors").stat().st_mtime_ns
    assert source.export_float_folder(converted, tmp_path / "peers") == exported
    assert (exported / "model.safetensors").stat().st_mtime_ns == written
    assert [p.name for p in (tmp_path / "peers").iterdir()] == [exported.name]  # no temp left
    reloaded = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).state_dict()
    for name, tensor in originals.items():
        assert torch.equal(reloaded[name], tensor), name


def test_a_new_conversion_names_the_float_copies_of_earlier_ones(
    tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerBase, caplog: pytest.LogCaptureFixture
) -> None:
    """Conversions before version 4 wrote float32 weights that nothing reads now (4.9 GB for
    a 1B): converting the file again names each such folder of the same file name, read
    directly, once; another file's, or an architecture read through transformers (whose
    folder still holds its weights), is not named, and nothing is deleted."""
    from engine.loading import source

    torch.manual_seed(0)
    path = tmp_path / "tiny.gguf"
    _write_like_llama_cpp(path, ARCHITECTURES["llama-gqa"]().eval(), "llama", tiny_tokenizer)
    cache = tmp_path / "cache"
    earlier = {}
    for name, arch in [("tiny-00000000000000aa", "llama"), ("tiny-00000000000000bb", "gpt2"),
                       ("tiny-v2-00000000000000cc", "llama")]:  # fmt: skip
        folder = cache / name
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes(1000))
        (folder / TABLE_RECORD).write_text(GGUFTable(arch, {}).to_json())
        earlier[name] = folder
    caplog.set_level(logging.INFO, logger="engine.loading.source")
    source.resolve_model(str(path), cache_dir=cache)
    named = [r.getMessage() for r in caplog.records if "earlier conversion" in r.getMessage()]
    assert len(named) == 1 and str(earlier["tiny-00000000000000aa"]) in named[0]
    assert all((folder / "model.safetensors").is_file() for folder in earlier.values())
    caplog.clear()
    source.resolve_model(str(path), cache_dir=cache)  # converted: named no more
    assert "earlier conversion" not in caplog.text


def test_a_gguf_ends_generation_at_each_of_its_end_of_turn_tokens(
    tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerBase
) -> None:
    """A GGUF names one eos, where a Hugging Face folder's generation_config.json lists every
    token that ends generation (Gemma 3's <end_of_turn>, Llama 3.1's eom and eot). The
    conversion lists the file's eos with its special tokens of an end-of-turn text (here
    ChatML's <|endoftext|> beside the eos <|im_end|>), and the engine stops at each, as
    llama.cpp's server does on the same file."""
    from engine.loading import source

    torch.manual_seed(0)
    path = tmp_path / "tiny.gguf"
    _write_like_llama_cpp(path, ARCHITECTURES["llama-gqa"]().eval(), "llama", tiny_tokenizer)
    out = tmp_path / "converted"
    out.mkdir()
    source._convert_gguf(path, out)
    ids = {t: tiny_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == sorted(ids.values())
    config = source.load_hf_config(out, tmp_path / "cache")
    tokenizer = source.load_tokenizer(out, tmp_path / "cache")
    assert model_setup._eos_token_ids(config, tokenizer, out) == set(ids.values())


def test_end_of_generation_ids_read_the_files_ids_and_its_special_tokens() -> None:
    """The file's eos, eot and eom ids, and special tokens whose text ends a turn; a token of
    such a text that is plain vocabulary (not special), or a special token of another text,
    is not one."""
    from tokenizers import AddedToken

    from engine.loading.source import end_of_generation_ids

    class Vocabulary:
        added_tokens_decoder: ClassVar[dict[int, AddedToken]] = {
            5: AddedToken("<end_of_turn>", special=True),
            6: AddedToken("<|eom_id|>", special=True),
            7: AddedToken("<|end|>", special=False),
            8: AddedToken("<start_of_turn>", special=True),
        }

    metadata = {
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.eot_token_id": 9,
        "tokenizer.ggml.eom_token_id": 6,
        "tokenizer.ggml.bos_token_id": 2,
    }
    assert end_of_generation_ids(metadata, Vocabulary()) == [1, 5, 6, 9]
    assert end_of_generation_ids({}, Vocabulary()) == [5, 6]


def test_a_qwen3_gguf_keeps_its_head_width_through_conversion(tmp_path: Path) -> None:
    """Qwen3's heads are wider than hidden / heads, stated in the file as
    `attention.key_length`; transformers' reading of a Qwen3 GGUF drops it and keeps its
    config class's default (128), another model. Completed (`complete_config`), the config
    takes the file's width and the engine over the file's tensors gives the original logits."""
    torch.manual_seed(0)
    hf = ARCHITECTURES["qwen3-qk-norm"]().eval()
    assert hf.config.head_dim != hf.config.hidden_size // hf.config.num_attention_heads
    path = tmp_path / "tiny-qwen3.gguf"
    _write_like_llama_cpp(path, hf, "qwen3")
    read = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    assert read.head_dim != hf.config.head_dim  # what transformers' reading alone gives
    table = gguf_table(path, tmp_path)
    assert GGUFTable.from_json(table.to_json()) == table  # the record keeps the width
    complete_config(table, read)
    saved = type(read).from_dict(read.to_dict())  # as the conversion's config.json
    assert saved.head_dim == hf.config.head_dim
    ours_a, ours_b, expected_a, expected_b = _file_and_reference_logits(path, table, saved, hf)
    torch.testing.assert_close(ours_a, expected_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_b, expected_b, rtol=1e-4, atol=1e-4)


def _rope_table(rope: dict[str, Any]) -> GGUFTable:
    return GGUFTable("llama", {}, rope)


def test_linear_rope_scaling_is_kept_and_yarn_is_refused() -> None:
    cfg = LlamaConfig(vocab_size=96, **TINY_LLAMA_SHAPE)
    params = rope_parameters(_rope_table({"scaling.type": "linear", "scaling.factor": 4.0}), cfg)
    assert params["rope_type"] == "linear" and params["factor"] == 4.0
    assert rope_parameters(_rope_table({"dimension_count": 16}), cfg) == cfg.rope_parameters
    with pytest.raises(ValueError, match="yarn"):
        rope_parameters(_rope_table({"scaling.type": "yarn", "scaling.factor": 4.0}), cfg)
    with pytest.raises(ValueError, match="RoPE factors of 3"):
        rope_parameters(_rope_table({"rope_freqs": [1.0, 2.0, 3.0]}), cfg)


def test_a_per_layer_kind_rope_takes_the_files_scaling_on_its_full_attention_layers() -> None:
    """Gemma 3's RoPE is one set per layer kind: the file's linear scaling (the 4B's) is the
    full-attention layers'; the sliding ones keep theirs."""
    cfg = Gemma3TextConfig(vocab_size=96, **TINY_LLAMA_SHAPE, pad_token_id=None)
    table = GGUFTable("gemma3", {}, {"scaling.type": "linear", "scaling.factor": 8.0})
    params = rope_parameters(table, cfg)
    assert params["full_attention"]["rope_type"] == "linear"
    assert params["full_attention"]["factor"] == 8.0
    assert params["sliding_attention"] == cfg.rope_parameters["sliding_attention"]
