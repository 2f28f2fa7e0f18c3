"""Building blocks shared by the model files."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.model_config import ModelConfig
from engine.executor.attention import ForwardBatch, store_kv


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An embedding table left uninitialized: every model is built on the meta device and
    then given the file's weights, and `nn.Embedding`'s own random init on meta goes through
    torch's reference ops, whose first use imports torch._dynamo (1.2 s of every start)."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 and cast back exactly as transformers does.

    `use_kernel` takes the C++ op (engine/kernels/layer_ops.cpp): one call where torch makes
    four, and a batch-1 step runs 61 norms."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    @property
    def gain(self) -> torch.Tensor:
        """What the normalised row is multiplied by."""
        return self.weight

    def forward(self, x: torch.Tensor, use_kernel: bool = False) -> torch.Tensor:
        if use_kernel:
            out: torch.Tensor = torch.ops.prefixgate.rms_norm(x, self.gain, self.eps)
            return out
        normed = torch.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.gain * normed.to(x.dtype)

    def add(
        self, x: torch.Tensor, residual: torch.Tensor, use_kernel: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a sublayer's residual add fused into the norm
        that reads its sum, as vLLM does."""
        if use_kernel:
            normed, total = torch.ops.prefixgate.add_rms_norm(x, residual, self.gain, self.eps)
            return normed, total
        total = residual + x
        return self.forward(total), total


def silu_and_mul(gate_up: torch.Tensor, use_kernel: bool = False) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up` of a fused [rows, 2 * intermediate] projection."""
    if use_kernel:
        out: torch.Tensor = torch.ops.prefixgate.silu_and_mul(gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor, use_kernel: bool = False) -> torch.Tensor:
    """GeGLU's `gelu_tanh(gate) * up` (Gemma) of a fused [rows, 2 * intermediate] projection."""
    if use_kernel:
        out: torch.Tensor = torch.ops.prefixgate.gelu_tanh_and_mul(gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class PackedLinear(nn.Module):
    """A CPU `nn.Linear` whose weight is packed once into oneDNN's blocked layout.

    Why: the stock CPU linear re-blocks the weight on every call, which at decode row counts
    (1-32 rows) costs as much as the product itself. Packed at load time, the matmuls of a
    batch-8 SmolLM2 decode step took 9.1 instead of 18.6 ms in bfloat16 (and 2.5x less in
    float32), with bit-identical bfloat16 results. The tied head gets its own packed copy.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed_weight: torch.Tensor
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight), persistent=False
        )
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_pack_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing serves CPU float32, and bfloat16 where the CPU has native support."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` by a `PackedLinear`; returns how many."""
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    # Holds no reference to the replaced linears: each one's weight is freed once its packed
    # copy exists, instead of all of them at the end (a 270 MB higher peak for SmolLM2).
    for parent, name in targets:
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    return len(targets)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_positions`, precomputed once.

    Inverse frequencies come from transformers' own RoPE initialisers, so Llama 3 / linear /
    dynamic / YaRN scaling match the reference implementation.
    """

    def __init__(
        self, hf_config: Any, max_positions: int, dtype: torch.dtype, layer_type: str = ""
    ) -> None:
        super().__init__()
        with torch.device("cpu"):  # real numbers even while the model is built on meta
            inv_freq, scaling = _inv_freq(hf_config, layer_type, max_positions)
            t = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)  # [max_positions, rot_dim / 2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rot_dim]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows of `positions`, [num_tokens, 1, rot_dim]: looked up once per
        forward and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rope_and_store(
    qkv: torch.Tensor,  # [num_tokens, num_heads + 2 * num_kv_heads, head_dim], fresh
    rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of a fused projection, q and k rotated, k and v stored into the paged cache.
    The C++ op does both in one pass over the row (rotating in place); torch takes ~10 ops."""
    num_qk_heads = num_heads + k_cache.shape[2]
    v = qkv[:, num_qk_heads:]
    if batch.use_cpu_kernels:
        cos, sin = rope
        torch.ops.prefixgate.rope_and_cache(
            qkv, cos, sin, k_cache, v_cache, batch.slot_mapping, num_heads
        )
        qk = qkv[:, :num_qk_heads]
    else:
        qk = rotate(qkv[:, :num_qk_heads], rope)
        store_kv(qk[:, num_heads:], v, k_cache, v_cache, batch.slot_mapping)
    return qk[:, :num_heads], qk[:, num_heads:], v


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE (rotate-half form) of x [num_tokens, heads, head_dim]; q and k heads go in
    together as one tensor, one set of ops for both. Tables narrower than head_dim rotate
    its first dims only and pass the rest (Phi's partial rotary)."""
    cos, sin = rope
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((rotate(x[..., :rot], rope), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _inv_freq(hf_config: Any, layer_type: str, max_positions: int) -> tuple[torch.Tensor, float]:
    """`layer_type`: for a model whose RoPE differs by layer kind (Gemma 3's sliding and full
    attention), whose parameters; "" for the one set of the others.

    LongRoPE (Phi-3.5, Phi-4-mini) has two sets of factors: transformers switches from the
    short to the long ones once a forward's longest sequence passes the pretraining length,
    which would rotate a token differently by what else is in its batch and re-rotate nothing
    already cached. Here, as in llama.cpp, the served context decides once: the long factors
    where `max_positions` exceeds the pretraining length, else the short ones, for every
    position, so a position's rotation never depends on anything else."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs: dict[str, Any] = {"layer_type": layer_type} if layer_type else {}
        if rope_type == "longrope":
            kwargs["seq_len"] = max_positions
        if isinstance(hf_config, ModelConfig):  # its initialisers need their own config class
            hf_config = hf_config.as_transformers()
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
        return inv_freq.float(), float(scaling)
    base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))  # Phi-4-mini's 0.75
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return inv_freq, 1.0


def sliding_layers(hf_config: Any) -> tuple[list[bool], int]:
    """Which layers attend to a sliding window, and its width (0: none). From `layer_types`
    where the config has them (Gemma 3, Qwen2/3 with `use_sliding_window`), else Mistral's
    one `sliding_window` for every layer."""
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        window = int(getattr(hf_config, "sliding_window", None) or 0)
        return [window > 0] * hf_config.num_hidden_layers, window
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not served")
    flags = [kind == "sliding_attention" for kind in types]
    if not any(flags):
        return flags, 0
    if not getattr(hf_config, "sliding_window", None):
        raise ValueError("sliding-window layers without a sliding_window in the config")
    return flags, int(hf_config.sliding_window)


def stack_weights(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate projections along the output dim (q/k/v -> qkv, gate/up -> gate_up)."""
    return torch.cat(tensors, dim=0)


def load_exact(module: nn.Module, sd: dict[str, torch.Tensor], tied: set[str]) -> None:
    """Load every parameter from `sd`; anything missing or left over is an error.

    The tensors are assigned, not copied: the model is built on the meta device and takes
    over the loaded weights, so loading never holds two float copies of the model."""
    missing, unexpected = module.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(
            f"weights do not fit the model: missing {missing}, unexpected {unexpected}"
        )
