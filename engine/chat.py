"""The one way prompts become token ids: chat messages through the model's chat template, or
a completions prompt string through the tokenizer.

The gateway and the prefix registry both call these functions, so a registered prefix and a
request are tokenized by the same code path: prefix matching is on token ids, and two paths
that rendered or tokenized even slightly differently would silently never hit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import jinja2

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
) -> list[int]:
    """Render `messages` with the model's chat template and tokenize the result, in one call.

    Raises InvalidRequestError (param "messages") when the model has no chat template or the
    template refuses the conversation (templates raise on, for example, roles that do not
    alternate): both are the caller's to fix, not engine failures.
    """
    if not tokenizer.chat_template:
        raise InvalidRequestError(
            "this model has no chat template: send a raw prompt to the completions API",
            param="messages",
        )
    try:
        ids = tokenizer.apply_chat_template(
            [dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from exc
    return _as_token_ids(ids)


def text_prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Tokenize a completions prompt string, with the tokenizer's own special tokens (BOS)."""
    return _as_token_ids(tokenizer(text, add_special_tokens=True)["input_ids"])


def _as_token_ids(ids: object) -> list[int]:
    # One prompt in, so transformers returns a flat list of ints (its return types are unions).
    assert isinstance(ids, list) and all(isinstance(token_id, int) for token_id in ids), ids
    return [int(token_id) for token_id in ids]
