"""Llama-family and Gemma 3 weights read straight from a GGUF file, one tensor at a time.

Why not through transformers: its GGUF loader dequantizes the whole model to float32 at once
(the embedded model: 540 MB, a 1.2 GB peak at a fresh start), and the quantized engine wants
the file's own blocks anyway. Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K
blocks are exactly the kernel's group-32 form w = code * d + m (engine/executor/quantization.py:
4-bit codes for the Q4 types and Q2_K, 5-bit for Q5, 6-bit for Q3_K and Q6_K, 8 for Q8; the
K-quants' d and m as the file holds them, an int8 sub-scale per group times a float16 factor
per super-block (`ScaleFactors`; their float32 products exactly), two d per group for Q2_K's,
Q3_K's and Q6_K's 16-weight sub-blocks, two m for Q2_K's), so they are unpacked into codes, d
and m with no float round trip (`group_codes`), each linear at its own type's width, a file
mixing types per tensor included (a linear fusing a K-quant with a 32-weight type keeps float32
products). IQ4_NL and IQ4_XS pick each weight from 16 non-uniform levels, small integers times
d: their 4-bit indices are the codes (`GroupCodes.levels`), which the kernel reads as the
levels they pick, exactly and in the file's 4 bits. Every other type (F32, F16,
BF16, IQ1-IQ3, whose codebooks are vectors) is dequantized by the `gguf` package
(`dequantize`) and, for a quantized linear, re-quantized with a warning.

Names follow llama.cpp's converter, which also permuted the rows of attn_q / attn_k for
rotary embeddings in llama's layout; `HF_LAYOUT_ARCHS` lists the architectures whose rows are
permuted back here (transformers' `LlamaTensorProcessor` does the same).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.executor.quantization import (
    BITS,
    GROUP_SIZE,
    IQ4_LEVELS,
    QUANTIZE_ROWS,
    TILE_ROWS,
    ScaleFactors,
    WeightFormat,
    pack_weight,
    parts_state,
    per_half,
    quantizable_linears,
    quantize_int4,
    quantize_int8,
)
from engine.loading.gguf_header import read_header, tensor_values

logger = logging.getLogger(__name__)

# GGUF architectures read here, by the Hugging Face model_type they convert to.
ARCH_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "smollm3": "smollm3",
}
HF_LAYOUT_ARCHS = frozenset({"llama", "smollm3"})  # q/k rows permuted by llama.cpp's converter
# Gemma's norms multiply by (1 + w); llama.cpp's converter stores 1 + w, Hugging Face w.
NORM_PLUS_ONE_ARCHS = frozenset({"gemma3"})
TABLE_RECORD = "prefixgate-gguf-tensors.json"  # in a GGUF's conversion folder

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_qkv": "self_attn.qkv_proj",  # stored fused (Phi-3)
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture names a block tensor otherwise: Gemma 3's four norms a layer, Phi-3's
# gate and up projections stored as one `ffn_up`.
_ARCH_BLOCK_NAMES = {
    "gemma3": {
        **_BLOCK_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {**_BLOCK_NAMES, "ffn_up": "mlp.gate_up_proj"},
}
# Per-frequency RoPE divisors llama.cpp's converter stores as tensors: Llama 3.x's scaling
# (`rope_freqs`), Phi-3.5/4's LongRoPE (`rope_factors_long`, `rope_factors_short`).
ROPE_FACTOR_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


@dataclass(frozen=True)
class GroupCodes:
    """A weight as group-32 codes, w = codes * d + m: codes [N, K / 32, 32] (uint8 0..15 for
    4 bits, 0..31 for 5, int8 -32..31 for 6, int8 for 8), d and m [N, K / 32] float16
    (float32 for the K-quants and where float16 cannot hold m exactly); d [N, K / 32, 2]
    where each 16-column half of a group has its own (Q3_K, Q6_K), and m [N, K / 32, 2] too
    where each half has its own min (Q2_K). Unpacked, so rows concatenate (q/k/v fused into
    one linear, where they share a layout) before `pack_weight` lays them out for the kernel."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    bits: int
    # a K-quant's d and m in the file's own two levels (exactly d and m): what the kernel reads
    factors: ScaleFactors | None = None
    levels: bool = False  # 4-bit codes that index IQ4_LEVELS (IQ4_NL, IQ4_XS)

    def widened(self, bits: int) -> GroupCodes:
        """The same weights in `bits`-wide codes: 4- and 5-bit codes (0..15, 0..31) are wider
        codes as they are, so a fused linear whose parts differ in width keeps every part's
        values; level indices become the 8-bit levels they index."""
        if bits == self.bits:
            return self
        if self.levels:
            if bits != 8:
                raise ValueError(f"IQ4 levels do not fit in {bits} bits")
            return dataclasses.replace(
                self, codes=IQ4_LEVELS[self.codes.long()], bits=8, levels=False
            )
        if (self.bits, bits) not in ((4, 5), (4, 6), (4, 8), (5, 6), (5, 8), (6, 8)):
            raise ValueError(f"{self.bits}-bit codes do not fit in {bits} bits")
        return dataclasses.replace(
            self, codes=self.codes.to(torch.int8 if bits in (6, 8) else torch.uint8), bits=bits
        )

    @staticmethod
    def cat(parts: list[GroupCodes]) -> GroupCodes:
        """Rows of `parts` one after another, at the widest of their code widths (8 bits
        where level indices join other codes)."""
        levels = all(p.levels for p in parts)
        bits = 8 if any(p.levels for p in parts) and not levels else max(p.bits for p in parts)
        parts = [p.widened(bits) for p in parts]
        # float16 widens exactly; a float32 m (Q4_0's or Q5_0's beyond float16) stays one
        wide = any(torch.float32 in (p.d.dtype, p.m.dtype) for p in parts)
        scale = torch.float32 if wide else torch.float16
        # one d (or m) for both halves is two equal ones; an m per half needs a d per half
        half_mins = any(p.m.dim() == 3 for p in parts)
        halves = half_mins or any(p.d.dim() == 3 for p in parts)
        # the factors where every part has them (K-quants only), else the products alone
        factors = [p.factors for p in parts if p.factors is not None]
        return GroupCodes(
            torch.cat([p.codes for p in parts]),
            torch.cat([per_half(p.d, halves).to(scale) for p in parts]),
            torch.cat([per_half(p.m, half_mins).to(scale) for p in parts]),
            bits,
            ScaleFactors.cat([f.per_half(halves, half_mins) for f in factors])
            if len(factors) == len(parts)
            else None,
            levels,
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor, row-major over the weight's rows."""
        factors = (
            []
            if self.factors is None
            else [getattr(self.factors, f.name) for f in fields(ScaleFactors)]
        )
        return [self.codes, self.d, self.m, *factors]

    def with_tensors(self, tensors: list[torch.Tensor]) -> GroupCodes:
        """The same kind of weight holding `tensors` (in `tensors()`' order)."""
        codes, d, m, *rest = tensors
        factors = None if self.factors is None else ScaleFactors(*rest)
        return GroupCodes(codes, d, m, self.bits, factors, self.levels)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """w = codes * d + m in float32 (as GGML computes it), stored in `dtype`, a few
        thousand rows at a time: whole, the 49152-row head's float32 temporaries were
        ~230 MB of a first start's peak."""
        rows, groups, _ = self.codes.shape
        out = torch.empty(rows, groups * GROUP_SIZE, dtype=dtype)
        for start in range(0, rows, QUANTIZE_ROWS):
            end = start + QUANTIZE_ROWS
            codes = self.codes[start:end]
            codes = IQ4_LEVELS[codes.long()] if self.levels else codes
            w = codes.float().mul_(_per_column(self.d[start:end]))
            out[start:end] = w.add_(_per_column(self.m[start:end])).flatten(1)
        return out


def _per_column(scale: torch.Tensor) -> torch.Tensor:
    """A d or m [N, G] (one a group) or [N, G, 2] (one a 16-column half) as float32 that
    broadcasts over codes [N, G, 32]."""
    scale = scale.float()
    return scale.repeat_interleave(GROUP_SIZE // 2, -1) if scale.dim() == 3 else scale[..., None]


@dataclass(frozen=True)
class TensorEntry:
    kind: str  # GGML type name
    shape: tuple[int, ...]  # torch order: [N, K] for a matrix
    offset: int  # of its data, from the start of the file
    num_bytes: int


@dataclass(frozen=True)
class GGUFTable:
    """A GGUF file's architecture and tensor table, by GGUF tensor name, and the metadata
    transformers' reading of a GGUF's config drops: the RoPE (`rope`: the `{arch}.rope.*`
    fields without the prefix, and the values of the `ROPE_FACTOR_TENSORS` it holds) and the
    head width where the file states it (`{arch}.attention.key_length`; Qwen3's reading keeps
    its config class's default of 128 whatever the file says)."""

    arch: str
    tensors: dict[str, TensorEntry]
    rope: dict[str, Any] = dataclasses.field(default_factory=dict)
    head_dim: int | None = None

    @classmethod
    def parse(cls, path: Path) -> GGUFTable:
        """ValueError where `path` is not a GGUF file this engine reads."""
        header = read_header(path)
        arch = header.arch
        tensors = {
            t.name: TensorEntry(t.kind, t.shape, t.offset, t.num_bytes) for t in header.tensors
        }
        prefix = f"{arch}.rope."
        rope: dict[str, Any] = {
            key.removeprefix(prefix): value
            for key, value in header.metadata.items()
            if key.startswith(prefix)
        }
        for t in header.tensors:
            stem = t.name.removesuffix(".weight")
            if stem in ROPE_FACTOR_TENSORS:
                rope[stem] = tensor_values(path, t).tolist()
        key_length = header.metadata.get(f"{arch}.attention.key_length")
        if key_length is not None and not isinstance(key_length, int):
            raise ValueError(f"{path}: {arch}.attention.key_length is not an integer")
        head_dim = key_length
        return cls(arch, tensors, rope, head_dim)

    def to_json(self) -> str:
        return json.dumps({"arch": self.arch, "rope": self.rope, "head_dim": self.head_dim,
                           "tensors": {name: dataclasses.asdict(entry)
                                       for name, entry in self.tensors.items()}})  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> GGUFTable:
        """ValueError, KeyError or TypeError where `text` is not a table."""
        data = json.loads(text)
        tensors = {
            name: TensorEntry(e["kind"], tuple(e["shape"]), int(e["offset"]), int(e["num_bytes"]))
            for name, e in data["tensors"].items()
        }
        # a record from before head_dim was kept has none: only a conversion reads it, and a
        # conversion parses the file itself
        head_dim = data.get("head_dim")
        return cls(
            str(data["arch"]),
            tensors,
            dict(data["rope"]),
            None if head_dim is None else int(head_dim),
        )


def complete_config(table: GGUFTable, config: Any) -> None:
    """Give `config` (transformers' reading of the file's metadata) what that reading drops:
    the file's head width, then the RoPE llama.cpp applies to the file (`rope_parameters`),
    where the config class keeps some of it outside `rope_parameters` too (Phi-3's
    `original_max_position_embeddings`, which it would copy over them when the saved config
    is read back) there as well. The head width first: a partial rotary is a share of it."""
    if table.head_dim is not None:
        config.head_dim = table.head_dim
    params = rope_parameters(table, config)
    config.rope_parameters = params
    flat = params.get("full_attention", params)
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if key in flat and hasattr(config, key):
            setattr(config, key, flat[key])


def rope_parameters(table: GGUFTable, config: Any) -> dict[str, Any]:
    """`config.rope_parameters` (transformers' reading of the file's metadata) completed with
    the RoPE llama.cpp applies to the file, which that reading drops: a rotary width below
    head_dim (`rope.dimension_count`: Phi-4-mini's partial rotary), per-frequency divisors
    (`rope_freqs`, `rope_factors_long` / `_short`), linear scaling. Divisors become
    transformers' "longrope" parameters, whose inverse frequencies are exactly base ** -(2i /
    d) / factor_i as llama.cpp's: short and long factors with Phi's pretraining length and
    attention factor, or one set for both (Llama 3.x) with an attention factor of 1.

    ValueError for a RoPE scaling this reading does not reproduce (YaRN)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    layered = "full_attention" in params  # Gemma 3: one set per layer kind
    target = dict(params["full_attention"]) if layered else params
    rope = table.rope
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dims = int(rope.get("dimension_count", head_dim))
    if dims < head_dim:
        target["partial_rotary_factor"] = dims / head_dim
    short = rope.get("rope_factors_short") or rope.get("rope_freqs")
    long = rope.get("rope_factors_long") or rope.get("rope_freqs")
    scaling = str(rope.get("scaling.type", "none"))
    if short is not None and long is not None:
        if len(short) != dims // 2 or len(long) != dims // 2:
            raise ValueError(f"RoPE factors of {len(short)} / {len(long)} for {dims} rotary dims")
        original = rope.get("scaling.original_context_length", config.max_position_embeddings)
        target.update(
            rope_type="longrope",
            short_factor=[float(x) for x in short],
            long_factor=[float(x) for x in long],
            original_max_position_embeddings=int(original),
            attention_factor=float(rope.get("scaling.attn_factor", 1.0)),
        )
    elif scaling == "linear":
        target.update(rope_type="linear", factor=float(rope["scaling.factor"]))
    elif scaling not in ("none", "longrope"):
        raise ValueError(f"RoPE scaling {scaling!r} of a GGUF is not served")
    if layered:
        params["full_attention"] = target
    return params


def gguf_table(gguf_path: Path, folder: Path) -> GGUFTable:
    """The table recorded in `folder` (the file's conversion, keyed by its content), else
    parsed from the file and recorded there. Why: a start reads one small JSON file, not the
    header with its vocabulary (tens of MB for Gemma 3's)."""
    record = folder / TABLE_RECORD
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return GGUFTable.from_json(record.read_text(encoding="utf-8"))
    table = GGUFTable.parse(gguf_path)
    with contextlib.suppress(OSError):
        record.write_text(table.to_json(), encoding="utf-8")
    return table


class GGUFWeights:
    """A Llama-family or Gemma 3 GGUF's tensors under Hugging Face names, read one at a time
    with plain file reads, not a memory map: a mapped page stays in the RSS while the map
    lives."""

    def __init__(self, path: Path, table: GGUFTable, hf_config: Any) -> None:
        self.path = path
        self.arch = table.arch
        if self.arch not in ARCH_MODEL_TYPES:
            raise ValueError(f"{path}: GGUF architecture {self.arch!r} is not read directly")
        self._heads = (int(hf_config.num_attention_heads), int(hf_config.num_key_value_heads))
        self.entries: dict[str, TensorEntry] = {}
        for gguf_name, entry in table.tensors.items():
            hf_name = hf_tensor_name(gguf_name, self.arch)
            if hf_name is not None:  # None: e.g. rope_freqs, rebuilt from the config
                self.entries[hf_name] = entry

    def names(self) -> list[str]:
        return list(self.entries)

    def group_codes(self, hf_name: str) -> GroupCodes | None:
        """The tensor's own blocks as codes, d and m, or None where its type is not one of
        the kernel's schemes (or it is not a matrix of whole groups)."""
        entry = self.entries[hf_name]
        if entry.kind not in EXACT_BLOCKS or len(entry.shape) != 2:
            return None
        codes = block_group_codes(entry.kind, self._read(entry), *entry.shape)
        order = self._hf_row_order(hf_name)
        if order is None:
            return codes
        factors = codes.factors
        if factors is not None:
            factors = ScaleFactors(*(getattr(factors, f.name)[order] for f in fields(factors)))
        return GroupCodes(codes.codes[order], codes.d[order], codes.m[order], codes.bits, factors)

    def bits_of(self, hf_name: str) -> int:
        """The code width that serves this tensor's file type (8 for a float type)."""
        return GGML_BITS.get(self.entries[hf_name].kind, 8)

    def dequantize(self, hf_name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor's values in float32 (float16/bf16 widened, blocks dequantized as GGML
        does), stored in `dtype`, rows and values as Hugging Face has them."""
        codes = self.group_codes(hf_name)
        if codes is not None:
            return codes.dequantize(dtype)
        entry = self.entries[hf_name]
        if self.arch in NORM_PLUS_ONE_ARCHS and hf_name.endswith("norm.weight"):
            # the file's 1 + w back to w, as transformers' loader does (the model adds 1)
            return (self._float_values(hf_name, entry) - 1.0).to(dtype)
        return self._float_values(hf_name, entry).to(dtype)

    def _float_values(self, hf_name: str, entry: TensorEntry) -> torch.Tensor:
        """The file's values in float32, in Hugging Face's row order."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        raw = self._read(entry).numpy()
        qtype = GGMLQuantizationType[entry.kind]
        if entry.kind in ("F32", "F16"):
            values = raw.view(np.float32 if entry.kind == "F32" else np.float16)
        else:
            rows = entry.shape[0] if len(entry.shape) > 1 else 1
            values = dequantize(raw.reshape(rows, -1), qtype)
        tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        tensor = tensor.reshape(entry.shape)
        order = self._hf_row_order(hf_name)
        return tensor if order is None else tensor[order]

    def float_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Dtype and shape of each of `float_tensors`, for a file written as they come."""
        return {name: (torch.float32, entry.shape) for name, entry in self.entries.items()}

    def float_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor dequantized to float32, one at a time, in `names()` order."""
        for name in self.entries:
            yield self.dequantize(name)

    def _read(self, entry: TensorEntry) -> torch.Tensor:
        raw = torch.empty(entry.num_bytes, dtype=torch.uint8)
        with self.path.open("rb") as f:
            f.seek(entry.offset)
            if f.readinto(raw.numpy()) != entry.num_bytes:  # type: ignore[arg-type]
                raise ValueError(f"{self.path} is truncated at offset {entry.offset}")
        return raw

    def _hf_row_order(self, hf_name: str) -> torch.Tensor | None:
        """For q/k of an architecture llama.cpp permuted: which file row each Hugging Face row
        is (the converter interleaved the two rotary halves of each head)."""
        if self.arch not in HF_LAYOUT_ARCHS:
            return None
        if hf_name.endswith("self_attn.q_proj.weight"):
            heads = self._heads[0]
        elif hf_name.endswith("self_attn.k_proj.weight"):
            heads = self._heads[1]
        else:
            return None
        rows = self.entries[hf_name].shape[0]
        return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).flatten()


def _block_codes(kind: str, blocks: torch.Tensor) -> Decoded:
    """Codes [..., 32], d and m [...] of `kind`'s 32-weight blocks [..., block bytes] (ggml's
    block structs: d first, then m for the _1 types, the 5th bits of Q5 as a little-endian
    uint32, then the nibbles), such that codes * d + m is what GGML dequantizes them to."""
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
    # m of the symmetric types: -0, so that code * d + m keeps the sign of a zero code * d as
    # GGML's code * d does (x + -0 is x for every x; x + +0 turns -0 into +0).
    zero = torch.full_like(d, -0.0)
    if kind == "Q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8), d, zero, None
    packed = blocks[..., -16:]  # byte j: weight j (low nibble), weight j + 16 (high)
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
    if kind == "Q4_0":  # w = (q - 8) * d
        return codes, d, _exact_min(d, -8), None
    if kind == "Q4_1":
        return codes, d, blocks[..., 2:4].contiguous().view(torch.float16)[..., 0], None
    high_at = 2 if kind == "Q5_0" else 4  # Q5_1 has m before its high bits
    high = blocks[..., high_at : high_at + 4]  # bit j of the uint32: weight j's 5th bit
    fifth = (high[..., :, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [..., 4, 8]
    codes = codes | (fifth.flatten(-2) << 4)
    if kind == "Q5_0":  # w = (q - 16) * d: m = -16 d, as Q4_0's -8 d (a zero weight is +0)
        return codes, d, _exact_min(d, -16), None
    return codes, d, blocks[..., 2:4].contiguous().view(torch.float16)[..., 0], None


def _exact_min(d: torch.Tensor, factor: int) -> torch.Tensor:
    """m = factor * d for a power-of-two factor: float16 like d where every product fits,
    else float32 (|d| past float16's range / 16 is in no real weight, but a file may hold it)."""
    m = d.float() * factor
    return m.half() if bool(torch.isfinite(m.half()).all()) else m


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block (a K-quant's d or dmin)."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0]


def _no_min_factors(d_sub: torch.Tensor, d_super: torch.Tensor) -> ScaleFactors:
    """Factors of a symmetric K-quant (Q3_K, Q6_K): m = 0 * -0.0 = -0.0, as its m."""
    lead = d_sub.shape[:-1]
    return ScaleFactors(
        d_sub, d_super, torch.zeros(lead, dtype=torch.int8), torch.full_like(d_super, -0.0)
    )


def _super_block_codes(kind: str, blocks: torch.Tensor) -> Decoded:
    """Codes [..., 8, 32], d and m [..., 8] of Q4_K / Q5_K super-blocks [..., 144 | 176]:
    d f16, dmin f16, 12 bytes of 6-bit sub-scales and sub-mins, (Q5_K: 32 bytes of 5th bits,)
    128 bytes of nibbles. Group j's d = d * sc_j and m = -(dmin * min_j), float32 products
    that are exact (at most 17 significant bits), so codes * d + m is GGML's
    `d * sc * q - dmin * min` bit for bit."""
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    dmin = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    low, high, mixed = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sub_scale = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    sub_min = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=-1)
    nibbles = blocks[..., -128:].reshape(*blocks.shape[:-1], 4, 1, 32)
    codes = (nibbles >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]) & 0x0F
    codes = codes.reshape(*blocks.shape[:-1], 8, 32)  # group 2i: chunk i's low nibbles
    if kind == "Q5_K":  # bit j of byte l of qh: group j's weight l's 5th bit
        fifth = (
            blocks[..., 16:48, None].transpose(-1, -2)
            >> torch.arange(8, dtype=torch.uint8)[:, None]
        )
        codes = codes | ((fifth & 1) << 4)
    factors = ScaleFactors(
        sub_scale.to(torch.int8), _half(blocks, 0), sub_min.to(torch.int8), -_half(blocks, 2)
    )
    return codes, d[..., None] * sub_scale.float(), -(dmin[..., None] * sub_min.float()), factors


def _q6_k_codes(kind: str, blocks: torch.Tensor) -> Decoded:
    """Codes [..., 8, 32], d [..., 8, 2] and m [..., 8] of Q6_K super-blocks [..., 210]: 128
    bytes of low nibbles, 64 of 2-bit high parts, 16 int8 sub-scales, d f16. Sixteen
    sub-blocks of 16 weights: group j's halves are sub-blocks 2j and 2j + 1, each with its d =
    d * sc (float32, exact), codes q - 32 in -32..31, m = -0: d * code is GGML's value bit
    for bit."""
    lead = blocks.shape[:-1]
    shifts = torch.tensor([0, 4], dtype=torch.uint8)[:, None]
    low = (blocks[..., 0:128].reshape(*lead, 2, 1, 64) >> shifts) & 0x0F
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    high = (blocks[..., 128:192].reshape(*lead, 2, 1, 32) >> shifts) & 0x03
    codes = low.reshape(*lead, 8, 32) | (high.reshape(*lead, 8, 32) << 4)
    codes = (codes.to(torch.int16) - 32).to(torch.int8)
    sub_scale = blocks[..., 192:208].contiguous().view(torch.int8)
    d = _half(blocks, 208)
    halves = (d.float()[..., None] * sub_scale.float()).reshape(*lead, 8, 2)
    factors = _no_min_factors(sub_scale.reshape(*lead, 8, 2), d)
    return codes, halves, torch.full((*lead, 8), -0.0), factors


def _q3_k_codes(kind: str, blocks: torch.Tensor) -> Decoded:
    """Codes [..., 8, 32], d [..., 8, 2] and m [..., 8] of Q3_K super-blocks [..., 110]: 32
    bytes of high bits (hmask), 64 of 2-bit low parts, 12 of sixteen packed 6-bit scales, d
    f16. Sixteen sub-blocks of 16 weights, as Q6_K's: group j's halves are sub-blocks 2j and
    2j + 1, each with its d = d * (scale - 32) (float32, exact), codes low - 4 where the high
    bit is clear (-4..3), m = -0: d * code is GGML's value bit for bit."""
    lead = blocks.shape[:-1]
    hmask, qs, packed = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    d = blocks[..., 108:110].contiguous().view(torch.float16)[..., 0].float()
    nibble_shift = torch.tensor([0, 4], dtype=torch.uint8)[:, None]
    pair_shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    low = (packed[..., 0:8].reshape(*lead, 1, 8) >> nibble_shift).reshape(*lead, 16) & 0x0F
    high = (packed[..., 8:12].reshape(*lead, 1, 4) >> pair_shift).reshape(*lead, 16) & 0x03
    scale = (low | (high << 4)).to(torch.int16) - 32
    halves = (d[..., None] * scale.float()).reshape(*lead, 8, 2)
    low_bits = (qs.reshape(*lead, 2, 1, 32) >> pair_shift).reshape(*lead, 16, 16) & 0x03
    bit_shift = torch.arange(8, dtype=torch.uint8)[:, None]
    high_bit = (hmask.reshape(*lead, 1, 32) >> bit_shift).reshape(*lead, 16, 16) & 0x01
    codes = low_bits.to(torch.int8) - ((high_bit ^ 1) << 2).to(torch.int8)
    factors = _no_min_factors(scale.to(torch.int8).reshape(*lead, 8, 2), _half(blocks, 108))
    return codes.reshape(*lead, 8, 32), halves, torch.full((*lead, 8), -0.0), factors


def _q2_k_codes(kind: str, blocks: torch.Tensor) -> Decoded:
    """Codes [..., 8, 32], d and m [..., 8, 2] of Q2_K super-blocks [..., 84]: 16 bytes of
    4-bit sub-scales (low nibble) and sub-mins (high), 64 of 2-bit codes, d f16, dmin f16.
    Sixteen sub-blocks of 16 weights: group j's halves are sub-blocks 2j and 2j + 1, each with
    its own d = d * sc and m = -(dmin * min) (float32, exact), codes 0..3 (group j: bits
    2 (j % 4) of the 32 bytes at 32 (j // 4)), so codes * d + m is GGML's
    `d * sc * q - dmin * min` bit for bit."""
    lead = blocks.shape[:-1]
    sub, qs = blocks[..., 0:16], blocks[..., 16:80]
    d = blocks[..., 80:82].contiguous().view(torch.float16)[..., 0].float()
    dmin = blocks[..., 82:84].contiguous().view(torch.float16)[..., 0].float()
    pair_shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    codes = (qs.reshape(*lead, 2, 1, 32) >> pair_shift) & 0x03  # [..., 2, 4, 32]
    halves = (d[..., None] * (sub & 0x0F).float()).reshape(*lead, 8, 2)
    mins = (-(dmin[..., None] * (sub >> 4).float())).reshape(*lead, 8, 2)
    factors = ScaleFactors(
        (sub & 0x0F).to(torch.int8).reshape(*lead, 8, 2),
        _half(blocks, 80),
        (sub >> 4).to(torch.int8).reshape(*lead, 8, 2),
        -_half(blocks, 82),
    )
    return codes.reshape(*lead, 8, 32), halves, mins, factors


def _iq4_indices(packed: torch.Tensor) -> torch.Tensor:
    """The 32 level indices of 16 bytes of nibbles [..., 16]: byte j holds weight j (low
    nibble) and weight j + 16 (high), as in Q4_0."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _iq4_nl_codes(kind: str, blocks: torch.Tensor) -> Decoded:
    """Codes [..., 32], d and m [...] of IQ4_NL blocks [..., 18]: d f16, 16 bytes of nibbles,
    each an index into the 16 non-uniform levels (the codes: `BlockType.levels`), so
    IQ4_LEVELS[code] * d is GGML's `d * kvalues[q]` bit for bit; m = -0 (no min)."""
    d = _half(blocks, 0)
    return _iq4_indices(blocks[..., 2:18]), d, torch.full_like(d, -0.0), None


def _iq4_xs_codes(kind: str, blocks: torch.Tensor) -> Decoded:
    """Codes [..., 8, 32], d and m [..., 8] of IQ4_XS super-blocks [..., 136]: d f16, the
    sub-scales' high 2 bits (uint16), their low 4 bits (4 bytes), then 16 bytes of IQ4_NL
    nibbles per 32-weight group. Group j's d = d * (scale_j - 32) (float32, exact), codes the
    level indices: IQ4_LEVELS[code] * d is GGML's `d * (ls - 32) * kvalues[q]` bit for bit."""
    lead = blocks.shape[:-1]
    high = blocks[..., 2:4].contiguous().view(torch.int16)[..., 0].to(torch.int32)
    low = blocks[..., 4:8]
    low = torch.stack([low & 0x0F, low >> 4], dim=-1).reshape(*lead, 8).to(torch.int32)
    shifts = torch.arange(0, 16, 2, dtype=torch.int32)
    scale = low | (((high[..., None] >> shifts) & 3) << 4)
    sub = (scale - 32).to(torch.int8)
    codes = _iq4_indices(blocks[..., 8:136].reshape(*lead, 8, 16))
    d = _half(blocks, 0)
    factors = ScaleFactors(sub, d, torch.zeros_like(sub), torch.full_like(d, -0.0))
    return codes, d.float()[..., None] * sub.float(), torch.full((*lead, 8), -0.0), factors


# codes, d, m, and the K-quants' d and m in their own two levels (ScaleFactors), per block
Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor, ScaleFactors | None]
Decoder = Callable[[str, torch.Tensor], Decoded]


@dataclass(frozen=True)
class BlockType:
    """A GGML type whose blocks are the kernel's groups exactly."""

    # the code width that holds it: 4, 5 or 6 (the kernel's nibbles plus bit planes), 8
    bits: int
    block_bytes: int
    block_weights: int  # 32, or a K-quant super-block's 256 (8 groups)
    decode: Decoder
    levels: bool = False  # the codes index IQ4_LEVELS


# K-quant groups' d and m are float32 products (super-block d times a 6-bit sub-scale), exact
# there and not in float16; Q2_K's, Q3_K's and Q6_K's 16-weight sub-blocks are the two halves
# of a group (Q2_K's each with its own m as well: the kernel's "half mins" layout).
EXACT_BLOCKS = {
    "Q4_0": BlockType(4, 18, 32, _block_codes),
    "Q4_1": BlockType(4, 20, 32, _block_codes),
    "Q5_0": BlockType(5, 22, 32, _block_codes),
    "Q5_1": BlockType(5, 24, 32, _block_codes),
    "Q8_0": BlockType(8, 34, 32, _block_codes),
    "Q4_K": BlockType(4, 144, 256, _super_block_codes),
    "Q5_K": BlockType(5, 176, 256, _super_block_codes),
    "Q6_K": BlockType(6, 210, 256, _q6_k_codes),
    "Q3_K": BlockType(6, 110, 256, _q3_k_codes),
    "Q2_K": BlockType(4, 84, 256, _q2_k_codes),
    "IQ4_NL": BlockType(4, 18, 32, _iq4_nl_codes, levels=True),
    "IQ4_XS": BlockType(4, 136, 256, _iq4_xs_codes, levels=True),
}
# Every quantized GGML type by the kernel code width that serves it: its own blocks where
# `EXACT_BLOCKS` has it; the others re-quantized from their values to the nearest width, with
# a warning at load (IQ1-IQ3 are codebooks of vectors).
GGML_BITS = {
    **{kind: block.bits for kind, block in EXACT_BLOCKS.items()},
    **dict.fromkeys(("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS"), 4),
    **dict.fromkeys(("IQ2_S", "IQ3_XXS", "IQ3_S"), 4),
    **dict.fromkeys(("Q8_1", "Q8_K"), 8),
}


def block_group_codes(kind: str, raw: torch.Tensor, rows: int, cols: int) -> GroupCodes:
    """A [rows, cols] tensor's raw bytes of `kind`'s blocks as the kernel's groups, in the
    file's row order; decoded `QUANTIZE_ROWS` rows at a time into the whole's tensors (whole,
    a 1B's Q6_K head took ~2 GB of bit-twiddling temporaries: a first start's peak)."""
    block = EXACT_BLOCKS[kind]
    blocks = raw.reshape(rows, cols // block.block_weights, block.block_bytes)
    first = _decoded_rows(kind, blocks[:QUANTIZE_ROWS], cols)
    if len(first.codes) == rows:
        return first
    whole = [t.new_empty(rows, *t.shape[1:]) for t in first.tensors()]
    for start in range(0, rows, QUANTIZE_ROWS):
        part = (
            first
            if start == 0
            else _decoded_rows(kind, blocks[start : start + QUANTIZE_ROWS], cols)
        )
        for i, piece in enumerate(part.tensors()):
            if piece.dtype != whole[i].dtype:  # Q4_0's m in float32 where float16 cannot hold it
                whole[i] = whole[i].to(torch.promote_types(piece.dtype, whole[i].dtype))
            whole[i][start : start + len(piece)] = piece
    return first.with_tensors(whole)


def _decoded_rows(kind: str, blocks: torch.Tensor, cols: int) -> GroupCodes:
    block = EXACT_BLOCKS[kind]
    rows = len(blocks)
    codes, d, m, factors = block.decode(kind, blocks)
    groups = cols // GROUP_SIZE

    def per_group(x: torch.Tensor) -> torch.Tensor:  # [rows, groups, 2] for one per half
        return x.reshape(rows, groups, -1).squeeze(-1)

    if factors is not None:
        factors = ScaleFactors(
            per_group(factors.d_sub),
            factors.d_super.reshape(rows, groups // 8),
            per_group(factors.m_sub),
            factors.m_super.reshape(rows, groups // 8),
        )
    return GroupCodes(
        codes.reshape(rows, groups, GROUP_SIZE),
        per_group(d),
        per_group(m),
        block.bits,
        factors,
        block.levels,
    )


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (in `arch`'s names);
    None if unknown."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    names = _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{kind}"
    return None


def blocks_quantized_state(
    model: nn.Module, gguf: GGUFWeights, weights: WeightFormat, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """What `restore_quantized_model` takes (`engine.quantization.quantized_state`'s layout)
    for `model` (built on the meta device), from the file's own blocks, linear by linear:
    the first start never holds float weights it does not serve, and the codes are the
    file's, not a re-quantization of their dequantized values."""
    fuse = getattr(model, "fuse_hf_state", None)
    if fuse is None:
        raise ValueError(f"{type(model).__name__} cannot load GGUF tensors directly")
    # Each value names the Hugging Face tensors a weight of the model is made of, in order.
    sources: dict[str, tuple[str, ...]] = fuse(
        {name: (name,) for name in gguf.names()}, lambda parts: sum(parts, ())
    )
    state: dict[str, torch.Tensor] = {}
    requantized: Counter[str] = Counter()
    for full, _parent, _name, _child, kind in quantizable_linears(model, weights):
        key = f"{full}.weight"
        tied = key not in sources and getattr(model, "tie_word_embeddings", False)
        names = sources["embed_tokens.weight"] if key not in sources else sources.pop(key)
        before = sum(requantized.values())
        blocks = _fused_codes(gguf, names, BITS.get(kind), requantized)
        if tied and sum(requantized.values()) == before:
            # the head's codes are the embedding's values: it is read from them
            # (`HeadRowsEmbedding`), with no float copy of the table
            del sources["embed_tokens.weight"]
        packed = [
            pack_weight(c.codes, c.d, c.m, c.bits, factors=c.factors, levels=c.levels)
            for c in blocks
        ]
        state.update(parts_state(packed, f"{full}.quantized"))
        if weights.dense_copies:
            dense = [codes.dequantize(dtype) for codes in blocks]
            state[f"{full}.dense.weight"] = dense[0] if len(dense) == 1 else torch.cat(dense)
    for key, names in sources.items():
        parts = [gguf.dequantize(name, dtype) for name in names]
        state[key] = parts[0] if len(parts) == 1 else torch.cat(parts)
    if requantized:
        logger.warning(
            "re-quantized from their values (a second rounding): %s",
            ", ".join(f"{kind} x {count}" for kind, count in sorted(requantized.items())),
        )
    return state


def _fused_codes(
    gguf: GGUFWeights, names: tuple[str, ...], bits: int | None, requantized: Counter[str]
) -> list[GroupCodes]:
    """The tensors `names` (a linear's, fused in this order) as its row blocks: each tensor
    its own blocks where they fit, re-quantized from its values otherwise (counted by type in
    `requantized`). `bits`: one code width for all (a format such as int8 asked for; 4-bit
    blocks widened), None: each tensor at its file type's."""
    parts = []
    for name in names:
        width = bits or gguf.bits_of(name)
        codes = gguf.group_codes(name)
        if codes is None or codes.bits > width:
            requantized[gguf.entries[name].kind] += 1
            codes = _quantized(gguf.dequantize(name), width)
        parts.append(codes.widened(width))
    return row_blocks(parts)


def row_blocks(parts: list[GroupCodes]) -> list[GroupCodes]:
    """Consecutive parts of one layout (code width, and the K-quants' two-level scales or
    not) joined into one block, a block per run (`QuantizedLinear`'s parts); all joined at
    the widest width where a run would not hold whole tiles of rows."""
    runs: list[list[GroupCodes]] = []
    for part in parts:
        if runs and _layout(runs[-1][0]) == _layout(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    if any(sum(len(part.codes) for part in run) % TILE_ROWS for run in runs):
        runs = [parts]
    return [run[0] if len(run) == 1 else GroupCodes.cat(run) for run in runs]


def _layout(codes: GroupCodes) -> tuple[int, bool, bool]:
    return codes.bits, codes.factors is not None, codes.levels


def _quantized(w: torch.Tensor, bits: int) -> GroupCodes:
    if bits in (4, 5, 6):  # a 5- or 6-bit linear's re-quantized part: 4-bit codes, widened
        codes, scale, low = quantize_int4(w)
        return GroupCodes(codes.to(torch.uint8), scale.half(), low.half(), 4).widened(bits)
    codes, scale = quantize_int8(w)
    return GroupCodes(codes.to(torch.int8), scale.half(), torch.zeros_like(scale).half(), 8)
