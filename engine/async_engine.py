"""AsyncEngine: one background thread owns all torch state and steps the LLMEngine.

asyncio code talks to it in two directions only:
- commands (add, abort, any callable) go into a thread-safe queue and wake the loop;
- each request's outputs come back through its own asyncio.Queue, fed with
  `loop.call_soon_threadsafe`, so the event loop never blocks on torch. They carry token ids;
  `generate()` makes their text on the event loop (`RequestText`: detokenizing, stop strings),
  so none of that runs between two forward passes. A stop string ends the stream there and
  aborts the request in the engine.
Cancelling a `generate()` iterator (client gone, task cancelled) aborts the request in the
engine, which frees its blocks at the next loop turn.

The same thread also builds the engine (model load, registry prefill): torch's OpenMP keeps a
thread team per calling thread, and while a second team stays alive (say, the executor thread
that loaded the model) libgomp sees more threads than cores and stops spinning between
parallel regions. On 2 cores that made every decode step ~30% slower (39 vs 30 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.core.config import EngineConfig
from engine.core.errors import EngineDeadError, EngineError, RequestFailedError
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import GrammarSpec, SamplingParams
from engine.llm_engine import LLMEngine
from engine.registry.registry import MatchReport, ReloadStatus
from engine.registry.spec import PrefixContract
from engine.request import EngineRequest
from engine.stats import EngineStats
from engine.text.detokenizer import RequestText

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class _Stream:
    """Where one request's outputs go: a queue living on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        # RuntimeError: the caller's loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Thread-backed engine with an async request API. Call `start()` once, `shutdown()` at exit."""

    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.engine: LLMEngine
        if engine is not None:
            self.engine = engine
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._ids = itertools.count()
        self._stop = False
        self._next_prefix_poll = 0.0
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="prefixgate-engine", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread. Without a prebuilt engine the thread builds it first, and
        this call blocks until it has (seconds: run it off the event loop) and re-raises a
        load failure."""
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            raise self._load_error

    async def open(self) -> None:
        """`start()` without blocking the event loop (the gateway's way in)."""
        await asyncio.to_thread(self.start)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still running are aborted."""
        self._stop = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    # -- facts the gateway needs (read-only, set once at load) -----------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def prepare_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> EngineRequest:
        """Validate once (typed errors, before any response has started); see LLMEngine."""
        return self.engine.prepare_request(prompt_token_ids, params, cache_salt, tenant)

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile `spec` (cached), or raise InvalidRequestError naming "grammar"."""
        self.engine.grammars.compile(spec)

    def prefix_contract(
        self, prompt_token_ids: list[int], tenant: str | None = None
    ) -> PrefixContract | None:
        """The output contract of the registry entry this prompt starts with; see LLMEngine."""
        return self.engine.prefix_contract(prompt_token_ids, tenant)

    # -- requests -------------------------------------------------------------------------------
    async def generate(
        self,
        request: EngineRequest,
        request_id: str | None = None,
        affinity_key: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a prepared request's outputs. Failures come out as typed engine errors.
        `affinity_key` routes among replicas (`gateway.engine_client`); one engine has no
        use for it."""
        self._check_alive()
        request_id = request_id or f"req-{next(self._ids)}"
        text = RequestText(
            self.tokenizer, request.prompt_token_ids, request.params, self.engine.eos_token_ids
        )
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._submit(lambda: self._add(request_id, request, stream))
        is_engine_done = False  # the engine finished it (else: abort it on the way out)
        try:
            while not text.is_finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    is_engine_done = True
                    raise item
                is_engine_done = item.finished
                yield _with_text(text, item, request_id)
        finally:
            if not is_engine_done:  # a stop string, or cancelled / closed early
                self._submit(lambda: self._abort(request_id, stream))

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id, None))

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and await its result."""
        self._check_alive()
        future: Future[T] = Future()

        def call() -> None:
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the awaiting caller
                future.set_exception(exc)

        self._submit(call)
        return await asyncio.wrap_future(future)

    async def reload_prefixes(self) -> ReloadStatus:
        """Re-read the prefix file now; resolves when the new set serves (or the reload failed)."""
        done: Future[ReloadStatus] = Future()
        await self.run_in_engine(lambda e: e.reload_prefix_file(done.set_result))
        return await asyncio.wrap_future(done)

    async def explain_prefix_match(
        self, token_ids: list[int], cache_salt: str | None = None, tenant: str | None = None
    ) -> MatchReport:
        """Which registered prefix these ids hit, or where the closest one diverged, and what
        the prefix cache would share with them (in `cache_salt`'s scope)."""
        return await self.run_in_engine(lambda e: e.explain_match(token_ids, cache_salt, tenant))

    # -- engine thread --------------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _check_alive(self) -> None:
        if self._dead is not None or self._stop:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead}")

    def _run(self) -> None:
        try:
            if not hasattr(self, "engine"):
                self.engine = LLMEngine(self.config)
        except BaseException as exc:
            self._load_error = self._dead = exc
            return
        finally:
            self._loaded.set()
        try:
            while True:
                self._wakeup.clear()
                self._drain_commands()
                if self._stop:
                    break
                self._poll_prefix_file()
                if not self.engine.has_work():
                    self._wakeup.wait(timeout=self.engine.config.prefix_watch_interval)
                    continue
                self._step()
        except BaseException as exc:  # the loop itself broke: fail everyone, loudly
            logger.exception("engine loop died")
            self._dead = exc
        finally:
            reason = (
                "the engine is shutting down"
                if self._dead is None
                else (f"the engine loop died: {self._dead!r}")
            )
            self._drain_commands()
            # The requests still in flight fail because the engine stopped, not because of
            # anything in them: they get EngineDeadError (503), not RequestFailedError (500).
            for output in self.engine.fail_all(reason):
                self._deliver(output, EngineDeadError)
            self.engine.close(graceful=self._dead is None)

    def _poll_prefix_file(self) -> None:
        now = time.monotonic()
        if now >= self._next_prefix_poll:
            self._next_prefix_poll = now + self.engine.config.prefix_watch_interval
            self.engine.poll_prefix_file()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _step(self) -> None:
        try:
            outputs = self.engine.step_tokens()
        except Exception as exc:
            # One bad batch must not kill the server: fail its requests, keep the loop.
            logger.exception("engine step failed; failing the requests in flight")
            outputs = self.engine.fail_all(f"engine step failed: {exc}")
        for output in outputs:
            self._deliver(output)

    def _add(self, request_id: str, request: EngineRequest, stream: _Stream) -> None:
        try:
            self.engine.add_prepared(request_id, request)
        except EngineError as exc:
            stream.put(exc)
            return
        except Exception as exc:  # a bug for this request only: it fails, the loop goes on
            logger.exception("could not add request %s", request_id)
            stream.put(RequestFailedError(f"could not add the request: {exc!r}"))
            return
        self._streams[request_id] = stream

    def _abort(self, request_id: str, stream: _Stream | None) -> None:
        """Abort a request; with `stream`, only if that stream still owns the id (a rejected
        duplicate that is cancelled must not abort the original)."""
        if stream is not None and self._streams.get(request_id) is not stream:
            return
        output = self.engine.abort_request(request_id)
        if output is not None:
            self._deliver(output)

    def _deliver(
        self, output: RequestOutput, error_type: type[EngineError] = RequestFailedError
    ) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        if output.error is not None:
            stream.put(error_type(output.error))
        else:
            stream.put(output)

    def stats(self) -> EngineStats:
        """A snapshot for metrics and the admin API; safe from any thread."""
        return self.engine.stats()


def _with_text(text: RequestText, out: RequestOutput, request_id: str) -> RequestOutput:
    """The engine's delta with its text; a failure there fails this request alone."""
    try:
        return text.process(out)
    except Exception as exc:
        logger.exception("post-processing failed for request %s", request_id)
        raise RequestFailedError(f"post-processing failed: {exc!r}") from exc
