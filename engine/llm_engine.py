"""LLMEngine: the synchronous step API over the cache, scheduler and runner.

Not thread-safe: exactly one thread (the AsyncEngine's loop, a test, a benchmark) drives it.
`step_tokens()` is the engine's own work: one forward, one token per running request, the
finishes a token decides. Text is the caller's (`engine.text.detokenizer.RequestText`): `step()`
adds it for synchronous callers; the AsyncEngine makes it on its event loop instead, so no
request's detokenizing or stop strings sit between two forward passes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from llguidance import LLMatcher
from tqdm import tqdm

from engine.core.config import EngineConfig
from engine.core.errors import EngineError, InvalidRequestError
from engine.core.outputs import RequestOutput, SampleLogprobs
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.executor.runner import ModelRunner, SampledToken
from engine.executor.sampler import make_generator
from engine.kv_snapshots import KVSnapshots
from engine.kvcache.block_pool import BlockPool
from engine.kvcache.manager import KVCacheManager
from engine.loading.setup import LoadedModel, load_model
from engine.registry.loader import PrefixLoader
from engine.registry.registry import MatchReport, PrefixRegistry, ReloadStatus
from engine.registry.spec import PrefixContract, PrefixSpec, RegistryFileError
from engine.registry.watcher import PrefixFileWatcher
from engine.request import EngineRequest
from engine.request_checker import RequestChecker, RequestLimits
from engine.scheduler.scheduler import Scheduler
from engine.speculative.drafter import Drafter
from engine.stats import EngineStats, snapshot
from engine.structured.grammar import GrammarCompiler
from engine.text.detokenizer import RequestText

logger = logging.getLogger(__name__)


class LLMEngine:
    """Admit requests as token ids, step the batch, hand back per-request deltas."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        loaded = loaded or load_model(config)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = loaded.vocab_size
        self.pool: BlockPool = loaded.pool
        self.kernels = loaded.kernels
        self.checker = RequestChecker(self.tokenizer, self.eos_token_ids, lambda: self.limits)
        self.registry = PrefixRegistry(self.pool)
        self.cache = KVCacheManager(
            self.pool,
            config.enable_auto_prefix_cache,
            self.registry if config.enable_prefix_cache else None,
        )
        # Drafts only where a position's logits have the same bits in any chunk: elsewhere
        # verification could keep tokens the one-step path would not have chosen
        self.speculative = config.is_speculative and loaded.is_batch_invariant
        if config.is_speculative:
            logger.info(
                "speculative decoding: %s",
                f"on, up to {config.num_speculative_tokens} draft tokens a step"
                if self.speculative
                else "off (this compute path is not batch invariant: drafts could change "
                "greedy answers)",
            )
        self.scheduler = Scheduler(
            self.cache,
            config.max_num_seqs,
            config.token_budget,
            config.max_itl,
            speculative=self.speculative,
        )
        self.drafter = Drafter(config.num_speculative_tokens, self.max_model_len)
        self.runner = ModelRunner(
            loaded.model, self.pool, config.torch_device, loaded.has_cpu_kernels
        )
        self.snapshots = (
            KVSnapshots(
                config.kv_snapshot_path, loaded.kv_identity, self.pool, self.runner.kv_cache
            )
            # CPU only: the snapshot path reads and writes the cache's memory in place, and
            # no CUDA machine has run it yet.
            if config.enable_kv_snapshots
            and config.enable_prefix_cache
            and config.torch_device.type == "cpu"
            else None
        )
        self._requests: dict[str, Sequence] = {}  # live requests (prefix fills are not)
        self._texts: dict[str, RequestText] = {}  # step()'s text, per request it has seen
        self._arrivals = itertools.count()
        self.prefixes = PrefixLoader(
            self.registry,
            self.pool,
            self.max_model_len,
            lambda: next(self._arrivals),
            config.enable_prefix_cache,
            self.snapshots,
        )
        self.num_steps = 0
        self.num_forced_tokens = 0  # appended by grammar fast-forward (`_forced_token`)
        self.num_accepted_draft_tokens = 0  # kept by speculative decoding's verification
        self.prefix_file = PrefixFileWatcher(
            Path(config.prefix_file) if config.prefix_file is not None else None,
            self.tokenizer,
            self.max_model_len,
            self.checker.check,
            config.tenant_names,
        )
        if config.prefix_file is not None:
            self._load_prefix_file_at_start()
        if self.snapshots is not None and self._keeps_hot_set:
            self.snapshots.restore_hot()

    # -- prefixes ---------------------------------------------------------------------------------
    def load_prefixes(
        self, specs: list[PrefixSpec], on_done: Callable[[ReloadStatus], None] | None = None
    ) -> None:
        """Start registering `specs` (filled by the next steps); the old set serves meanwhile."""
        change = self.prefixes.start(specs, on_done)
        for seq in change.dropped:
            self.scheduler.finish(seq, "abort")
        for seq in reversed(change.new):  # each ahead of the last: file order at the head
            self.scheduler.add_first(seq)

    def reload_prefix_file(self, on_done: Callable[[ReloadStatus], None] | None = None) -> None:
        """Re-read `config.prefix_file`. Any error in it keeps the old registry and is
        recorded; without a configured file there is nothing to reload (RegistryFileError)."""
        if self.prefix_file.path is None:
            raise RegistryFileError(Path("<none>"), ["no prefix file is configured"])
        try:
            self.load_prefixes(self.prefix_file.read(), on_done)
        except EngineError as exc:
            self.prefixes.fail(str(exc), on_done)

    def poll_prefix_file(self) -> bool:
        """Reload once the file changed and then read the same on the next poll (see
        `PrefixFileWatcher`); True if a reload started."""
        if not self.prefix_file.poll():
            return False
        logger.info("%s changed: reloading prefixes", self.prefix_file.path)
        self.reload_prefix_file()
        return True

    def prefix_contract(
        self, token_ids: list[int], tenant: str | None = None
    ) -> PrefixContract | None:
        """The contract of the longest accepted prefixes-file entry that `token_ids` start
        with, among those `tenant` may see (caching on or off). Thread-safe: reads the
        loader's current index."""
        best = self._registered_entry(token_ids, tenant)
        return best.contract if best is not None else None

    def _registered_entry(self, token_ids: list[int], tenant: str | None) -> PrefixSpec | None:
        """The longest accepted prefixes-file entry `token_ids` start with, among those
        `tenant` may see."""
        return self.prefixes.spec_index.longest(token_ids, visible=lambda s: s.visible_to(tenant))

    def _load_prefix_file_at_start(self) -> None:
        """Load, fill and pin every prefix before serving; a bad file fails the start."""
        self.load_prefixes(self.prefix_file.read())
        total = self.prefixes.num_pending_tokens
        with tqdm(total=total, desc="prefilling prefixes", unit="tok", disable=total == 0) as bar:
            while self.prefixes.is_pending:
                before = self.prefixes.num_pending_tokens
                self.step()
                bar.update(before - self.prefixes.num_pending_tokens)

    # -- requests -------------------------------------------------------------------------------
    def prepare_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> EngineRequest:
        """The one validation of a request (`RequestChecker`): raise a typed error for
        anything this engine cannot serve, else return the EngineRequest the engine trusts
        from here on. Safe from any thread (the gateway calls it before a response starts)."""
        return self.checker.prepare(prompt_token_ids, params, cache_salt, tenant)

    @property
    def limits(self) -> RequestLimits:
        """What requests are checked against now (a reload changes the pinned blocks)."""
        return RequestLimits(
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.pool.block_size,
            num_usable_blocks=self.pool.num_blocks - self.pool.num_pinned_blocks,
        )

    @property
    def grammars(self) -> GrammarCompiler:
        return self.checker.grammars

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Validate and add (tests, benchmarks, the CLI): `add_prepared(prepare_request())`."""
        self.add_prepared(request_id, self.prepare_request(prompt_token_ids, params))

    def add_prepared(self, request_id: str, request: EngineRequest) -> None:
        """Queue a request `prepare_request` already validated."""
        if request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", param="request_id")
        prompt_token_ids, params = request.prompt_token_ids, request.params
        generator = (
            make_generator(params.seed, self.config.torch_device)
            if params.seed is not None
            else None
        )
        seq = Sequence(
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            arrival_index=next(self._arrivals),
            generator=generator,
            cache_salt=request.cache_salt,
            tenant=request.tenant,
            matcher=request.grammar.new_matcher() if request.grammar is not None else None,
        )
        self._requests[request_id] = seq
        if self.speculative and params.may_speculate:
            self.drafter.start(seq, self._entry_of(seq))
        self.scheduler.add(seq)
        logger.debug(
            "request %s: %d prompt tokens, max_tokens %s",
            request_id,
            seq.num_prompt_tokens,
            params.max_tokens,
        )

    def _entry_of(self, seq: Sequence) -> str | None:
        """The registry entry `seq`'s prompt extends (its earlier answers are drafts)."""
        spec = self._registered_entry(seq.prompt_token_ids, seq.tenant)
        return spec.name if spec is not None else None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, None if unknown."""
        seq = self._requests.pop(request_id, None)
        self._texts.pop(request_id, None)
        if seq is None:
            return None
        self.drafter.finish(seq, remember=False)
        self.scheduler.finish(seq, "abort")
        return self._output(seq, [], "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_work(self) -> bool:
        """Requests to serve or prefixes to fill."""
        return bool(self._requests) or self.prefixes.is_pending

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """`step_tokens()` with each delta's text (synchronous callers: tests, the CLI,
        benchmarks). A stop string finishes its request here, and the engine lets go of it
        at once."""
        for request_id, seq in self._requests.items():
            if request_id not in self._texts:
                self._texts[request_id] = RequestText(
                    self.tokenizer, seq.prompt_token_ids, seq.params, self.eos_token_ids
                )
        return [self._with_text(out) for out in self.step_tokens()]

    def _with_text(self, out: RequestOutput) -> RequestOutput:
        text = self._texts.get(out.request_id)
        if text is None:  # finished or aborted earlier in this step
            return out
        try:
            done = text.process(out)
        except Exception as exc:  # this request fails alone
            logger.exception("post-processing failed for request %s", out.request_id)
            done = self.abort_request(out.request_id) or out
            done.error = f"post-processing failed: {exc!r}"
            return done
        if done.finished:
            del self._texts[out.request_id]
            if not out.finished:  # a stop string: the engine stops it now
                self._release(self._requests[out.request_id], "stop", done.stop_reason)
        return done

    def step_tokens(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; the token-level deltas of this step (no text).
        The AsyncEngine's thread calls this; the text is made on its event loop."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        started = time.perf_counter()
        result = self.runner.execute(out)
        if out.num_batched_tokens:  # a forward ran: its time (engine/scheduler/pacing.py)
            self.scheduler.record_step(out, time.perf_counter() - started)
        self.scheduler.on_step_done(out)
        self.num_steps += 1
        for seq, logits in result.prefilled:
            self.scheduler.detach(seq)  # its blocks are the hook's now
            assert seq.on_prefilled is not None
            seq.on_prefilled(seq, logits)
        outputs = [self._append_or_fail(s) for s in result.sampled]
        if self.config.debug_check_integrity:
            self.check_integrity()
        return outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request with an error (the forward raised); blocks are released."""
        outputs = []
        for request_id in list(self._requests):
            output = self.abort_request(request_id)
            if output is not None:
                output.error = message
                outputs.append(output)
        return outputs

    def close(self, graceful: bool = True) -> None:
        """Finish what must outlive the process: the KV snapshots still being written and,
        on a graceful stop (nothing running any more), the hot automatic-cache set."""
        if self.snapshots is None:
            return
        if graceful and self.config.enable_auto_prefix_cache:
            self.snapshots.save_hot(self.config.kv_snapshot_budget)  # budget 0: removes it
        self.snapshots.close()

    @property
    def _keeps_hot_set(self) -> bool:
        return self.config.enable_auto_prefix_cache and self.config.kv_snapshot_budget > 0

    def check_integrity(self) -> None:
        """The cache's invariants over every holder of blocks: live requests, registered
        prefixes, prefix fills in flight (KVCacheManager.check_integrity)."""
        self.cache.check_integrity(
            [
                *self._requests.values(),
                *(p.block_ids for p in self.registry.prefixes.values()),
                *self.prefixes.block_holders(),
            ]
        )

    def _append_or_fail(self, sampled: SampledToken) -> RequestOutput:
        """Post-process one sampled token; a failure there fails that request alone."""
        try:
            return self._append(sampled)
        except Exception as exc:
            logger.exception("post-processing failed for request %s", sampled.seq.request_id)
            output = self.abort_request(sampled.seq.request_id)
            if output is None:  # already gone: let the caller fail the whole step
                raise
            output.error = f"post-processing failed: {exc!r}"
            return output

    def _append(self, sampled: SampledToken) -> RequestOutput:
        """The draft tokens the forward kept and the sampled token join the sequence, then
        each token its grammar forces after them (`_forced_token`); the finishes a token
        decides (a stop or EOS token, a complete grammar, the length) end it at that token.
        Stop strings are the text's. A running sequence then gets its next drafts."""
        seq = sampled.seq
        if seq.params.max_tokens == 0:  # the prompt was only to be scored
            return self._finish(seq, [], "length", None, None)
        appended: list[int] = []
        finish_reason, stop_reason = None, None
        for token_id in (*sampled.accepted, sampled.token_id):
            finish_reason, stop_reason = self._join(seq, token_id, appended)
            if finish_reason is not None:
                break
        logprobs = (
            [*sampled.accepted_logprobs, sampled.logprobs][: len(appended)]
            if sampled.logprobs is not None
            else None
        )
        self._count_drafts(sampled, min(len(appended), len(sampled.accepted)))
        while finish_reason is None and (forced := self._forced_token(seq)) is not None:
            finish_reason, stop_reason = self._join(seq, forced, appended)
            self.num_forced_tokens += 1
        if finish_reason is not None:
            return self._finish(seq, appended, finish_reason, stop_reason, logprobs)
        self.drafter.propose(seq, self.scheduler.draft_bar)
        return self._output(seq, appended, None, None, logprobs)

    def _join(
        self, seq: Sequence, token_id: int, appended: list[int]
    ) -> tuple[str | None, int | None]:
        """`token_id` joins `seq`; whether it ends it (`_finish_of`)."""
        seq.token_ids.append(token_id)
        appended.append(token_id)
        return self._finish_of(seq, token_id)

    def _count_drafts(self, sampled: SampledToken, num_joined: int) -> None:
        """The kept draft tokens that joined have their K/V computed by the forward that
        verified them: count them computed, and index the blocks they filled."""
        if not sampled.num_drafted:
            return
        seq = sampled.seq
        self.drafter.record(seq, sampled.num_drafted, len(sampled.accepted))
        self.num_accepted_draft_tokens += len(sampled.accepted)
        if num_joined:
            seq.num_computed_tokens += num_joined
            self.cache.index_computed(seq)

    def _finish_of(self, seq: Sequence, token_id: int) -> tuple[str | None, int | None]:
        """Whether `token_id`, just appended, ends `seq` (finish reason, stop token)."""
        is_grammar_complete = seq.matcher is not None and _advance(seq.matcher, token_id)
        finish_reason, stop_reason = self._stop_by_token(seq, token_id)
        if finish_reason is None and is_grammar_complete:
            finish_reason = "stop"  # the grammar allows nothing more: no step for the EOS
        if finish_reason is None:
            finish_reason = self._stop_by_length(seq)
        return finish_reason, stop_reason

    def _forced_token(self, seq: Sequence) -> int | None:
        """The next token when `seq`'s grammar allows only that one (grammar fast-forward):
        it joins now, and its KV is computed in the next forward with the position after it,
        instead of one decode step each (a JSON schema's keys and punctuation, a named tool
        call's opening, the rest of a label). Exact: while llguidance has forced tokens, the
        mask it gives is that one token, so a step would have sampled it whatever the logits,
        and the C++ kernels compute a position's KV to the same bits in any chunk (the dense
        and CUDA paths promise that for no batch shape: docs/architecture.md)."""
        if (
            seq.matcher is None
            or not self.config.enable_grammar_fast_forward
            or not seq.params.may_fast_forward
        ):
            return None
        forced = seq.matcher.compute_ff_tokens()
        return forced[0] if forced else None

    def _finish(
        self,
        seq: Sequence,
        token_ids: list[int],
        finish_reason: str,
        stop_reason: int | None,
        logprobs: list[SampleLogprobs] | None,
    ) -> RequestOutput:
        self._release(seq, finish_reason, stop_reason)
        return self._output(seq, token_ids, finish_reason, stop_reason, logprobs)

    def _release(self, seq: Sequence, finish_reason: str, stop_reason: str | int | None) -> None:
        """A request ends: out of the engine, its blocks back to the cache, its answer a
        draft source for later requests of its scope."""
        del self._requests[seq.request_id]
        self.drafter.finish(seq, remember=finish_reason in ("stop", "length"))
        self.scheduler.finish(seq, finish_reason)
        seq.stop_reason = stop_reason
        logger.debug(
            "request %s finished (%s): %d prompt tokens (%d cached), %d generated",
            seq.request_id,
            finish_reason,
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
            seq.num_output_tokens,
        )

    def _stop_by_token(self, seq: Sequence, token_id: int) -> tuple[str | None, int | None]:
        """("stop", the stop token id, or None for EOS) when `token_id` ends `seq`."""
        if not seq.params.is_stop_token(token_id, self.eos_token_ids):
            return None, None
        return "stop", token_id if token_id in seq.params.stop_token_ids else None

    def _stop_by_length(self, seq: Sequence) -> str | None:
        max_tokens = seq.params.max_tokens
        if max_tokens is not None and seq.num_output_tokens >= max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(
        self,
        seq: Sequence,
        token_ids: list[int],
        finish_reason: str | None,
        stop_reason: str | int | None = None,
        logprobs: list[SampleLogprobs] | None = None,
    ) -> RequestOutput:
        # Prompt logprobs are complete once the prompt is computed: the first output (which
        # may hold forced tokens after the sampled one) has them.
        is_first = seq.num_output_tokens <= len(token_ids)
        is_first = is_first and seq.params.prompt_logprobs is not None
        return RequestOutput(
            request_id=seq.request_id,
            text="",
            token_ids=token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_completion_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_cache_written_tokens=seq.num_cache_written_tokens,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=logprobs,
            prompt_logprobs=list(seq.prompt_logprobs) if is_first else None,
        )

    # -- conveniences -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion (tests, benchmarks); returns each one's output token ids."""
        ids = [f"gen-{next(self._arrivals)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.add_request(request_id, prompt, params)
        results: dict[str, list[int]] = {i: [] for i in ids}
        while any(i in self._requests for i in ids):
            for output in self.step():
                if output.request_id in results:
                    results[output.request_id].extend(output.token_ids)
        return [results[i] for i in ids]

    def explain_match(
        self, token_ids: list[int], cache_salt: str | None = None, tenant: str | None = None
    ) -> MatchReport:
        """The registry's view of `token_ids` (match, else the closest miss, among the
        entries `tenant` may see) and what the prefix cache would share with them now, in
        that scope (read only: takes no block)."""
        report = self.registry.explain(token_ids, tenant)
        if self.cache.prefixes is None or not token_ids:
            return report
        probe = Sequence(
            "explain",
            list(token_ids),
            len(token_ids),
            SamplingParams(),
            -1,
            cache_salt=cache_salt,
            tenant=tenant,
        )
        _, hit = self.cache.best_cached(probe)
        if hit is None:
            return report
        return replace(report, num_cached_tokens=hit.num_tokens, cache_source=hit.source)

    def stats(self) -> EngineStats:
        """A snapshot for metrics and the admin API; safe to call from another thread."""
        return snapshot(
            self.cache,
            self.scheduler,
            self.registry,
            self.prefixes.is_pending,
            self.kernels.label,
            self.num_forced_tokens,
            self.drafter.counts(),
        )


def _advance(matcher: LLMatcher, token_id: int) -> bool:
    """Feed the sampled token to the sequence's grammar; True when the grammar is complete.
    The mask only allowed tokens the grammar accepts, so a refusal is an engine bug (or a
    matcher limit hit): it fails this request alone (`_append_or_fail`)."""
    if not matcher.consume_token(token_id):
        raise RuntimeError(f"the grammar refused token {token_id}: {matcher.get_error()}")
    return bool(matcher.is_stopped())
