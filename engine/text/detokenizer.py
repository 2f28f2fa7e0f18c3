"""Incremental detokenization: one token id in, text that is safe to stream out.

Decoding a single token on its own is wrong for two tokenizer families. Byte-level BPE
(GPT-2, Llama-3, SmolLM) splits one character over several tokens, so a lone token may
decode to half a UTF-8 sequence. SentencePiece-style tokenizers drop the leading "▁" space
of the first token they decode, so a generated word loses its space unless it is decoded
after some context. Re-decoding the whole output each step fixes both but costs O(length)
per token. We use the prefix_offset/read_offset window that vLLM and HF's streamers use:
decode a few tokens of context with and without the new tokens and emit the difference.

On top of that sits stop-string matching, which must never emit any part of a stop string:
text that could be the start of one is held back until the match completes or fails.

`RequestText` is a request's side of it: the engine thread emits token-level deltas
(`RequestOutput` without text: token ids, logprobs, counts, and the finishes it decides
itself: a stop or EOS token, a complete grammar, the length), and the caller turns them into
what clients read: the AsyncEngine on its event loop, `LLMEngine.step()` for synchronous use.
A stop string ends the request there, before the engine knows: the caller then aborts it in
the engine (the steps it ran meanwhile are dropped, never shown). So no request's text slows
the forward passes of every other request.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.text.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first generated token (vLLM uses 5 too).
_NUM_PROMPT_CONTEXT_TOKENS = 5
# A run of tokens whose text keeps ending in an incomplete character is emitted anyway once
# this long: legitimate UTF-8 never needs it, and it bounds the window for garbage output.
_MAX_PENDING_TOKENS = 32
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class DetokenizerDelta:
    """Text that became safe to emit with one token, and the stop string it hit, if any.

    `text` never ends inside a UTF-8 character and never contains any part of a stop
    string. When `stop_string` is set the request must finish with finish_reason "stop".
    """

    text: str
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Turns a request's generated token ids, one at a time, into streamable text deltas.

    Call `step()` once per generated token. When generation ends for a reason other than a
    stop string (EOS, length, abort), call `flush()` to get the text still held back.
    Concatenating every delta (and the flush) equals `tokenizer.decode(generated_ids)` with
    `clean_up_tokenization_spaces=False`, except that text from a stop string onward is cut
    and SentencePiece-style leading spaces follow the prompt. Cost per token is O(window).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        assert all(stop), "stop strings must be non-empty"
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Skipped ids never enter the window, so a skipped token cannot become the
        # "first token" whose leading space a SentencePiece decoder strips.
        self._skipped_ids: frozenset[int] = (
            frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        )
        # The window: ids[:read_offset] are context whose text was already emitted (or is
        # prompt); ids[read_offset:] are generated tokens whose text is not emitted yet.
        self._token_ids = _context_ids(prompt_token_ids, self._skipped_ids)
        self._read_offset = len(self._token_ids)
        self._stop = tuple(stop)
        self._max_partial_len = max((len(s) for s in self._stop), default=1) - 1
        self._held_text = ""
        self._output_chunks: list[str] = []
        self._is_finished = False

    @property
    def output_text(self) -> str:
        """All text emitted so far (O(length): meant for the final response, not per step)."""
        return "".join(self._output_chunks)

    def step(self, token_id: int) -> DetokenizerDelta:
        """Add one generated token and return the text that is now safe to emit."""
        assert not self._is_finished, "step() after a stop string or flush()"
        return self._apply_stop(self._decode_next(token_id))

    def flush(self) -> str:
        """Return the text still held back, at a finish not caused by a stop string.

        That is a partial stop-string match that never completed, plus the text of trailing
        tokens that end inside a character (decoded as-is, with "\\ufffd"). Idempotent, and
        returns "" after a stop string already finished the request.
        """
        if self._is_finished:
            return ""
        self._is_finished = True
        text = self._held_text + self._decode_pending()
        self._held_text = ""
        # Forced trailing text could (absurdly) complete a stop string: cut it, never leak it.
        match = _find_earliest_stop(text, self._stop)
        if match is not None:
            text = text[: match[0]]
        self._output_chunks.append(text)
        return text

    def _decode_next(self, token_id: int) -> str:
        if token_id in self._skipped_ids:
            return ""
        self._token_ids.append(token_id)
        new_text = self._decode(self._token_ids)
        num_pending = len(self._token_ids) - self._read_offset
        # A trailing U+FFFD means the last character is still missing bytes: wait for the
        # tokens that complete it. The window grows meanwhile, so it must not slide here.
        if new_text.endswith(_REPLACEMENT_CHAR) and num_pending < _MAX_PENDING_TOKENS:
            return ""
        return self._slide(new_text)

    def _decode_pending(self) -> str:
        if self._read_offset == len(self._token_ids):
            return ""
        return self._slide(self._decode(self._token_ids))

    def _slide(self, new_text: str) -> str:
        """Return the text of ids[read_offset:] and make those ids the next context.

        `new_text` is the decode of the whole window; the text of the context is a prefix
        of it, so the difference is exactly what the pending ids add.
        """
        prefix_text = self._decode(self._token_ids[: self._read_offset])
        del self._token_ids[: self._read_offset]
        self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        # No clean-up: it rewrites spaces depending on neighbours, so decoding a window
        # would not agree with decoding the whole text.
        text = self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str)  # a flat id list decodes to one string
        return text

    def _apply_stop(self, text: str) -> DetokenizerDelta:
        if not self._stop or not text:
            return self._emit(text, None)
        # Hold-back invariant: `_held_text` is the longest suffix of all text so far that is
        # a proper prefix of some stop string. So any match that ends in the new text starts
        # inside `_held_text + text`, and searching that short buffer suffices; and nothing
        # emitted can later turn out to be the start of a stop string.
        pending = self._held_text + text
        match = _find_earliest_stop(pending, self._stop)
        if match is not None:
            index, stop_string = match
            self._is_finished = True
            self._held_text = ""
            return self._emit(pending[:index], stop_string)
        num_held = _longest_partial_stop(pending, self._stop, self._max_partial_len)
        self._held_text = pending[len(pending) - num_held :]
        return self._emit(pending[: len(pending) - num_held], None)

    def _emit(self, text: str, stop_string: str | None) -> DetokenizerDelta:
        if text:
            self._output_chunks.append(text)
        return DetokenizerDelta(text=text, stop_string=stop_string)


class RequestText:
    """One request's text: feed it the engine's deltas in order with `process`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
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
        length, a complete grammar) gets the text held back for stop strings, flushed. A
        delta of several tokens (drafts, forced tokens) ends at the token whose text
        completes a stop string: the tokens after it are dropped, as one step a token would
        never have made them."""
        assert not self.is_finished, "an output after the request finished"
        if out.error is not None or out.finish_reason == "abort":
            self.is_finished = out.finished
            return out
        text, finish_reason, stop_reason = "", out.finish_reason, out.stop_reason
        offsets: list[int] = []  # where each token's text starts, as one step each emits it
        for token_id in out.token_ids:
            offsets.append(len(text))
            if finish_reason is not None and self.params.is_stop_token(
                token_id, self.eos_token_ids
            ):
                break
            delta = self.detokenizer.step(token_id)
            text += delta.text
            if delta.stop_string is not None:
                finish_reason, stop_reason = "stop", delta.stop_string
                out = out.truncated(len(offsets))
                break
        offsets += [len(text)] * (len(out.token_ids) - len(offsets))
        if finish_reason is not None and not isinstance(stop_reason, str):
            text += self.detokenizer.flush()
        self.is_finished = finish_reason is not None
        return replace(
            out,
            text=text,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            text_offsets=offsets,
        )


def _context_ids(prompt_token_ids: Sequence[int], skipped_ids: frozenset[int]) -> list[int]:
    """The last few prompt tokens that survive skipping, oldest first."""
    context: list[int] = []
    for token_id in reversed(prompt_token_ids):
        if len(context) == _NUM_PROMPT_CONTEXT_TOKENS:
            break
        if token_id not in skipped_ids:
            context.append(token_id)
    context.reverse()
    return context


def _find_earliest_stop(text: str, stop: tuple[str, ...]) -> tuple[int, str] | None:
    """(index, stop string) of the match that starts first; ties go to the first listed."""
    best: tuple[int, str] | None = None
    for stop_string in stop:
        index = text.find(stop_string)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_string)
    return best


def _longest_partial_stop(text: str, stop: tuple[str, ...], max_len: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    for length in range(min(len(text), max_len), 0, -1):
        suffix = text[len(text) - length :]
        if any(stop_string.startswith(suffix) for stop_string in stop):
            return length
    return 0
