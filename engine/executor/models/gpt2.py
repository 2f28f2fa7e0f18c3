"""GPT-2 over the paged KV cache (learned positions, LayerNorm, GELU-tanh MLP, tied head)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.executor.attention import ForwardBatch, paged_attention, store_kv
from engine.executor.models.layers import embedding, load_exact
from engine.executor.quantization import project


class GPT2Attention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.num_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.scale = self.head_dim**-0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        n, hidden = x.shape
        qkv = project(self.c_attn, x)
        q, k, v = qkv.view(n, 3, self.num_heads, self.head_dim).unbind(1)
        store_kv(k, v, self.k_cache, self.v_cache, batch.slot_mapping)
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, batch, self.scale)
        return project(self.c_proj, o.reshape(n, hidden))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.c_fc = nn.Linear(cfg.n_embd, inner)
        self.c_proj = nn.Linear(inner, cfg.n_embd)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = F.gelu(project(self.c_fc, x), approximate="tanh")
        return project(self.c_proj, hidden)


class GPT2Block(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), batch)
        return x + self.mlp(self.ln_2(x), batch)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: Any, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype  # compute dtype (the KV cache may store another)
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx is not supported")
        self.num_heads = cfg.n_head
        self.num_kv_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.sliding_window = 0  # keys a sliding-window layer sees (none here)
        self.wte = embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def init_buffers(self) -> None:
        """Nothing beyond the weights: the head reads `wte` directly."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.wte(batch.input_ids) + self.wpe(batch.positions)
        for block in self.h:
            x = block(x, batch)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        return (hidden @ self.wte.weight.T).float()

    def attention_layers(self) -> list[GPT2Attention]:
        return [m for m in self.modules() if isinstance(m, GPT2Attention)]

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face GPT-2 state dict; its Conv1D weights are [in, out]: transpose."""
        sd: dict[str, torch.Tensor] = {}
        for name, tensor in state_dict.items():
            name = name.removeprefix("transformer.")
            if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # tied head; causal-mask buffers of old checkpoints
            is_conv1d = name.endswith(".weight") and (".c_" in name)
            sd[name] = tensor.t().contiguous() if is_conv1d else tensor
        load_exact(self, sd, set())
