"""ModelRunner: turns a SchedulerOutput into one forward pass and one sampling call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import ForwardBatch, PrefillSpan, decode_mask, prefill_mask
from engine.kv_cache import BlockPool
from engine.models import CausalLM
from engine.outputs import SampleLogprobs
from engine.sampler import Sampler, SamplingBatch
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence


@dataclass(slots=True)
class SampledToken:
    seq: Sequence
    token_id: int
    logprobs: SampleLogprobs | None


class ModelRunner:
    """Owns the model and binds the pool's per-layer K/V tensors to its attention layers."""

    def __init__(self, model: CausalLM, pool: BlockPool, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.sampler = Sampler()
        self.num_forward_calls = 0
        for i, layer in enumerate(model.attention_layers()):
            layer.k_cache, layer.v_cache = pool.layer_caches(i)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        """Run the scheduled chunks; return one sampled token per sequence that reached its end."""
        ordered = batch_order(out)
        batch = self.build_batch(ordered)
        hidden = self.model(batch)  # [num_tokens, hidden]
        self.num_forward_calls += 1
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [num_sampled, vocab]
        sampling = [s.seq for s in ordered if s.is_sampling]
        if not sampling:
            return []
        result = self.sampler(logits, _sampling_batch(sampling))
        return [
            SampledToken(seq, tok, lp)
            for seq, tok, lp in zip(sampling, result.token_ids, result.logprobs, strict=True)
        ]

    def build_batch(self, ordered: list[ScheduledSequence]) -> ForwardBatch:
        """Flatten the step's chunks (in `batch_order`) into the tensors the model reads."""
        prefills = [s for s in ordered if s.num_new_tokens > 1]
        decodes = ordered[len(prefills) :]
        block_size = self.pool.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        spans: list[PrefillSpan] = []
        for item in ordered:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            token_start = len(input_ids)
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(
                table[p // block_size] * block_size + p % block_size
                for p in range(start, start + n)
            )
            if item.is_sampling:
                logits_indices.append(token_start + n - 1)
            if n > 1:
                spans.append(self._span(seq, token_start, n))
        num_prefill_tokens = sum(s.num_new_tokens for s in prefills)
        tables, mask = self._decode_tables(decodes)
        return ForwardBatch(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            slot_mapping=self._tensor(slots),
            prefills=spans,
            num_prefill_tokens=num_prefill_tokens,
            decode_block_tables=tables,
            decode_mask=mask,
            logits_indices=self._tensor(logits_indices),
        )

    def _span(self, seq: Sequence, token_start: int, n: int) -> PrefillSpan:
        num_cached = seq.num_computed_tokens
        num_blocks = -(-(num_cached + n) // self.pool.block_size)
        mask = prefill_mask(num_cached, n, self.device) if num_cached else None
        return PrefillSpan(
            token_start=token_start,
            num_new_tokens=n,
            num_cached=num_cached,
            block_ids=self._tensor(seq.block_table[:num_blocks]),
            mask=mask,
        )

    def _decode_tables(
        self, decodes: list[ScheduledSequence]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not decodes:
            return None, None
        block_size = self.pool.block_size
        lens = [d.seq.num_computed_tokens + 1 for d in decodes]
        max_blocks = -(-max(lens) // block_size)
        # Pad with block 0: padded key slots are masked out, whatever they hold.
        rows = [
            d.seq.block_table[:max_blocks]
            + [0] * (max_blocks - len(d.seq.block_table[:max_blocks]))
            for d in decodes
        ]
        tables = self._tensor(rows)  # [num_decodes, max_blocks]
        mask = decode_mask(self._tensor(lens), max_blocks * block_size)
        return tables, mask

    def _tensor(self, data: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)


def batch_order(out: SchedulerOutput) -> list[ScheduledSequence]:
    """Prefill spans (2+ new tokens) first, then one-token decodes: what attention expects."""
    prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
    return prefills + [s for s in out.scheduled if s.num_new_tokens == 1]


def _sampling_batch(seqs: list[Sequence]) -> SamplingBatch:
    needs_history = [s.params.has_penalties for s in seqs]
    return SamplingBatch(
        params=[s.params for s in seqs],
        generators=[s.generator for s in seqs],
        prompt_token_ids=[
            s.prompt_token_ids if h else [] for s, h in zip(seqs, needs_history, strict=True)
        ],
        output_token_ids=[
            s.output_token_ids if h else [] for s, h in zip(seqs, needs_history, strict=True)
        ],
    )
