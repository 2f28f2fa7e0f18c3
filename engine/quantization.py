"""Group-wise 4- and 8-bit weights for CPU decode, on torch's int4 CPU kernel.

Why: a batch-1 decode step streams every weight once, so its time is the weights' size over
memory bandwidth. SmolLM2's linears and head in bf16 are 269 MB; as 4-bit codes with a scale
and a zero per group of 32 (8-bit for the head) they are 102 MB, and torch's
`_weight_int4pack_mm_for_cpu` runs a batch-1 pass 2.9x (AVX-512, vs bf16) to 3.2x (AVX2, vs
fp32) faster than the prepacked dense GEMV (docs/benchmarks.md, "Issue 12").

The two schemes are GGML's own: `int4` is Q4_1 (per group, d = (max - min) / 15, m = min,
q = round((w - m) / d)) and `int8` is Q8_0 (d = absmax / 127, q = round(w / d)). Applied to
weights dequantized from a Q4_1 / Q8_0 GGUF they give back the file's codes exactly, since
each group's extremes sit on its grid: the embedded model runs on the weights as shipped.

torch's kernel computes w = (c - 8) * s + z for a 4-bit code c, so an int4 weight is one
such plane (s = d, z = m + 8d) and an int8 weight two, summed: with u = q + 128 = 16h + l,
w = d(16h + l - 128) = [(h - 8) * 16d + 0] + [(l - 8) * d + 8d]. Scales and zeros are kept
in bf16 (the kernel takes them in the activation's dtype; activations go in as bf16 on any
CPU), which rounds s and z by at most 2^-9 relative.

The kernel is a GEMV at heart: beyond a few rows the prepacked dense GEMM is faster, so a
`QuantizedLinear` also keeps a dense copy of the same (dequantized) weights and picks per
call by row count (`dense_above_rows`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.memory import return_freed_memory

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
BITS = {"int4": 4, "int8": 8}
ACTIVATION_DTYPE = torch.bfloat16

# Rows up to which the int4 kernel beats the prepacked dense GEMM over SmolLM2's 120 layer
# linears (30 distinct layers, weights not in cache), 2 threads, Zen 4, whole pass in ms
# (`tools/bench_decode_step.py --linears`, docs/benchmarks.md "Issue 12"):
#   AVX512 (bf16 dense):  M=1 4.8 vs 14.0, M=4 8.2 vs 13.2, M=8 13.4 vs 14.6, M=16 24.8 vs 18.6
#   AVX2   (fp32 dense):  M=1 9.6 vs 30.7, M=8 26.2 vs 40.8, M=16 49.2 vs 52.3, M=32 104 vs 79
DENSE_ABOVE_ROWS = {"AVX512": 8, "AVX2": 16}
DEFAULT_DENSE_ABOVE_ROWS = 16
QUANTIZE_ROWS = 4096  # a multiple of the int4 packing's row tile (64)


@dataclass(frozen=True)
class Int4Plane:
    """One 4-bit plane in the kernel's layout."""

    packed: torch.Tensor  # [N, K / 2] uint8 (the kernel's tiling)
    scales_zeros: torch.Tensor  # [K / GROUP_SIZE, N, 2] bf16


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


def quantize_planes(
    w: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32
) -> tuple[list[Int4Plane], torch.Tensor]:
    """`w` [N, K] (K a multiple of 32) as the 4-bit planes whose sum stands for it, and the
    weight they stand for (what the kernel multiplies by, bf16 scales included) in `dtype`.

    Codes stay float32 until packing: torch's integer elementwise ops are several times
    slower, and quantizing the 49152-row head took 1.5 s with them. Rows go
    `QUANTIZE_ROWS` at a time (the kernel packs rows in tiles that a chunk boundary does not
    cut): whole, the head's temporaries were ~500 MB of the first start's peak."""
    weight = torch.empty(w.shape, dtype=dtype)
    parts = []
    for start in range(0, w.shape[0], QUANTIZE_ROWS):
        planes, rows = _quantize_rows(w[start : start + QUANTIZE_ROWS], bits)
        weight[start : start + QUANTIZE_ROWS] = rows
        parts.append(planes)
    merged = [
        Int4Plane(
            torch.cat([p[i].packed for p in parts]),
            torch.cat([p[i].scales_zeros for p in parts], dim=1),
        )
        for i in range(len(parts[0]))
    ]
    return merged, weight


