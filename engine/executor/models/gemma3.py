"""Gemma 3 (text): Llama's attention with a per-head q/k norm, most layers attending to a
sliding window of the last `sliding_window` keys (every `_sliding_window_pattern`-th layer
sees the whole context, with its own RoPE base), four norms a layer (each sublayer's output
normalised before its residual add), GeGLU, and embeddings scaled by sqrt(hidden_size).

Gemma's RMSNorm multiplies by (1 + weight): `GemmaRMSNorm` keeps Gemma's weight and computes
1 + weight once after loading, in float32 as transformers does at each call, then held in the
compute dtype; the norm itself is Llama's, C++ kernel included (in bfloat16 that rounds 1 + w
and the normalised row apart, where transformers rounds their float32 product once).

Every sliding-window layer reads the step's `windowed` view of attention
(engine/executor/attention.py): a query at position p attends to keys p - window + 1..p, in
the same fixed positional chunks as every other query, so the promise "same request, same
answer" holds here too. Blocks that fell out of every window are kept
(the full-attention layers still read them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.executor.attention import ForwardBatch
from engine.executor.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    embedding,
    gelu_tanh_and_mul,
    sliding_layers,
)
from engine.executor.models.llama import LlamaAttention, LlamaForCausalLM
from engine.executor.quantization import head_logits, project


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the normalised row times (1 + weight), 1 + weight computed once in
    float32 (`refresh`, after the weights are loaded) and held in the compute dtype. The
    weight stays Gemma's own (what a checkpoint and transformers hold)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.empty(0), persistent=False)

    @property
    def gain(self) -> torch.Tensor:
        return self.scale

    def refresh(self) -> None:
        weight = self.weight.detach()
        if weight.is_meta:
            # The model built on the meta device (on_meta): the shape alone. Arithmetic on
            # meta tensors runs torch's Python meta kernels, whose first call imports
            # torch._dynamo: 1.5-2.2 s of every start on a 2-vCPU AVX2 EPYC.
            self.scale = torch.empty(weight.shape, dtype=torch.float32, device="meta")
            return
        self.scale = 1.0 + weight.float()


class GemmaMLP(nn.Module):
    """GeGLU: gelu_tanh(gate) * up, on a fused gate/up projection."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if cfg.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 with activation {cfg.hidden_activation!r} is not served")
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        act = gelu_tanh_and_mul(project(self.gate_up_proj, x), batch.use_cpu_kernels)
        return project(self.down_proj, act)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.self_attn = LlamaAttention(
            cfg,
            cfg.head_dim,
            bool(cfg.attention_bias),
            scale=cfg.query_pre_attn_scalar**-0.5,
            norm=GemmaRMSNorm,
        )
        self.mlp = GemmaMLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normalised MLP output, the residual stream before it), as Llama's
        layer: each residual add happens inside the norm that reads the sum."""
        kernels = batch.use_cpu_kernels
        if residual is None:
            residual, h = x, self.input_layernorm(x, kernels)
        else:
            h, residual = self.input_layernorm.add(x, residual, kernels)
        attn = self.self_attn(h, batch, rope, self.sliding)
        h, residual = self.pre_feedforward_layernorm.add(
            self.post_attention_layernorm(attn, kernels), residual, kernels
        )
        return self.post_feedforward_layernorm(self.mlp(h, batch), kernels), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Paged-KV Gemma 3 text model; Llama's loading (fused q/k/v and gate/up, tied head) and
    logits, its own layers, embedding scale and two RoPE tables."""

    def __init__(self, cfg: Any, max_positions: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.dtype = dtype
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        sliding, self.sliding_window = sliding_layers(cfg)
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None)
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise ValueError("Gemma 3 with attention logit soft-capping is not served")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with bidirectional attention is not a causal LM")
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, flag) for flag in sliding)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._hidden_size = cfg.hidden_size
        self._rotary_args = (cfg, max_positions, dtype)
        self.init_buffers()

    def init_buffers(self) -> None:
        cfg, max_positions, dtype = self._rotary_args
        self.rotary = RotaryEmbedding(cfg, max_positions, dtype, "full_attention")
        self.local_rotary = RotaryEmbedding(cfg, max_positions, dtype, "sliding_attention")
        embedding = getattr(self.embed_tokens, "weight", None)  # None: read from the head
        if self.tie_word_embeddings and embedding is not None:
            self.lm_head.weight = embedding
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.refresh()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(batch.input_ids)
        # transformers scales by sqrt(hidden_size) rounded to the embedding's dtype
        x = x * torch.tensor(self._hidden_size**0.5, dtype=x.dtype)
        rope = self.rotary(batch.positions)
        local = self.local_rotary(batch.positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch, local if layer.sliding else rope)
        assert residual is not None
        return self.norm.add(x, residual, batch.use_cpu_kernels)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        logits = head_logits(self.lm_head, hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
