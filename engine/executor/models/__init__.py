"""Model classes by Hugging Face `model_type`, and what the runner needs of a model.

Building one from weights is `engine.loading.build`'s job."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.executor.attention import ForwardBatch
from engine.executor.models.gemma3 import Gemma3ForCausalLM
from engine.executor.models.gpt2 import GPT2LMHeadModel
from engine.executor.models.llama import LlamaForCausalLM


class AttentionLayer(Protocol):
    k_cache: torch.Tensor
    v_cache: torch.Tensor


class CausalLM(Protocol):
    """What the runner needs from a model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int  # keys a sliding-window layer sees; 0: the model has none
    dtype: torch.dtype  # compute dtype

    def __call__(self, batch: ForwardBatch) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # float32 [rows, vocab]
    def attention_layers(self) -> list[Any]: ...
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...
    def init_buffers(self) -> None: ...


MODEL_CLASSES: dict[str, type[Any]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "smollm3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
}
SUPPORTED_MODEL_TYPES = frozenset(MODEL_CLASSES)
