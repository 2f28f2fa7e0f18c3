"""The one place that builds a model: from float weights, from a quantized state, or from a
GGUF's quantized blocks; then packs it for its device."""

from __future__ import annotations

from typing import Any

import torch

from engine.core.memory import HugePageArena, huge_pages_available, return_freed_memory
from engine.executor.models import MODEL_CLASSES, CausalLM
from engine.executor.models.layers import can_pack_linears, pack_linears
from engine.executor.quantization import (
    HeadRowsEmbedding,
    QuantizedLinear,
    WeightFormat,
    kernel_linears,
    move_kernel_weights,
    quantize_linears,
    relink_dense_biases,
    restore_linears,
)
from engine.loading.gguf import GGUFWeights, blocks_quantized_state


def load_model_weights(
    hf_config: Any,
    state_dict: dict[str, torch.Tensor],
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    weights: WeightFormat,
) -> CausalLM:
    """Instantiate the model for `hf_config.model_type`, load weights (consuming
    `state_dict`), quantize them as `weights` says (from the float weights, before any cast),
    cast, move, eval. `pack_model` then readies it to serve on its device.

    Built on the meta device so no time goes into a random init that the weights overwrite.
    """
    model = on_meta(hf_config, max_positions, dtype)
    model.load_weights(state_dict)
    state_dict.clear()  # the model holds the tensors now; drop the caller's references
    model.init_buffers()
    if weights.is_quantized:
        quantize_linears(model, weights, dtype)
        kernel_weights_on_huge_pages(model)
    return _ready(model, device, dtype)


def restore_quantized_model(
    hf_config: Any,
    state: dict[str, torch.Tensor],
    max_positions: int,
    dtype: torch.dtype,
    weights: WeightFormat,
) -> CausalLM:
    """The model `load_model_weights` built, from its `quantized_state` (consumed): no float
    weights read, nothing quantized again. A tied model whose state holds no embedding reads
    it from the quantized head's rows (`HeadRowsEmbedding`: a GGUF's own blocks)."""
    model = on_meta(hf_config, max_positions, dtype)
    restore_linears(model, state, weights)
    tied = {"lm_head.weight"} if getattr(model, "tie_word_embeddings", False) else set()
    if tied and "embed_tokens.weight" not in state and isinstance(model.lm_head, QuantizedLinear):
        head = model.lm_head
        model.embed_tokens = HeadRowsEmbedding(head.quantized, dtype, head.dense is None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    state.clear()
    if set(missing) - tied or unexpected:
        raise ValueError(f"quantized state does not fit: {missing}, {unexpected}")
    relink_dense_biases(model)
    model.init_buffers()
    return _ready(model, torch.device("cpu"), dtype)


def load_gguf_quantized(
    hf_config: Any,
    gguf: GGUFWeights,
    max_positions: int,
    dtype: torch.dtype,
    weights: WeightFormat,
) -> CausalLM:
    """The model `load_model_weights` would build from the file's dequantized floats, from
    its quantized blocks directly (see engine/gguf_weights.py)."""
    state = blocks_quantized_state(on_meta(hf_config, max_positions, dtype), gguf, weights, dtype)
    model = restore_quantized_model(hf_config, state, max_positions, dtype, weights)
    return_freed_memory()  # the build's temporaries, before packing allocates again
    kernel_weights_on_huge_pages(model)
    return model


def pack_model(model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
    """On CPU, pack the dense linear weights for oneDNN (see `PackedLinear`)."""
    if can_pack_linears(device, dtype):
        assert isinstance(model, torch.nn.Module)
        pack_linears(model)


def kernel_weights_on_huge_pages(model: CausalLM) -> None:
    """The weights the quantized kernel streams, moved into one `HugePageArena` where the
    kernel grants transparent huge pages (a cached state is read into one instead)."""
    tensors = kernel_weights(model)
    if not tensors or not huge_pages_available():
        return
    arena = HugePageArena(sum(HugePageArena.span(t.nbytes) for t in tensors))
    del tensors
    assert isinstance(model, torch.nn.Module)
    placed_since_trim = 0

    def place(tensor: torch.Tensor) -> torch.Tensor:
        """The copy; every 64 MB, the originals of the linears moved so far handed back to
        the OS (the heap keeps them, and the first start's peak was the whole model twice)."""
        nonlocal placed_since_trim
        if placed_since_trim > 64 << 20:
            return_freed_memory()
            placed_since_trim = 0
        placed_since_trim += tensor.nbytes
        return arena.place(tensor)

    move_kernel_weights(model, place)
    return_freed_memory()  # the last originals


def kernel_weights(model: CausalLM) -> list[torch.Tensor]:
    """The tensors of the quantized linears on the kernel: what a decode step streams."""
    assert isinstance(model, torch.nn.Module)
    return [t for linear in kernel_linears(model) for part in linear.parts for t in part.tensors()]


def on_meta(hf_config: Any, max_positions: int, dtype: torch.dtype) -> Any:
    """The model built on the meta device: its shape and attributes, no weights in memory."""
    cls = MODEL_CLASSES[hf_config.model_type]
    with torch.device("meta"):
        return cls(hf_config, max_positions, dtype)


def _ready(model: Any, device: torch.device, dtype: torch.dtype) -> CausalLM:
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    result: CausalLM = model
    return result
