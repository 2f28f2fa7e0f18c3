"""Paged forward == transformers forward, for every architecture we load, in every batch shape.

The same token sequences are fed to our model in scheduler-like chunks (whole prefill, chunked
prefill over cached blocks, single-token decodes, all mixed in one batch) and the logits of
every position are compared with one plain transformers forward over the full sequence.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from engine.core.config import default_cache_dir
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.executor.kernels import load_cpu_kernels
from engine.executor.models import CausalLM
from engine.executor.quantization import QuantizedLinear, WeightFormat, quantize_weight
from engine.executor.runner import ModelRunner, batch_order
from engine.kvcache.block_pool import BlockPool, KVCacheSpec, num_blocks_for
from engine.loading.build import load_model_weights, pack_model
from engine.scheduler.scheduler import ScheduledSequence, SchedulerOutput

BLOCK_SIZE = 4
# vocab 320: the quantized kernel takes output sizes in tiles of 4 (the quantized head)
SMALL = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


def _llama_gqa() -> Any:
    cfg = LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


def _llama3_rope_tied() -> Any:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    cfg = LlamaConfig(
        **SMALL,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_parameters=rope,
    )
    return LlamaForCausalLM(cfg)


def _qwen2_bias() -> Any:
    cfg = Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2)
    return Qwen2ForCausalLM(cfg)


def _qwen3_qk_norm() -> Any:
    """Heads wider than hidden_size / num_heads (as Qwen3's), and per-head q/k norm weights
    that are not ones (a norm applied to the wrong heads shows)."""
    cfg = Qwen3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = Qwen3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(3)
    for name, param in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            param.data = 1 + 0.5 * torch.randn(param.shape, generator=gen)
    return model


def _smollm3_nope() -> Any:
    """SmolLM3: every second layer here (every fourth in the real one) without RoPE."""
    cfg = SmolLM3Config(
        **SMALL,
        num_attention_heads=4,
        num_key_value_heads=2,
        no_rope_layer_interval=2,
        pad_token_id=None,
    )
    assert cfg.no_rope_layers == [1, 0]
    return SmolLM3ForCausalLM(cfg)


def _gemma3_sliding() -> Any:
    """Gemma 3: a sliding-window layer (5 keys: the test's sequences outgrow it, so prefill
    spans, chunks over cached blocks and decodes all cut it) and a full one with another RoPE
    base; a score scale that is not head_dim's; norms whose weights are not zeros (Gemma's
    1 + w applied where it should not shows)."""
    cfg = Gemma3TextConfig(
        **SMALL,
        num_attention_heads=4,
        num_key_value_heads=1,  # one KV head, as the 270M's
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=None,
    )
    model = Gemma3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(3)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data = 0.5 * torch.randn(param.shape, generator=gen)
    return model


def phi3_longrope_config() -> Phi3Config:
    """Phi-4-mini's shape, small: RoPE over 3/4 of each head (12 of 16 dims: the kernel's
    8-lane loop and its tail both run), LongRoPE factors that differ per frequency, a
    pretraining length of 3, a tied head."""
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
        "long_factor": [1.5, 2.0, 3.5, 5.0, 7.5, 11.0],
        "partial_rotary_factor": 0.75,
    }
    return Phi3Config(
        **SMALL,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        original_max_position_embeddings=3,
        rope_parameters=rope,
        tie_word_embeddings=True,
        pad_token_id=None,
    )


def _phi3_longrope_partial() -> Any:
    """Phi-4-mini's shape (`phi3_longrope_config`), q/k/v and gate/up stored fused. The
    pretraining length (3) is below every sequence the test compares, so transformers takes
    the long factors as the engine does for its context."""
    return Phi3ForCausalLM(phi3_longrope_config())


def _mistral() -> Any:
    cfg = MistralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, sliding_window=None)
    return MistralForCausalLM(cfg)


def _mistral_sliding() -> Any:
    """Mistral's one window for every layer (6 keys: the sequences outgrow it)."""
    cfg = MistralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, sliding_window=6)
    return MistralForCausalLM(cfg)


