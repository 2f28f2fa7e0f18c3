"""ModelRunner: turns a SchedulerOutput into one forward pass and one sampling call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.core.outputs import SampleLogprobs
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.executor.attention import (
    DecodeGroup,
    ForwardBatch,
    KernelPlan,
    PrefillSpan,
    TorchAttention,
    decode_mask,
    prefill_mask,
)
from engine.executor.input_batch import InputBatch
from engine.executor.kv_cache import KVCache
from engine.executor.models import CausalLM
from engine.executor.penalty_counts import PenaltyCounts
from engine.executor.sampler import (
    Sampler,
    SamplingBatch,
    add_logit_bias,
    sampling_probabilities,
    score_tokens,
    token_logprobs,
)
from engine.kvcache.block_pool import BlockPool
from engine.scheduler.scheduler import ScheduledSequence, SchedulerOutput
from engine.structured.grammar import GrammarMasker

if TYPE_CHECKING:
    from llguidance import LLMatcher


@dataclass(slots=True)
class SampledToken:
    """A sequence's new token, after the draft tokens the forward verified and kept
    (`accepted`, of `num_drafted`): `token_id` is the model's own token after them."""

    seq: Sequence
    token_id: int
    logprobs: SampleLogprobs | None
    accepted: list[int] = field(default_factory=list)
    num_drafted: int = 0
    # with params.logprobs: each accepted token's, from its own position's row
    accepted_logprobs: list[SampleLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    sampled: list[SampledToken]
    # sequences that filled a registry prefix, with their last-position logits [vocab_size]
    prefilled: list[tuple[Sequence, torch.Tensor]]


class ModelRunner:
    """Owns the model and the KV cache's tensors (bound to its attention layers), which the
    pool's block ids index."""

    def __init__(
        self, model: CausalLM, pool: BlockPool, device: torch.device, use_cpu_kernels: bool
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.use_cpu_kernels = use_cpu_kernels
        self.compute_dtype = model.dtype
        self.sampler = Sampler(use_cpu_kernels)
        self.masker: GrammarMasker | None = None  # made when a constrained row first comes
        self.num_forward_calls = 0
        self.num_forward_tokens = 0
        self.kv_cache = KVCache(pool.spec, pool.num_blocks, device)
        self.input_batch = InputBatch()
        self.penalty_counts = PenaltyCounts()
        for i, layer in enumerate(model.attention_layers()):
            layer.k_cache, layer.v_cache = self.kv_cache.layer_caches(i)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run the scheduled chunks; sample one token per sequence that reached its end."""
        if out.released_ids:
            self.input_batch.release(out.released_ids)
            self.penalty_counts.release(out.released_ids)
        if self.pool.num_touched > self.kv_cache.num_zeroed:  # before any copy lands in them
            self.kv_cache.zero_fresh(self.pool.num_touched)
        self._copy_blocks(out, after_forward=False)
        ordered = batch_order(out)
        sampling = [item for item in ordered if item.is_sampling]
        logits, draft_logits = self._logits_rows(ordered, sampling)  # [len(sampling), vocab]
        self._copy_blocks(out, after_forward=True)
        fills = [(i, item.seq) for i, item in enumerate(sampling) if item.seq.is_prompt_only]
        prefilled = [(seq, logits[i].clone()) for i, seq in fills]
        if fills:
            keep = [i for i, item in enumerate(sampling) if not item.seq.is_prompt_only]
            logits = logits[keep]
            sampling = [sampling[i] for i in keep]
        if not sampling:
            return StepResult([], prefilled)
        seqs = [item.seq for item in sampling]
        if any(seq.params.logit_bias for seq in seqs):
            logits = add_logit_bias(logits, [seq.params for seq in seqs])
            if draft_logits is not None:  # each drafted position's row as one step biases it
                draft_logits = add_logit_bias(
                    draft_logits,
                    [item.seq.params for item in sampling for _ in range(item.num_draft_tokens)],
                )
        # with a grammar: each item's matcher at each drafted position and after the last
        # draft (`_grammar_chain`), whose mask the sampled row gets
        chains = (
            [_grammar_chain(item) for item in sampling]
            if any(seq.matcher is not None for seq in seqs)
            else None
        )
        if chains is not None:
            self._masker(logits.shape[1]).apply(logits, [chain[-1] for chain in chains])
        penalized = [seq for seq in seqs if seq.params.has_penalties]
        counts = (
            self.penalty_counts.counts(penalized, logits.shape[1], logits.device)
            if penalized
            else None
        )
        batch = SamplingBatch([s.params for s in seqs], [s.generator for s in seqs], counts)
        result = self.sampler(logits, batch)
        sampled = [
            SampledToken(seq, tok, lp)
            for seq, tok, lp in zip(seqs, result.token_ids, result.logprobs, strict=True)
        ]
        if draft_logits is not None:
            if chains is not None:
                rows = [m for item, chain in zip(sampling, chains, strict=True)
                        for m in chain[: item.num_draft_tokens]]  # fmt: skip
                self._masker(draft_logits.shape[1]).apply(draft_logits, rows)
            self._verify(sampling, sampled, draft_logits)
        return StepResult(sampled, prefilled)

    def _verify(
        self,
        sampling: list[ScheduledSequence],
        sampled: list[SampledToken],
        draft_logits: torch.Tensor,
    ) -> None:
        """Keep each sequence's draft tokens up to the first the model rejects, which gives
        way to the model's own token; if none is rejected, the last row's token comes after
        them. `draft_logits` holds the rows of every drafted position, in batch order.

        Greedy: a draft is kept while it is the argmax at its position. Sampled (no seed):
        the rule for a deterministic draft, so every token is drawn from the distribution
        one step a token draws it from: keep draft d with probability p(d); on a rejection
        draw from p with d taken out (renormalised)."""
        targets: list[int] = self.sampler.argmax(draft_logits).tolist()
        offset = 0
        for item, token in zip(sampling, sampled, strict=True):
            k = item.num_draft_tokens
            if not k:
                continue
            rows, drafts = slice(offset, offset + k), item.seq.draft_token_ids[:k]
            offset += k
            params = item.seq.params
            if params.is_greedy:
                wanted = targets[rows]
                j = 0
                while j < k and wanted[j] == drafts[j]:
                    j += 1
                if j < k:
                    token.token_id = wanted[j]
            else:
                j, replacement = _sample_verify(draft_logits[rows], drafts, params)
                if replacement is not None:
                    token.token_id = replacement
            token.accepted, token.num_drafted = drafts[:j], k
            if params.logprobs is not None:
                # the kept drafts' rows, and the row of the token that replaced a rejected
                # one (else the last row's, which the sampler reported)
                scored = drafts[:j] + ([token.token_id] if j < k else [])
                logprobs = token_logprobs(draft_logits[rows][: len(scored)], scored, params)
                token.accepted_logprobs = logprobs[:j]
                if j < k:
                    token.logprobs = logprobs[j]

    def _copy_blocks(self, out: SchedulerOutput, after_forward: bool) -> None:
        for copy in out.copies:
            if copy.after_forward == after_forward:
                self.kv_cache.copy_block(copy.src, copy.dst)

    def _masker(self, vocab_size: int) -> GrammarMasker:
        if self.masker is None:
            self.masker = GrammarMasker(vocab_size, parallel=self.device.type == "cuda")
        return self.masker

    def _logits_rows(
        self, ordered: list[ScheduledSequence], sampling: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One logits row per sampling item: from this forward, a leader's row, or the
        registry's stored row (exact hits need no forward at all); and the rows of the draft
        tokens' positions, to verify them (None when no item carries drafts)."""
        computed = [item for item in ordered if item.num_new_tokens > 0]
        forward_logits = draft_logits = None
        if computed:
            batch = self.build_batch(computed)
            hidden = self.model(batch)  # [num_tokens, hidden]
            self._score_prompts(computed, hidden)
            rows = batch.logits_indices
            verified = _verified_rows(computed)
            if verified:  # one head call for both: its rows do not depend on each other
                rows = torch.cat([rows, self._tensor(verified)])
            forward_logits = self.model.compute_logits(hidden[rows])
            if verified:
                num_sampling = len(batch.logits_indices)
                draft_logits = forward_logits[num_sampling:]
                forward_logits = forward_logits[:num_sampling]
            self.num_forward_calls += 1
            self.num_forward_tokens += len(batch.input_ids)
        if all(item.num_new_tokens > 0 for item in sampling):
            assert forward_logits is not None or not sampling
            logits = forward_logits if forward_logits is not None else torch.empty(0)
            return logits, draft_logits
        row_of = {id(item.seq): i for i, item in enumerate(x for x in computed if x.is_sampling)}
        rows_out = []
        for item in sampling:
            if item.cached_logits is not None:
                rows_out.append(item.cached_logits)
            else:
                assert forward_logits is not None
                source = item.leader if item.leader is not None else item.seq
                rows_out.append(forward_logits[row_of[id(source)]])
        return torch.stack(rows_out), draft_logits  # [len(sampling), vocab]

    def _score_prompts(self, computed: list[ScheduledSequence], hidden: torch.Tensor) -> None:
        """Prompt logprobs of the sequences that asked for them: position p's logits score
        prompt token p + 1. Recorded once per token (a recomputed chunk adds nothing)."""
        token_start = 0
        for item in computed:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            if seq.params.prompt_logprobs is not None:
                if not seq.prompt_logprobs:
                    seq.prompt_logprobs.append(None)  # the first token has no context
                first = len(seq.prompt_logprobs) - 1  # the position scoring the next new token
                last = min(start + n, seq.num_prompt_tokens - 1)
                if first < last:
                    rows = hidden[token_start + first - start : token_start + last - start]
                    targets = seq.token_ids[first + 1 : last + 1]
                    seq.prompt_logprobs += score_tokens(
                        self.model.compute_logits(rows),
                        targets,
                        seq.params.prompt_logprobs,
                    )
            token_start += n

    def build_batch(self, ordered: list[ScheduledSequence]) -> ForwardBatch:
        """Flatten the step's chunks (in `batch_order`) into the tensors the model reads.
        Every sequence's block table comes from its row of the input batch."""
        block_size = self.pool.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        for item in ordered:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            if item.num_draft_tokens:  # its own tokens, then the drafts to verify
                input_ids.extend(seq.token_ids[start:] + seq.draft_token_ids)
            else:
                input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            # One slot per token, from the list: on CPU at these batch sizes a Python list
            # and one tensor beat a vectorized gather (5-11 vs 31-37 us a step, batch 1-32).
            slots.extend(
                table[p // block_size] * block_size + p % block_size
                for p in range(start, start + n)
            )
            if item.is_sampling:
                logits_indices.append(len(input_ids) - 1)
        rows = self.input_batch.rows([item.seq for item in ordered])
        position_tensor = self._tensor(positions)
        seq_rows = (  # each query's row of the block table: what the kernel's plans read
            self._tensor(
                [
                    row
                    for item, row in zip(ordered, rows, strict=True)
                    for _ in range(item.num_new_tokens)
                ]
            )
            if self.use_cpu_kernels
            else None
        )

        def view(window: int) -> KernelPlan | TorchAttention:
            if seq_rows is None:
                return self._torch_attention(ordered, rows, window)
            return KernelPlan.build(
                self.input_batch.block_tables, seq_rows, position_tensor, block_size, window
            )

        window = self.model.sliding_window
        return ForwardBatch(
            input_ids=self._tensor(input_ids),
            positions=position_tensor,
            slot_mapping=self._tensor(slots),
            logits_indices=self._tensor(logits_indices),
            attention=view(0),
            windowed=view(window) if window else None,
        )

    def _torch_attention(
        self, ordered: list[ScheduledSequence], rows: list[int], window: int
    ) -> TorchAttention:
        """Prefill spans, then the decodes in groups (see engine/executor/attention.py); with
        a window, every mask keeps each query's last `window` keys."""
        spans, token_start = [], 0
        num_prefills = sum(1 for item in ordered if item.num_new_tokens > 1)
        for item in ordered[:num_prefills]:
            spans.append(self._span(item.seq, token_start, item.num_new_tokens, window))
            token_start += item.num_new_tokens
        decodes = [item.seq for item in ordered[num_prefills:]]
        row_ids = torch.tensor(rows[num_prefills:])
        groups = self._decode_groups(decodes, row_ids, window) if decodes else []
        return TorchAttention(spans, token_start, groups)

    def _span(self, seq: Sequence, token_start: int, n: int, window: int) -> PrefillSpan:
        num_cached = seq.num_computed_tokens
        num_blocks = -(-(num_cached + n) // self.pool.block_size)
        group = self.model.num_heads // self.model.num_kv_heads
        dtype = self.compute_dtype
        masked = num_cached > 0 or 0 < window < n  # else plain causal
        mask = prefill_mask(num_cached, n, group, dtype, self.device, window) if masked else None
        return PrefillSpan(
            token_start=token_start,
            num_new_tokens=n,
            num_cached=num_cached,
            block_ids=self._tensor(seq.block_table[:num_blocks]),
            mask=mask,
        )

    def _decode_groups(
        self, seqs: list[Sequence], row_ids: torch.Tensor, window: int
    ) -> list[DecodeGroup]:
        """(Torch path.) Decodes sharing a registry prefix's blocks form a cascade group (2+
        members); everything else is one plain group. `row_ids`: each decode's input-batch
        row. With a window, one plain group: a shared prefix may lie outside it."""
        if window:
            return [self._group(seqs, row_ids, list(range(len(seqs))), 0, window)]
        by_prefix: dict[tuple[int, ...], list[int]] = {}
        for row, seq in enumerate(seqs):
            key = tuple(seq.block_table[: seq.num_shared_blocks])
            by_prefix.setdefault(key, []).append(row)
        plain = by_prefix.pop((), [])
        for key in [k for k, rows in by_prefix.items() if len(rows) == 1]:
            plain += by_prefix.pop(key)
        groups = [self._group(seqs, row_ids, sorted(plain), 0, 0)] if plain else []
        groups += [self._group(seqs, row_ids, rows, len(key), 0) for key, rows in by_prefix.items()]
        return groups

    def _group(
        self,
        seqs: list[Sequence],
        row_ids: torch.Tensor,
        rows: list[int],
        num_shared: int,
        window: int,
    ) -> DecodeGroup:
        block_size = self.pool.block_size
        lens = [seqs[r].num_computed_tokens + 1 - num_shared * block_size for r in rows]
        max_blocks = -(-max(lens) // block_size)
        # Each row's blocks after the shared prefix, then whatever its row holds past them:
        # key slots beyond a row's context length are masked out (or never read).
        columns = slice(num_shared, num_shared + max_blocks)
        group_rows = row_ids if len(rows) == len(seqs) else row_ids[rows]
        tables = self.input_batch.block_tables[group_rows, columns]
        context_lens = self._tensor(lens)
        return DecodeGroup(
            rows=self._tensor(rows),
            prefix_blocks=self._prefix_blocks(seqs[rows[0]].block_table[:num_shared]),
            block_tables=tables.to(self.device),  # [G, max_blocks]
            context_lens=context_lens,
            mask=decode_mask(context_lens, max_blocks * block_size, self.compute_dtype, window),
        )

    def _prefix_blocks(self, block_ids: list[int]) -> slice | torch.Tensor | None:
        """A slice when the blocks are consecutive (attention reads them in place)."""
        if not block_ids:
            return None
        first = block_ids[0]
        if block_ids == list(range(first, first + len(block_ids))):
            return slice(first, first + len(block_ids))
        return self._tensor(block_ids)

    def _tensor(self, data: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)


def _sample_verify(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams
) -> tuple[int, int | None]:
    """(drafts kept, the token drawn in place of the first rejected one or None)."""
    probs = sampling_probabilities(logits, params)  # [k, vocab]
    index = torch.arange(len(drafts), device=probs.device)
    chance = probs[index, torch.tensor(drafts, device=probs.device)]
    kept = (torch.rand(len(drafts), device=probs.device) < chance).tolist()
    j = 0
    while j < len(drafts) and kept[j]:
        j += 1
    if j == len(drafts):
        return j, None
    residual = probs[j].clone()
    residual[drafts[j]] = 0.0  # p(d) < 1 here, so something else is left
    return j, int(torch.multinomial(residual, 1))


def _grammar_chain(item: ScheduledSequence) -> list[LLMatcher | None]:
    """The sequence's grammar state before each of its drafts and after the last: its own
    matcher, then copies advanced one draft at a time (the drafter proposed only drafts the
    grammar allows). Each drafted position's row is masked as one step a token would mask
    it. [None] * (k + 1) without a grammar."""
    seq, k = item.seq, item.num_draft_tokens
    if seq.matcher is None:
        return [None] * (k + 1)
    chain: list[LLMatcher | None] = [seq.matcher]
    for token_id in seq.draft_token_ids[:k]:
        advanced = chain[-1].deep_copy()  # type: ignore[union-attr]
        if not advanced.consume_token(token_id):
            raise RuntimeError(f"the grammar refused draft token {token_id}")
        chain.append(advanced)
    return chain


def _verified_rows(computed: list[ScheduledSequence]) -> list[int]:
    """Flat indices of the positions whose logits verify draft tokens: for an item with k
    drafts, its last k + 1 positions but the last (whose row is the sampling row)."""
    rows: list[int] = []
    end = 0
    for item in computed:
        end += item.num_new_tokens
        k = item.num_draft_tokens
        rows.extend(range(end - 1 - k, end - 1))
    return rows


def batch_order(out: SchedulerOutput) -> list[ScheduledSequence]:
    """Prefill spans (2+ new tokens), then one-token decodes (what attention expects), then
    the sequences that need no forward (exact prefix hits, in-step duplicates)."""
    by_kind: tuple[list[ScheduledSequence], ...] = ([], [], [])
    for item in out.scheduled:
        by_kind[0 if item.num_new_tokens > 1 else 1 if item.num_new_tokens == 1 else 2].append(item)
    return [*by_kind[0], *by_kind[1], *by_kind[2]]
