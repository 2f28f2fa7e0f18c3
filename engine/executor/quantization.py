"""Group-wise 4- and 8-bit weights for CPU decode, on our integer-dot-product kernel.

Why: a batch-1 decode step streams every weight once, so its time is the weights' size over
memory bandwidth. SmolLM2's linears and head in bf16 are 269 MB; as 4-bit codes with a scale
and a min per group of 32 (8-bit for the head) they are ~100 MB, and
`torch.ops.prefixgate.quant_matmul` (engine/executor/kernels/quant_matmul_kernel.h)
multiplies them by activations quantized to 8 bits per group, llama.cpp's scheme, at close
to memory bandwidth on AVX2 as on AVX-512 (docs/benchmarks.md, "Issue 12, third session").

The two schemes are GGML's own: `int4` is Q4_1 (per group, d = (max - min) / 15, m = min,
q = round((w - m) / d)) and `int8` is Q8_0 (d = absmax / 127, q = round(w / d)). Applied to
weights dequantized from a Q4_1 / Q8_0 GGUF they give back the file's codes exactly, since
each group's extremes sit on its grid; d and m are kept in float16, as the GGUF keeps them:
the embedded model runs on the weights as shipped.

One numeric path per layer: where the kernel is built, every call takes it, whatever its row
count (it computes each output row alone, in the same order whatever M is, so a token's
result does not depend on the batch it came in). A `QuantizedLinear` keeps a dense copy of the
same (dequantized) weights only where the kernel is not built, and then runs on it alone.
On AVX-512 a bf16 dense GEMM was faster above 16 rows (prefill); that switch made a prompt's
K/V differ between a prefill and a decode, and is gone (docs/benchmarks.md, issue 24).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
from torch import nn

from engine.core.memory import return_freed_memory

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
TILE_ROWS = 8  # the kernel's tile: weight rows interleaved 4 columns at a time
UNIT_TILES = 2  # tiles stored together, group by group: one stream per thread
BITS = {"int4": 4, "int8": 8}
# A GGUF's own blocks, linear by linear: each in the narrowest of the kernel's code widths that
# holds its file type exactly (engine.loading.gguf), so one model mixes 4- and 8-bit linears.
FILE_BLOCKS = "gguf"

# IQ4_NL's and IQ4_XS's 16 non-uniform levels (ggml's kvalues_iq4nl): their codes are 4-bit
# indices into these, which the kernel reads as the 8-bit codes they pick (`levels`; the op
# takes them as `bits` LEVELS_BITS).
IQ4_LEVELS = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8
)
LEVELS_BITS = 12  # engine/executor/kernels/quant_matmul_kernel.h's kLevels
QUANTIZE_ROWS = 4096  # rows quantized or packed at a time; whole units (16 rows)


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight in the kernel's layout (see engine/executor/kernels/quant_matmul_kernel.h)."""

    # [ceil(N / 16), K / 32, 64 * bits] uint8: units of two tiles of 8 rows (an odd last tile
    # alone, its partner's slot zeros), group by group, each group's 32-byte chunks of tile 0
    # and tile 1 side by side (bits 4, 5, 6 or 8: 5 and 6 are 4's nibbles then a plane per
    # higher bit; 6 holds w + 32)
    codes: torch.Tensor
    # [ceil(N / 16), K / 32, 2, 16] float16 (float32 where the groups' d, m need it: K-quants):
    # per unit and group, d then m of its 16 rows; [.., 1, 16] d alone where every m is 0
    # (Q8_0, int8: 1/18 of the bytes a step reads); with `halves`, a d per 16-column half
    # first: [.., 2, 16] alone (Q6_K, Q3_K), [.., 3, 16] then m, [.., 4, 16] then an m per half
    # (Q2_K) (or int8 sub-scales where `factors` is set: the K-quants' two levels, see
    # ScaleFactors)
    scales: torch.Tensor
    bits: int
    out_features: int  # N
    # [ceil(N / 16), K / 256, scale rows, 16] float16: each int8 scale's factor, per 8 groups
    factors: torch.Tensor | None = None
    halves: bool = False  # scale rows 0 and 1 are a d per 16-column half
    levels: bool = False  # 4-bit codes that index IQ4_LEVELS (IQ4_NL, IQ4_XS)

    @property
    def op_bits(self) -> int:
        """The kernel ops' `bits`: the code width, LEVELS_BITS for level indices."""
        return LEVELS_BITS if self.levels else self.bits

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.factors is None else self.factors.nbytes
        return self.codes.nbytes + self.scales.nbytes + extra

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * GROUP_SIZE

    def float_scales(self, rows: torch.Tensor) -> torch.Tensor:
        """Scales of weight rows `rows` as float32 [len(rows), scale rows, K / 32] (the
        products, exact, where they are factored)."""
        unit, lane = rows // (UNIT_TILES * TILE_ROWS), rows % (UNIT_TILES * TILE_ROWS)
        scales = self.scales[unit, :, :, lane].float()  # [n, G, scale rows]
        if self.factors is not None:
            scales = scales * self.factors[unit, :, :, lane].float().repeat_interleave(8, 1)
        return scales.transpose(1, 2)

    @property
    def num_mins(self) -> int:
        """Scale rows of m after the d: 0 (m = 0), 1, or 2 (one a half)."""
        return self.scales.shape[2] - (2 if self.halves else 1)

    def matmul(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """x [M, K] (float32 or bf16, contiguous) times this weight: [M, N] in x's dtype, or
        with `float_out` in float32 (the kernel's sums, not rounded to bf16), on the kernel."""
        out: torch.Tensor = torch.ops.prefixgate.quant_matmul(
            x,
            self.codes,
            self.scales,
            self.op_bits,
            self.out_features,
            self.factors,
            self.halves,
            float_out,
        )
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows `ids` as float32 [len(ids), K], on the kernel: `dequantize_rows`'s
        values bit for bit, in one op instead of ~100 small torch ops (0.24 ms for one row
        of a 1B's head, a decode step's embedding)."""
        out: torch.Tensor = torch.ops.prefixgate.dequantize_rows(
            self.codes,
            self.scales,
            self.op_bits,
            self.out_features,
            ids,
            self.factors,
            self.halves,
        )
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.factors) if t is not None]

    def moved(self, place: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """This weight with its tensors replaced by `place`'s copies of them."""
        factors = None if self.factors is None else place(self.factors)
        return dataclasses.replace(
            self, codes=place(self.codes), scales=place(self.scales), factors=factors
        )

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """This weight as named tensors, for a state dict (`from_state` reads them back)."""
        state = {f"{prefix}.codes": self.codes, f"{prefix}.scales": self.scales}
        if self.factors is not None:
            state[f"{prefix}.factors"] = self.factors
        state[f"{prefix}.halves"] = torch.tensor(self.halves)
        if self.levels:
            state[f"{prefix}.levels"] = torch.tensor(True)
        return state

    @classmethod
    def from_state(
        cls, state: dict[str, torch.Tensor], prefix: str, out_features: int
    ) -> QuantizedWeight:
        """The weight `state` holds under `prefix` (popped): its code width is its codes'."""
        if f"{prefix}.codes" not in state:
            raise ValueError(f"no quantized weight {prefix} in the quantized state")
        codes = state.pop(f"{prefix}.codes")
        return cls(
            codes,
            state.pop(f"{prefix}.scales"),
            codes.shape[-1] // 64,  # [ceil(N / 16), K / 32, 64 * bits]
            out_features,
            state.pop(f"{prefix}.factors", None),
            bool(state.pop(f"{prefix}.halves")),
            bool(state.pop(f"{prefix}.levels", False)),
        )


def per_half(x: torch.Tensor, wanted: bool) -> torch.Tensor:
    """A d or m per group [N, K / 32] as two equal ones per 16-column half [N, K / 32, 2]
    where `wanted` (one already per half stays)."""
    return x[..., None].expand(*x.shape, 2) if wanted and x.dim() == 2 else x


@dataclass(frozen=True)
class ScaleFactors:
    """A K-quant's d and m in its own two levels: d = d_sub * d_super, m = m_sub * m_super,
    with int8 sub-scales per group (or per 16-column half, [N, K / 32, 2]) and one float16
    factor per super-block of 8 groups [N, K / 256] (the file's d and -dmin). The products are
    exact in float32, so the kernel computes with the same numbers from 1.25 bits a weight of
    scales instead of 2 (float32 d and m per group): Q4_K's 6 bits a weight become 4.6."""

    d_sub: torch.Tensor
    d_super: torch.Tensor
    m_sub: torch.Tensor
    m_super: torch.Tensor

    def rows(self, start: int, end: int) -> ScaleFactors:
        """Rows [start, end) of every part."""
        return ScaleFactors(*(getattr(self, f.name)[start:end] for f in fields(ScaleFactors)))

    def per_half(self, d: bool, m: bool) -> ScaleFactors:
        """One sub-scale per group as two equal halves' (`d`, `m`: which)."""
        return ScaleFactors(
            per_half(self.d_sub, d), self.d_super, per_half(self.m_sub, m), self.m_super
        )

    @staticmethod
    def cat(parts: list[ScaleFactors]) -> ScaleFactors:
        """Rows of `parts` one after another."""
        return ScaleFactors(
            *(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(ScaleFactors))
        )


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1: codes [N, K / 32, 32] in 0..15 (as floats), scale d and min m [N, K / 32],
    w ~ c * d + m."""
    groups = w.float().reshape(w.shape[0], -1, GROUP_SIZE)  # [N, K / 32, 32]
    low, high = torch.aminmax(groups, dim=-1)
    scale = (high - low) / 15
    safe = torch.where(scale == 0, 1.0, scale)[..., None]
    codes = torch.round((groups - low[..., None]) / safe).clamp_(0, 15)
    return codes, scale, low


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0: codes [N, K / 32, 32] in -127..127 (as floats) and scale d [N, K / 32],
    w ~ q * d."""
    groups = w.float().reshape(w.shape[0], -1, GROUP_SIZE)
    scale = groups.abs().amax(-1) / 127
    safe = torch.where(scale == 0, 1.0, scale)[..., None]
    return torch.round(groups / safe).clamp_(-127, 127), scale


def quantize_weight(
    w: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32
) -> tuple[QuantizedWeight, torch.Tensor]:
    """`w` [N, K] (K a multiple of 32, N of 8) in the kernel's layout, and the weight it
    stands for (float16 scales included) in `dtype`, for the dense copy.

    Codes stay float32 until packing: torch's integer elementwise ops are several times
    slower. Rows go `QUANTIZE_ROWS` at a time: whole, the 49152-row head's temporaries were
    ~500 MB of the first start's peak."""
    weight = torch.empty(w.shape, dtype=dtype)
    codes, scales = [], []
    for start in range(0, w.shape[0], QUANTIZE_ROWS):
        chunk = w[start : start + QUANTIZE_ROWS]
        if bits == 4:
            q, scale, low = quantize_int4(chunk)
        else:
            q, scale = quantize_int8(chunk)
            low = torch.zeros_like(scale)
        scale, low = scale.half(), low.half()
        weight[start : start + QUANTIZE_ROWS] = (
            q.mul(scale.float()[..., None]).add_(low.float()[..., None]).flatten(1)
        )
        # one layout for every chunk: a chunk whose int4 mins are all 0 keeps its min row
        packed = pack_weight(q, scale, low, bits, with_min=bits != 8)
        codes.append(packed.codes)
        scales.append(packed.scales)
    return QuantizedWeight(torch.cat(codes), torch.cat(scales), bits, w.shape[0]), weight


def pack_weight(
    codes: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor,
    bits: int,
    with_min: bool | None = None,
    factors: ScaleFactors | None = None,
    levels: bool = False,
) -> QuantizedWeight:
    """Codes [N, K / 32, 32] (0..15 for 4 bits, 0..31 for 5, -32..31 for 6, -127..127 for 8,
    any dtype; with `levels`, 4-bit indices into IQ4_LEVELS) with d and m [N, K / 32] into
    the kernel's layout: tiles of 8 rows, each group as 8 steps of 4 columns with the 8 rows
    side by side in a step, two tiles to a unit stored group by group
    (engine/executor/kernels/quant_matmul_kernel.h). The scales stay float32 where d
    or m is (a K-quant's exact products), else float16. `scale` [N, K / 32, 2] gives each
    group a d per 16-column half (Q6_K's sub-blocks), then the kernel's halves; `low`
    [N, K / 32, 2] (with such a `scale`) an m per half too (Q2_K's).
    Where every m is 0 (and m is one per group), the scales are the d alone (Q6_K's two:
    its min row of -0.0 was ~4% of the bytes a step reads), unless `with_min` says (True: a
    min row whatever its values; False: m must be 0). With `factors` (d and m's
    own two levels) the scales are their int8 sub-scales, and the factors a tensor of their
    own.

    A tall weight goes `QUANTIZE_ROWS` rows at a time into the whole weight's tensors, its
    layout decided once for all of it: whole, a 1B's 128,256-row head took ~1 GB of
    temporaries (bytes per code, nibbles, bit planes) on top of its codes, most of a first
    start's peak."""
    assert not levels or bits == 4, "level indices are 4-bit codes"
    rows = scale.shape[0]
    if rows <= QUANTIZE_ROWS:
        return _pack_rows(codes, scale, low, bits, with_min, factors, levels)
    if with_min is None and low.dim() == 2:
        with_min = bool(low.any())
    unit_rows = UNIT_TILES * TILE_ROWS
    assert QUANTIZE_ROWS % unit_rows == 0, "chunks of whole units"
    units = -(-rows // unit_rows)

    def empty(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(units, *x.shape[1:])

    whole: QuantizedWeight | None = None
    for start in range(0, rows, QUANTIZE_ROWS):
        end = min(start + QUANTIZE_ROWS, rows)
        chunk = _pack_rows(
            codes[start:end],
            scale[start:end],
            low[start:end],
            bits,
            with_min,
            None if factors is None else factors.rows(start, end),
            levels,
        )
        if whole is None:  # every chunk has the first one's layout: the whole's tensors
            factors_out = None if chunk.factors is None else empty(chunk.factors)
            whole = dataclasses.replace(
                chunk,
                codes=empty(chunk.codes),
                scales=empty(chunk.scales),
                out_features=rows,
                factors=factors_out,
            )
        at = slice(start // unit_rows, start // unit_rows + len(chunk.codes))
        for mine, theirs in zip(whole.tensors(), chunk.tensors(), strict=True):
            mine[at] = theirs
    assert whole is not None
    return whole


def _pack_rows(
    codes: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor,
    bits: int,
    with_min: bool | None,
    factors: ScaleFactors | None,
    levels: bool = False,
) -> QuantizedWeight:
    rows, groups = scale.shape[:2]
    tiles = rows // TILE_ROWS
    steps = codes.reshape(tiles, TILE_ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [T, G, s, r, i]
    if bits in (4, 5, 6):
        # 6 bits: codes -32..31 stored as w + 32 (the kernel takes the 32 off its sums)
        codes8 = (
            (steps.to(torch.int16) + 32).to(torch.uint8) if bits == 6 else steps.to(torch.uint8)
        )
        nibbles = (codes8 & 15).reshape(tiles, groups, 4, 2, TILE_ROWS * 4)
        packed = nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)  # steps 2j, 2j + 1
        weights = torch.tensor([1 << s for s in range(8)], dtype=torch.uint8)[:, None]
        planes = [packed.reshape(tiles, groups, -1)]
        for bit in range(4, bits):  # then 32 bytes a bit: bit s of byte i, step s's code i's
            high = ((codes8 >> bit) & 1).reshape(tiles, groups, 8, TILE_ROWS * 4)  # [T, G, s, i]
            planes.append((high * weights).sum(2, dtype=torch.uint8))  # disjoint bits: no carry
        packed = torch.cat(planes, -1)
    else:
        packed = steps.to(torch.int8).view(torch.uint8)
    wide = torch.float32 in (scale.dtype, low.dtype)
    halves = scale.dim() == 3
    if low.dim() == 3:  # an m per half too (Q2_K's sub-blocks): two d, then two m
        rows_of = ["d0", "d1", "m0", "m1"]
    else:  # no min row where every m is 0: the kernel then skips the min term (same bits)
        if with_min is None:
            with_min = bool(low.any())
        if not with_min and bool(low.any()):
            raise ValueError("pack_weight: with_min=False, but some m is not 0")
        rows_of = ["d0", "d1"] if halves else ["d"]
        rows_of += ["m"] if with_min else []

    def pick(d: torch.Tensor, m: torch.Tensor, row: str) -> torch.Tensor:
        x = d if row[0] == "d" else m
        return x[..., int(row[1])] if len(row) == 2 else x

    def units(x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [ceil(T / 2), 2, ...]: tiles in pairs, an odd last one with zeros."""
        pad = -tiles % UNIT_TILES
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
        return x.reshape(-1, UNIT_TILES, *x.shape[1:])

    def tiled(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """[N, parts, G'] -> [N / 16, G', parts, 16]: a unit's 16 rows side by side."""
        stacked = torch.stack([p.to(dtype) for p in parts], 1)
        by_tile = stacked.reshape(tiles, TILE_ROWS, len(parts), -1)  # [T, r, parts, G']
        paired = units(by_tile).permute(0, 4, 3, 1, 2)  # [U, G', parts, tile, r]
        return paired.reshape(*paired.shape[:3], -1).contiguous()

    # [T, G, chunks, 32] -> [U, G, chunks, tile, 32]: chunk c of both tiles side by side
    by_chunk = units(packed.reshape(tiles, groups, -1, 32)).permute(0, 2, 3, 1, 4)
    codes_out = by_chunk.reshape(by_chunk.shape[0], groups, -1).contiguous()
    if factors is not None:
        subs = [pick(factors.d_sub, factors.m_sub, row) for row in rows_of]
        supers = [factors.d_super if row[0] == "d" else factors.m_super for row in rows_of]
        return QuantizedWeight(
            codes_out,
            tiled(subs, torch.int8),
            bits,
            rows,
            tiled(supers, torch.float16),
            halves,
            levels,
        )
    parts = [pick(scale, low, row).to(torch.float32) for row in rows_of]
    scales_out = tiled(parts, torch.float32 if wide else torch.float16)
    return QuantizedWeight(codes_out, scales_out, bits, rows, halves=halves, levels=levels)


@dataclass(frozen=True)
class WeightFormat:
    """How the linear weights are stored: "int4", "int8", `FILE_BLOCKS` (a GGUF's own blocks,
    each linear at its file type's width) or "none" (the compute dtype), for the decoder
    layers and for the LM head (which most formats keep at 8 bits); and whether a quantized
    linear keeps a dense copy to run on (where the kernel is not built). `file_types`: how
    many of the served linears' tensors the file holds in each GGML type, for the start-up
    line (and, through `str`, the quantized cache's key)."""

    layers: str = "none"
    head: str = "none"
    dense_copies: bool = True
    file_types: tuple[tuple[str, int], ...] = ()

    @property
    def is_quantized(self) -> bool:
        return self.layers != "none" or self.head != "none"

    def describe(self, dtype: torch.dtype) -> str:
        if not self.is_quantized:
            return f"{str(dtype).removeprefix('torch.')} weights"
        copies = "" if self.dense_copies else ", no dense copies"
        if FILE_BLOCKS in (self.layers, self.head):
            types = ", ".join(f"{kind} x {count}" for kind, count in self.file_types)
            return f"weights: {types} (the file's blocks, group {GROUP_SIZE}{copies})"
        return f"{self.layers} layers, {self.head} head (group {GROUP_SIZE}{copies})"


def quantizable_linears(
    model: nn.Module, weights: WeightFormat
) -> list[tuple[str, nn.Module, str, nn.Linear, str]]:
    """(qualified name, parent, attribute, linear, format) of every linear `weights` quantizes."""
    found = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if not isinstance(child, nn.Linear):
                continue
            if child.in_features % GROUP_SIZE or child.out_features % TILE_ROWS:
                continue  # the kernel takes K in groups of 32 and N in tiles of 8
            kind = weights.head if name == "lm_head" else weights.layers
            if kind != "none":
                full = f"{parent_name}.{name}" if parent_name else name
                found.append((full, parent, name, child, kind))
    return found


def quantize_linears(model: nn.Module, weights: WeightFormat, dtype: torch.dtype) -> int:
    """Replace the model's `nn.Linear`s (float, on CPU) by `QuantizedLinear`s whose dense copy
    is in `dtype` (made per layer, so loading never holds a second float32 model), the head
    (`lm_head`) by `weights.head`'s format and the others by `weights.layers`'; a linear the
    kernel cannot take (input size not a multiple of 32, output size of 8) stays as it is.
    Returns how many."""
    targets = quantizable_linears(model, weights)
    if any(kind not in BITS for *_, kind in targets):
        raise ValueError("a GGUF's own blocks are read by engine.loading.gguf, not quantized")
    count = len(targets)
    while targets:  # popped: a replaced linear's float weight is freed as soon as it is done
        _full, parent, name, child, kind = targets.pop()
        quantized, weight = quantize_weight(child.weight.detach(), BITS[kind], dtype)
        dense = None
        if weights.dense_copies:
            dense = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
            dense.weight = nn.Parameter(weight, requires_grad=False)
            dense.bias = child.bias
        setattr(parent, name, QuantizedLinear((quantized,), child.bias, dense))
        del child, weight, dense
        return_freed_memory()  # else the freed float weight stays in the heap
    return count


def parts_state(parts: Sequence[QuantizedWeight], prefix: str) -> dict[str, torch.Tensor]:
    """A linear's weight as named tensors: one layout under `prefix` itself, row blocks in
    several (`QuantizedLinear`) as `prefix.0`, `prefix.1`, ... with their row counts in
    `prefix.part_rows`; `parts_from_state` reads them back."""
    if len(parts) == 1:
        return parts[0].state(prefix)
    state = {f"{prefix}.part_rows": torch.tensor([part.out_features for part in parts])}
    for i, part in enumerate(parts):
        state.update(part.state(f"{prefix}.{i}"))
    return state


def parts_from_state(
    state: dict[str, torch.Tensor], prefix: str, out_features: int
) -> tuple[QuantizedWeight, ...]:
    """The row blocks `parts_state` wrote under `prefix` (popped), for a linear of
    `out_features` rows."""
    part_rows = state.pop(f"{prefix}.part_rows", None)
    if part_rows is None:
        return (QuantizedWeight.from_state(state, prefix, out_features),)
    rows = [int(n) for n in part_rows.tolist()]
    if sum(rows) != out_features:
        raise ValueError(f"{prefix}: row blocks of {rows} rows for a linear of {out_features}")
    return tuple(QuantizedWeight.from_state(state, f"{prefix}.{i}", n) for i, n in enumerate(rows))


def quantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What `restore_linears` + `load_state_dict` need to rebuild a quantized model without
    its float weights: the state dict (dense copies in the compute dtype) plus every quantized
    weight. Shared tensors appear once (a tied head, a bias the dense copy shares)."""
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            state.update(parts_state(module.parts, f"{name}.quantized"))
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            state[name] = tensor.contiguous()
    return state


def restore_linears(
    model: nn.Module, state: dict[str, torch.Tensor], weights: WeightFormat
) -> None:
    """Put `QuantizedLinear`s where `quantize_linears` put them, their quantized weights taken
    (popped) from `state`, their dense copies on the meta device for `load_state_dict` to
    assign. Each weight's code width is its codes' (a GGUF's linears may differ)."""
    for full, parent, name, child, _kind in quantizable_linears(model, weights):
        parts = parts_from_state(state, f"{full}.quantized", child.out_features)
        dense = None
        if weights.dense_copies:
            dense = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
        setattr(parent, name, QuantizedLinear(parts, child.bias, dense))


def relink_dense_biases(model: nn.Module) -> None:
    """After an assigning load: a dense copy shares its layer's bias again."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.dense is not None:
            bias = module.bias
            if bias is not None:
                assert isinstance(bias, nn.Parameter)
                module.dense.register_parameter("bias", bias)


class QuantizedLinear(nn.Module):
    """A linear layer with group-wise quantized weights, on the quantized kernel; on `dense`
    (the same weights, dequantized; prepacked where it can be) instead where the kernel is not
    built.

    The weight is one or more row blocks (`parts`), each in its own layout, and the product
    theirs side by side: a fused projection whose file tensors differ in type (Q4_K q and k
    beside a Q6_K v, as llama.cpp's Q4_K_M lays out half of a Llama's layers) keeps each
    tensor's own code width. In one layout the 4-bit q and k were read as 6-bit codes: 1.5 MB
    more a layer of a 1B, for one matmul call less (~5 us)."""

    def __init__(
        self,
        parts: Sequence[QuantizedWeight],
        bias: torch.Tensor | None,
        dense: nn.Module | None,
    ) -> None:
        super().__init__()
        if not parts or len({part.in_features for part in parts}) != 1:
            raise ValueError("a quantized linear takes one or more row blocks of one width")
        self.parts = tuple(parts)
        self.bias = bias
        self.dense = dense

    @property
    def quantized(self) -> QuantizedWeight:
        """The weight, where it is one layout (a head, an embedding read from it)."""
        if len(self.parts) != 1:
            raise ValueError(f"this linear's weight is {len(self.parts)} row blocks")
        return self.parts[0]

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    def forward(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """x times the weight, in x's dtype; with `float_out`, float32 (on the kernel its
        unrounded sums, on the dense copy the compute dtype's product widened)."""
        if self.dense is not None:
            out: torch.Tensor = self.dense(x)
            return out.float() if float_out else out
        x = x.contiguous()
        if len(self.parts) == 1:
            y = self.parts[0].matmul(x, float_out)
        else:
            y = torch.cat([part.matmul(x, float_out) for part in self.parts], dim=1)
        return y if self.bias is None else y + self.bias

    @property
    def num_weight_bytes(self) -> int:
        return sum(part.num_bytes for part in self.parts)


def dequantize_rows(weight: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of the weight as float32 [len(rows), K], `pack_weight` undone and
    w = code * d + m computed as `engine.loading.gguf.GroupCodes.dequantize` computes it (so
    the values are the same floats, bit for bit)."""
    groups, n = weight.codes.shape[1], len(rows)
    unit, slot, row = (
        rows // (UNIT_TILES * TILE_ROWS),
        rows // TILE_ROWS % UNIT_TILES,
        rows % TILE_ROWS,
    )
    by_chunk = weight.codes.view(-1, groups, weight.bits, UNIT_TILES, 32)
    mine = by_chunk[unit, :, :, slot].reshape(n, groups, -1)  # the rows' tiles' codes only
    if weight.bits in (4, 5, 6):  # byte j of a (tile row, column): steps 2j (low nibble), 2j + 1
        nibble_bytes = TILE_ROWS * GROUP_SIZE // 2
        packed = mine[:, :, :nibble_bytes].reshape(n, groups, 4, TILE_ROWS, 4)
        packed = packed[torch.arange(n), :, :, row]  # [n, G, 4, 4]
        steps = torch.stack((packed & 15, packed >> 4), 3)  # [n, G, 4, 2, 4]
        codes = steps.reshape(n, groups, GROUP_SIZE)
        for bit in range(4, weight.bits):  # bit s of byte 4r + i: row r's column 4s + i's
            at = nibble_bytes + 32 * (bit - 4)
            plane = mine[:, :, at : at + 32].reshape(n, groups, TILE_ROWS, 4)
            plane = plane[torch.arange(n), :, row]  # [n, G, 4]
            high = (plane[:, :, None] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
            codes = codes | (high.reshape(n, groups, GROUP_SIZE) << bit)  # [n, G, s, i]
        if weight.levels:  # indices of the levels
            codes = IQ4_LEVELS[codes.long()]
        codes = codes.float() - (32 if weight.bits == 6 else 0)  # 6 bits: stored as w + 32
    else:
        packed = mine.view(torch.int8).view(n, groups, 8, TILE_ROWS, 4)
        codes = packed[torch.arange(n), :, :, row].reshape(n, groups, GROUP_SIZE).float()
    scales = weight.float_scales(rows)  # [n, parts, G]

    def per_half(pair: torch.Tensor) -> torch.Tensor:  # [n, 2, G] -> [n, G, 32]
        return pair.transpose(1, 2).repeat_interleave(GROUP_SIZE // 2, -1)

    # a d (one per 16-column half with `halves`), then m (none, one, or one per half)
    d = per_half(scales[:, :2]) if weight.halves else scales[:, 0, :, None]
    # d alone: m is -0.0, the symmetric GGML types' (engine.loading.gguf._block_codes), which
    # adds nothing, as GGML's code * d adds nothing
    if weight.num_mins == 2:
        m = per_half(scales[:, 2:])
    else:
        m = scales[:, -1, :, None] if weight.num_mins else torch.full_like(d, -0.0)
    return codes.mul_(d).add_(m).flatten(1)


class HeadRowsEmbedding(nn.Module):
    """A tied embedding read from the quantized head's rows, where those rows are exactly the
    embedding's values (a GGUF's own blocks): no float copy of a vocabulary-sized table
    (Gemma 3's 262,144 x 640 in float32 is 671 MB)."""

    def __init__(self, head: QuantizedWeight, dtype: torch.dtype, use_kernel: bool) -> None:
        """`use_kernel`: the C++ op reads the rows (where the kernels are built: the head has
        no dense copy), else `dequantize_rows` in torch; the same values."""
        super().__init__()
        self.head = head  # not a submodule: the head's module owns it
        self.dtype = dtype
        self.use_kernel = use_kernel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            return self.head.rows(input_ids).to(self.dtype)
        return dequantize_rows(self.head, input_ids).to(self.dtype)


def kernel_linears(model: nn.Module) -> list[QuantizedLinear]:
    """The quantized linears that run on the kernel (no dense copy): whose weights a decode
    step streams."""
    return [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.dense is None]


def move_kernel_weights(model: nn.Module, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """The weight tensors of every linear on the kernel replaced by `place`'s copies, linear
    by linear (each original freed once its linear holds the copy); a tied embedding read
    from the head's rows follows its head."""
    readers = {id(m.head): m for m in model.modules() if isinstance(m, HeadRowsEmbedding)}
    for module in kernel_linears(model):
        parts = []
        for part in module.parts:
            parts.append(part.moved(place))
            if id(part) in readers:
                readers.pop(id(part)).head = parts[-1]
        module.parts = tuple(parts)


def head_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The head's logits [rows, vocab], always float32. On the quantized kernel they are its
    float32 sums as they are: in bf16 compute, logits rounded to bf16 moved in steps of
    0.0625-0.125 at common magnitudes, so a reported logprob was that coarse and a near-tie
    became an exact tie (greedy then took the lower token id). A dense head's product is the
    compute dtype's, widened."""
    if isinstance(head, QuantizedLinear):
        return head.forward(hidden, float_out=True)
    logits: torch.Tensor = head(hidden)
    return logits.float()


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` inside a decoder layer, through `.forward`: no hooks are ever set here, and
    the module call's bookkeeping was ~2 us x 120 projections a step."""
    out: torch.Tensor = linear.forward(x)
    return out