def _gpt2() -> Any:
    cfg = GPT2Config(
        vocab_size=300,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


ARCHITECTURES = {
    "llama-gqa": _llama_gqa,
    "llama3-rope-tied": _llama3_rope_tied,
    "qwen2-qkv-bias": _qwen2_bias,
    "qwen3-qk-norm": _qwen3_qk_norm,
    "smollm3-nope": _smollm3_nope,
    "gemma3-sliding": _gemma3_sliding,
    "phi3-longrope-partial": _phi3_longrope_partial,
    "mistral": _mistral,
    "mistral-sliding": _mistral_sliding,
    "gpt2": _gpt2,
}


def build_model(
    hf_config: Any,
    state: dict[str, torch.Tensor],
    max_positions: int,
    dtype: torch.dtype,
    weights: WeightFormat,
) -> CausalLM:
    """The model as model_setup builds it from float weights, packed for the CPU."""
    cpu = torch.device("cpu")
    model = load_model_weights(hf_config, state, max_positions, dtype, cpu, weights)
    pack_model(model, cpu, dtype)
    return model


class PagedHarness:
    """Our model over a small pool, fed chunk by chunk; records the logits of every position."""

    def __init__(
        self,
        hf_model: Any,
        dtype: torch.dtype = torch.float32,
        *,
        weights: WeightFormat | None = None,
        use_cpu_kernels: bool = False,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        state = {k: v.clone() for k, v in hf_model.state_dict().items()}  # build_model takes them
        weights = weights or WeightFormat()
        if weights.is_quantized and not weights.dense_copies:  # linears on the kernel
            assert load_cpu_kernels(default_cache_dir())
        self.model = build_model(hf_model.config, state, 256, dtype, weights)
        layers = self.model.attention_layers()
        spec = KVCacheSpec(
            len(layers), self.model.num_kv_heads, self.model.head_dim, BLOCK_SIZE, kv_dtype or dtype
        )
        self.pool = BlockPool(spec, 128)
        self.runner = ModelRunner(self.model, self.pool, torch.device("cpu"), use_cpu_kernels)
        self.logits: dict[str, list[torch.Tensor]] = {}

    def add(self, request_id: str, token_ids: list[int]) -> Sequence:
        seq = Sequence(request_id, list(token_ids), len(token_ids), SamplingParams(), 0)
        self.logits[request_id] = []
        return seq

    def run(self, chunks: list[tuple[Sequence, int]]) -> None:
        for seq, n in chunks:
            needed = num_blocks_for(seq.num_computed_tokens + n, BLOCK_SIZE)
            seq.block_table += self.pool.allocate(needed - len(seq.block_table))
        ordered = batch_order(SchedulerOutput([ScheduledSequence(s, n) for s, n in chunks]))
        self.runner.kv_cache.zero_fresh(self.pool.num_touched)  # as ModelRunner.execute does
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(self.runner.build_batch(ordered)))
        row = 0
        for item in ordered:
            self.logits[item.seq.request_id].append(logits[row : row + item.num_new_tokens])
            row += item.num_new_tokens
            item.seq.num_computed_tokens += item.num_new_tokens

    def all_logits(self, seq: Sequence) -> torch.Tensor:
        return torch.cat(self.logits[seq.request_id]).float()


def _reference_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("use_cpu_kernels", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_paged_forward_matches_transformers_in_mixed_batches(
    arch: str, use_cpu_kernels: bool
) -> None:
    if use_cpu_kernels:
        assert load_cpu_kernels(default_cache_dir())
    torch.manual_seed(0)
    hf = ARCHITECTURES[arch]().eval()
    harness = PagedHarness(hf, use_cpu_kernels=use_cpu_kernels)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (7, 13, 1, 21)]
    seqs = [harness.add(str(i), p) for i, p in enumerate(prompts)]
    a, b, c, d = seqs
    # Step 1: a whole, b's first chunk, c is a 1-token prompt (decode path), d's first chunk.
    harness.run([(a, 7), (b, 5), (c, 1), (d, 8)])
    # Step 2: b and d continue over their cached blocks (chunks not block-aligned).
    harness.run([(b, 8), (d, 13)])
    for _ in range(3):  # decodes of different lengths in one batch, plus a 2-token chunk
        for seq in seqs:
            seq.token_ids.append(int(torch.randint(0, 300, (), generator=gen)))
        d.token_ids.append(int(torch.randint(0, 300, (), generator=gen)))
        harness.run([(a, 1), (b, 1), (c, 1), (d, 2)])
    for seq in seqs:
        expected = _reference_logits(hf, seq.token_ids)
        torch.testing.assert_close(harness.all_logits(seq), expected, rtol=1e-4, atol=1e-4)


def test_bfloat16_forward_tracks_float32() -> None:
    torch.manual_seed(0)
    hf = _llama_gqa().eval()
    harness = PagedHarness(hf, torch.bfloat16)
    seq = harness.add("x", torch.randint(0, 300, (19,)).tolist())
    harness.run([(seq, 11)])
    harness.run([(seq, 8)])
    expected = _reference_logits(hf, seq.token_ids)
    got = harness.all_logits(seq)
    assert harness.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("arch", ["llama-gqa", "gemma3-sliding"])
def test_bf16_compute_gives_float32_logits_from_the_quantized_head(arch: str) -> None:
    """The head's logits are float32 in every compute dtype: on the kernel its unrounded sums
    (rounded to bf16 they stepped by 0.06-0.125 at common magnitudes, and a reported logprob
    with them), on a dense bf16 head its product widened."""
    torch.manual_seed(0)
    hf = ARCHITECTURES[arch]().eval()
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 300, (20,), generator=gen).tolist()
    kernel = WeightFormat(layers="int4", head="int8", dense_copies=False)
    for weights, on_grid in ((kernel, False), (WeightFormat(), True)):
        harness = PagedHarness(hf, torch.bfloat16, weights=weights)
        harness.run([(harness.add("x", prompt), len(prompt))])
        logits = torch.cat(harness.logits["x"])
        assert logits.dtype == torch.float32, weights
        assert torch.equal(logits, logits.to(torch.bfloat16).float()) == on_grid, weights