def _quantize_rows(w: torch.Tensor, bits: int) -> tuple[list[Int4Plane], torch.Tensor]:
    if bits == 4:
        codes, scale, low = quantize_int4(w)
        return _planes([(codes, scale, low + 8 * scale)])
    codes, scale = quantize_int8(w)
    unsigned = codes.add_(128)  # 1..255 = 16 * high + low
    high = torch.div(unsigned, 16, rounding_mode="floor")
    low = unsigned.sub_(high * 16)
    return _planes([(high, 16 * scale, torch.zeros_like(scale)), (low, scale, 8 * scale)])


def _planes(
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[list[Int4Plane], torch.Tensor]:
    planes = []
    weight = torch.zeros(parts[0][0].shape)  # [N, K / 32, 32]
    for codes, scale, zero in parts:
        scale, zero = scale.to(ACTIVATION_DTYPE), zero.to(ACTIVATION_DTYPE)  # [N, K / 32]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.flatten(1).to(torch.int32), 1
        )
        scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()  # [K / 32, N, 2]
        planes.append(Int4Plane(packed, scales_zeros))
        weight.addcmul_(codes - 8, scale.float()[..., None]).add_(zero.float()[..., None])
    return planes, weight.flatten(1)


def _int4_mm(x: torch.Tensor, plane: Int4Plane) -> torch.Tensor:
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, plane.packed, GROUP_SIZE, plane.scales_zeros
    )
    return out


@dataclass(frozen=True)
class WeightFormat:
    """How the linear weights are stored: "int4", "int8" or "none" (the compute dtype), for
    the decoder layers and for the LM head (which most formats keep at 8 bits)."""

    layers: str = "none"
    head: str = "none"

    @property
    def is_quantized(self) -> bool:
        return self.layers != "none" or self.head != "none"

    def describe(self, dtype: torch.dtype) -> str:
        if not self.is_quantized:
            return f"{str(dtype).removeprefix('torch.')} weights"
        return f"{self.layers} layers, {self.head} head (group {GROUP_SIZE})"


def _quantizable(
    model: nn.Module, weights: WeightFormat
) -> list[tuple[str, nn.Module, str, nn.Linear, str]]:
    """(qualified name, parent, attribute, linear, format) of every linear `weights` quantizes."""
    found = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if not isinstance(child, nn.Linear):
                continue
            if child.in_features % GROUP_SIZE or child.out_features % 16:
                continue  # the kernel packs K in groups of 32 and N in tiles of 16
            kind = weights.head if name == "lm_head" else weights.layers
            if kind != "none":
                full = f"{parent_name}.{name}" if parent_name else name
                found.append((full, parent, name, child, kind))
    return found


def quantize_linears(model: nn.Module, weights: WeightFormat, dtype: torch.dtype) -> int:
    """Replace the model's `nn.Linear`s (float, on CPU) by `QuantizedLinear`s whose dense copy
    is in `dtype` (made per layer, so loading never holds a second float32 model), the head
    (`lm_head`) by `weights.head`'s format and the others by `weights.layers`'; a linear the
    kernel cannot take (input size not a multiple of 32, output size of 16) stays as it is.
    Returns how many."""
    max_rows = dense_above_rows()
    targets = _quantizable(model, weights)
    count = len(targets)
    while targets:  # popped: a replaced linear's float weight is freed as soon as it is done
        _full, parent, name, child, kind = targets.pop()
        planes, weight = quantize_planes(child.weight.detach(), BITS[kind], dtype)
        dense = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
        dense.weight = nn.Parameter(weight, requires_grad=False)
        dense.bias = child.bias
        setattr(parent, name, QuantizedLinear(planes, child.bias, dense, max_rows))
        del child, weight
        return_freed_memory()  # else the freed float weight stays in the heap
    return count


def quantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What `restore_linears` + `load_state_dict` need to rebuild a quantized model without
    its float weights: the state dict (dense copies in the compute dtype) plus every plane.
    Shared tensors appear once (a tied head, a bias the dense copy shares)."""
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            for i, plane in enumerate(module.planes):
                state[f"{name}.planes.{i}.packed"] = plane.packed
                state[f"{name}.planes.{i}.scales_zeros"] = plane.scales_zeros
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            state[name] = tensor.contiguous()
    return state


def restore_linears(
    model: nn.Module, state: dict[str, torch.Tensor], weights: WeightFormat
) -> None:
    """Put `QuantizedLinear`s where `quantize_linears` put them, their planes taken (popped)
    from `state`, their dense copies on the meta device for `load_state_dict` to assign."""
    max_rows = dense_above_rows()
    for full, parent, name, child, _kind in _quantizable(model, weights):
        planes: list[Int4Plane] = []
        while f"{full}.planes.{len(planes)}.packed" in state:
            i = len(planes)
            packed = state.pop(f"{full}.planes.{i}.packed")
            planes.append(Int4Plane(packed, state.pop(f"{full}.planes.{i}.scales_zeros")))
        if not planes:
            raise ValueError(f"no planes for {full} in the quantized state")
        dense = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
        setattr(parent, name, QuantizedLinear(planes, child.bias, dense, max_rows))


def relink_dense_biases(model: nn.Module) -> None:
    """After an assigning load: a dense copy shares its layer's bias again."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            bias = module.bias
            if bias is not None:
                assert isinstance(bias, nn.Parameter)
                module.dense.register_parameter("bias", bias)


def dense_above_rows() -> int:
    """Row count above which the dense GEMM is faster, for this CPU's kernels."""
    capability = torch.backends.cpu.get_cpu_capability()
    return DENSE_ABOVE_ROWS.get(capability, DEFAULT_DENSE_ABOVE_ROWS)


class QuantizedLinear(nn.Module):
    """A linear layer with group-wise quantized weights: the int4 kernel for calls of up to
    `max_rows` rows (decode), `dense` (same weights, dequantized; prepacked where it can be)
    for larger ones (prefill, big decode batches)."""

    def __init__(
        self, planes: list[Int4Plane], bias: torch.Tensor | None, dense: nn.Module, max_rows: int
    ) -> None:
        super().__init__()
        self.planes = planes
        self.bias = bias
        self.dense = dense
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor, allow_int4: bool = True) -> torch.Tensor:
        if not allow_int4 or x.shape[0] > self.max_rows:
            out: torch.Tensor = self.dense(x)
            return out
        x16 = x if x.dtype == ACTIVATION_DTYPE else x.to(ACTIVATION_DTYPE)
        y = _int4_mm(x16, self.planes[0])
        for plane in self.planes[1:]:
            y = y + _int4_mm(x16, plane)
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @property
    def num_weight_bytes(self) -> int:
        return sum(p.packed.nbytes + p.scales_zeros.nbytes for p in self.planes)


def project(linear: nn.Module, x: torch.Tensor, decode_only: bool) -> torch.Tensor:
    """`linear(x)` inside a decoder layer. A quantized linear takes its int4 kernel only in a
    step with no prefill span: a prompt's K/V then come from the same (dense) arithmetic
    whether it is prefilled whole, in chunks or after a cache hit of any length, so an
    identical request gives identical text (the int4 path rounds activations to bf16, enough
    to flip a near-tie). The LM head, which sees only sampled rows, always may."""
    # `.forward`, not `__call__`: no hooks are ever set here, and the module call's bookkeeping
    # was ~2 us x 120 projections a step.
    if isinstance(linear, QuantizedLinear):
        return linear.forward(x, decode_only)
    out: torch.Tensor = linear.forward(x)
    return out
