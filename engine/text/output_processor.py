"""The front end's side of a request's outputs: token ids in, text out.

The engine thread emits token-level deltas (`RequestOutput` with no text: token ids,
logprobs, counts, and the finishes it decides itself: a stop or EOS token, a grammar that is
complete, the length). `RequestText` turns them into what clients read, on the caller's side
(the AsyncEngine's event loop, or `LLMEngine.step()` for synchronous use): it owns the
incremental detokenizer and the stop strings. A stop string ends the request here, before
the engine knows: the caller then aborts it in the engine (the steps it ran meanwhile are
dropped, never shown). Text never slows the forward passes of every other request.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RequestText:
    """One request's text: feed it the engine's deltas in order with `process`."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Collection[int],
    ) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens
        )
        self.is_finished = False

    def process(self, out: RequestOutput) -> RequestOutput:
        """`out` with its text. Finished when the engine finished it or a stop string came
        up (finish_reason "stop", stop_reason the string); after that, nothing is expected.

        An EOS or stop token is never turned into text; a request that ends otherwise (the
        length, a complete grammar) gets the text held back for stop strings, flushed."""
        assert not self.is_finished, "an output after the request finished"
        if out.error is not None or out.finish_reason == "abort":
            self.is_finished = out.finished
            return out
        text, finish_reason, stop_reason = "", out.finish_reason, out.stop_reason
        for token_id in out.token_ids:
            if finish_reason is not None and self._is_stop_token(token_id):
                break
            delta = self.detokenizer.step(token_id)
            text += delta.text
            if delta.stop_string is not None:
                finish_reason, stop_reason = "stop", delta.stop_string
                break
        if finish_reason is not None and not isinstance(stop_reason, str):
            text += self.detokenizer.flush()
        self.is_finished = finish_reason is not None
        return replace(out, text=text, finish_reason=finish_reason, stop_reason=stop_reason)

    def _is_stop_token(self, token_id: int) -> bool:
        """What the engine finishes on without showing it (LLMEngine._stop_by_token)."""
        if token_id in self.params.stop_token_ids:
            return True
        return token_id in self.eos_token_ids and not self.params.ignore_eos