def test_weights_that_do_not_fit_are_rejected() -> None:
    hf = _llama_gqa()
    state = hf.state_dict()
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        build_model(hf.config, state, 64, torch.float32, WeightFormat())


@pytest.mark.parametrize("use_cpu_kernels", [False, True], ids=["torch", "kernel"])
def test_float16_kv_cache_tracks_float32(use_cpu_kernels: bool) -> None:
    """K/V stored in float16, widened as attention reads them: the logits of a chunked
    prefill and decodes stay within float16's rounding of the float32 model's."""
    if use_cpu_kernels:
        assert load_cpu_kernels(default_cache_dir())
    torch.manual_seed(0)
    hf = _llama_gqa().eval()
    harness = PagedHarness(hf, use_cpu_kernels=use_cpu_kernels, kv_dtype=torch.float16)
    assert harness.runner.kv_cache.k_cache.dtype == torch.float16
    seq = harness.add("x", torch.randint(0, 300, (19,)).tolist())
    harness.run([(seq, 11)])
    harness.run([(seq, 8)])
    for token in (5, 77):
        seq.token_ids.append(token)
        harness.run([(seq, 1)])
    expected = _reference_logits(hf, seq.token_ids)
    torch.testing.assert_close(harness.all_logits(seq), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "arch",
    [
        "llama-gqa",
        "llama3-rope-tied",
        "qwen2-qkv-bias",
        "qwen3-qk-norm",
        "smollm3-nope",
        "gemma3-sliding",
        "phi3-longrope-partial",
    ],
)
def test_quantized_model_matches_transformers_on_the_dequantized_weights(
    arch: str, dtype: torch.dtype
) -> None:
    """int4 layers and an int8 head on the quantized kernel, prefill rows and decode rows
    alike: the model whose weights are the quantized ones."""
    torch.manual_seed(0)
    hf = ARCHITECTURES[arch]().eval()
    weights = WeightFormat(layers="int4", head="int8", dense_copies=False)
    harness = PagedHarness(hf, dtype, weights=weights)
    quantized = [m for m in harness.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the head
    assert all(m.dense is None for m in quantized)
    # The reference: transformers on the weights the codes stand for. A new Parameter per
    # linear unties a tied head: the embedding keeps its float weights, as ours does.
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear):
            bits = 8 if name == "lm_head" else 4
            weight = quantize_weight(module.weight.detach(), bits)[1]
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
    gen = torch.Generator().manual_seed(1)
    seq = harness.add("x", torch.randint(0, 300, (40,), generator=gen).tolist())
    harness.run([(seq, 40)])
    for _ in range(4):
        seq.token_ids.append(int(torch.randint(0, 300, (), generator=gen)))
        harness.run([(seq, 1)])
    expected = _reference_logits(hf, seq.token_ids)
    # The kernel rounds activations to 8 bits per group: ~1% agreement even in float32.
    tol = 0.03 if dtype == torch.float32 else 0.06
    torch.testing.assert_close(harness.all_logits(seq), expected, rtol=tol, atol=tol)
