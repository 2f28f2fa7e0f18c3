"""The Llama family: Llama 2/3.x, SmolLM2, TinyLlama, Mistral, Qwen2 (qkv bias), Qwen3 (an
RMSNorm over each query and key head before RoPE), SmolLM3 (no RoPE in every fourth layer),
Phi-3/3.5/4-mini (q/k/v and gate/up stored fused, LongRoPE, Phi-4-mini's partial rotary).

Projections that read the same input are fused at load time (q/k/v into `qkv_proj`,
gate/up into `gate_up_proj`): fewer, larger matmuls per layer, which is what a small model on
a 2-core CPU is bound by.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.executor.attention import ForwardBatch, paged_attention
from engine.executor.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    embedding,
    load_exact,
    rope_and_store,
    silu_and_mul,
    sliding_layers,
    stack_weights,
)
from engine.executor.quantization import head_logits, project

# Model types whose attention normalises each query and key head (over head_dim) before RoPE.
QK_NORM_TYPES = frozenset({"qwen3", "gemma3_text"})


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: Any,
        head_dim: int,
        has_bias: bool,
        scale: float | None = None,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        """`scale`: the scores' factor (head_dim ** -0.5 if None); `norm`: the q/k norms'
        kind, for a model type in QK_NORM_TYPES."""
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=has_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.model_type in QK_NORM_TYPES
        if self.qk_norm:
            self.q_norm = norm(head_dim, cfg.rms_norm_eps)
            self.k_norm = norm(head_dim, cfg.rms_norm_eps)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        sliding: bool = False,
    ) -> torch.Tensor:
        """`sliding`: a sliding-window layer (each query sees the model's last window keys)."""
        n = x.shape[0]
        qkv = project(self.qkv_proj, x).view(n, -1, self.head_dim)
        if self.qk_norm:  # in place, head by head (rows of head_dim), as every other norm
            heads, kv_end = self.num_heads, self.num_heads + self.num_kv_heads
            for norm, part in ((self.q_norm, slice(0, heads)), (self.k_norm, slice(heads, kv_end))):
                rows = qkv[:, part]
                qkv[:, part] = norm(
                    rows.reshape(-1, self.head_dim).contiguous(), batch.use_cpu_kernels
                ).view(rows.shape)
        q, k, v = rope_and_store(qkv, rope, self.k_cache, self.v_cache, batch, self.num_heads)
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, batch, self.scale, sliding)
        return project(self.o_proj, o.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        gate_up = project(self.gate_up_proj, x)
        act = silu_and_mul(gate_up, batch.use_cpu_kernels)
        return project(self.down_proj, act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, has_bias: bool, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.self_attn = LlamaAttention(cfg, head_dim, has_bias)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it). `x` is the previous
        layer's MLP output, not yet added to `residual` (None: x is the embedding): each add
        happens inside the norm that reads it."""
        kernels = batch.use_cpu_kernels
        if residual is None:
            residual, h = x, self.input_layernorm(x, kernels)
        else:
            h, residual = self.input_layernorm.add(x, residual, kernels)
        h, residual = self.post_attention_layernorm.add(
            self.self_attn(h, batch, rope, self.sliding), residual, kernels
        )
        return self.mlp(h, batch), residual


class LlamaForCausalLM(nn.Module):
    """Paged-KV Llama. `forward` returns hidden states; `compute_logits` projects chosen rows."""

    def __init__(self, cfg: Any, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype  # compute dtype (the KV cache may store another)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        has_bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim
        sliding, self.sliding_window = sliding_layers(cfg)  # Mistral's, Qwen2/3's
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        # SmolLM3's `no_rope_layers`: 1 where a layer rotates q and k, 0 where it does not.
        uses_rope = getattr(cfg, "no_rope_layers", None) or [1] * cfg.num_hidden_layers
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, head_dim, has_bias, flag) for flag in sliding
        )
        self.layer_uses_rope = [bool(flag) for flag in uses_rope]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rotary_args = (cfg, max_positions, dtype)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)build what weights loading does not cover: RoPE tables and the tied head.

        Called again after the model was materialised from the meta device.
        """
        self.rotary = RotaryEmbedding(*self._rotary_args)
        embedding = getattr(self.embed_tokens, "weight", None)  # None: read from the head
        if self.tie_word_embeddings and embedding is not None:
            self.lm_head.weight = embedding

    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(batch.input_ids)
        rope = self.rotary(batch.positions)
        # A NoPE layer takes the identity rotation (cos 1, sin 0): the same op stores its K/V.
        nope = rope
        if not all(self.layer_uses_rope):
            nope = (torch.ones_like(rope[0]), torch.zeros_like(rope[1]))
        residual = None
        for layer, uses_rope in zip(self.layers, self.layer_uses_rope, strict=True):
            x, residual = layer(x, residual, batch, rope if uses_rope else nope)
        assert residual is not None
        return self.norm.add(x, residual, batch.use_cpu_kernels)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        return head_logits(self.lm_head, hidden)

    def attention_layers(self) -> list[LlamaAttention]:
        return [m for m in self.modules() if isinstance(m, LlamaAttention)]

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face Llama state dict (consumed: each unfused q/k/v or gate/up
        tensor is freed once fused, not held to the end), fusing q/k/v and gate/up."""
        sd = self.fuse_hf_state(state_dict, stack_weights)
        sd = {k: v for k, v in sd.items() if "rotary_emb" not in k}
        tied = {"lm_head.weight"} if self.tie_word_embeddings else set()
        load_exact(self, sd, tied)

    def fuse_hf_state(
        self, state_dict: dict[str, Any], stack: Callable[[list[Any]], Any]
    ) -> dict[str, Any]:
        """Hugging Face names -> this model's (q/k/v and gate/up fused by `stack`, the tied
        head dropped), `state_dict` consumed. Values can be anything `stack` combines: float
        tensors here, a GGUF file's group codes in `engine.gguf_weights`."""
        sd = {k.removeprefix("model."): state_dict.pop(k) for k in list(state_dict)}
        if self.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        for i in range(len(self.layers)):
            p = f"layers.{i}."
            for kind in ("weight", "bias"):
                names = [f"{p}self_attn.{x}_proj.{kind}" for x in ("q", "k", "v")]
                if names[0] in sd:
                    sd[f"{p}self_attn.qkv_proj.{kind}"] = stack([sd.pop(n) for n in names])
            names = [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up")]
            if names[0] in sd:  # Phi-3's come fused already
                sd[f"{p}mlp.gate_up_proj.weight"] = stack([sd.pop(n) for n in names])
        return sd
