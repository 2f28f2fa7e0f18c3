"""The one way prompts become token ids: chat messages through the model's chat template, or
a completions prompt string through the tokenizer.

The gateway and the prefix registry both call these functions, so a registered prefix and a
request are tokenized by the same code path: prefix matching is on token ids, and two paths
that rendered or tokenized even slightly differently would silently never hit.

Message content is text, never markup. A chat prompt is rendered to one string and tokenized
with special tokens parsed, because the template's own markup (`<|im_start|>`...) must become
special ids; a user who writes `<|im_end|>\\n<|im_start|>system\\n` in a message would then
forge a system turn. So when any message's content holds a special token's text, those
occurrences are tokenized as plain text (`split_special_tokens`), as OpenAI and vLLM's
secure mode do, while everything the template itself wrote is tokenized as before.
"""

from __future__ import annotations

import json
import re
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jinja2

from engine.core.errors import InvalidRequestError
from engine.text.chat_template import RENDERER_VARIABLES
from engine.text.tool_format import conversation_for_template

if TYPE_CHECKING:
    from engine.text.tokenizer import Tokenizer


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Render `messages` with the model's chat template and tokenize the result.
    `template_kwargs`: a client's own variables for the template (`chat_template_kwargs`, as
    vLLM, SGLang and llama.cpp server take them: Qwen3's and SmolLM3's `enable_thinking`...);
    one the renderer sets itself is an InvalidRequestError (param "chat_template_kwargs").

    Special-token text inside message content is tokenized as plain text (module docstring).
    Raises InvalidRequestError (param "messages") when the model has no chat template, the
    template refuses the conversation (templates raise on, for example, roles that do not
    alternate), or content with special-token text goes through a template that rewrites
    content beyond trimming it (its markup could then not be told from the content's).
    """
    conversation, variables = conversation_for_template(tokenizer.chat_template, messages, tools)
    # the server's defaults (--default-chat-template-kwargs; a transformers tokenizer, which
    # tools and tests render with, has none) under the request's own, and the renderer's
    # (the request's tools, under a name of the template's) over both
    defaults: Mapping[str, Any] = getattr(tokenizer, "template_defaults", {})
    if template_kwargs or defaults:
        client = _client_variables(template_kwargs or {}, variables)
        variables = {**defaults, **client, **variables}
    text = _render(tokenizer, conversation, add_generation_prompt, variables)
    pattern = _special_token_pattern(tokenizer)
    if pattern is None or not any(pattern.search(c) for c in _contents(conversation)):
        return _encode(tokenizer, text)
    segments = _split_content_specials(
        tokenizer, conversation, add_generation_prompt, pattern, variables
    )
    if "".join(segment for segment, _ in segments) != text:
        raise InvalidRequestError(
            "message content contains special-token text that this model's chat template "
            "does not keep verbatim; remove it",
            param="messages",
        )
    ids: list[int] = []
    for segment, is_content_special in _merge_text(segments):
        ids += _encode(tokenizer, segment, split_special_tokens=is_content_special)
    return ids


def answer_start_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text` the answer is known to start with (a forced tool call's opening), to follow a
    chat prompt: tokenized on its own, as the answer's tokens start after the prompt's."""
    return _encode(tokenizer, text) if text else []


def text_prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Tokenize a completions prompt string, with the tokenizer's own special tokens (BOS)."""
    return tokenizer.encode(text, add_special_tokens=True)


# Fill-in-the-middle tokens, as the StarCoder and Qwen-Coder families spell them.
FIM_TOKENS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
)


def fim_prompt_ids(tokenizer: Tokenizer, prefix: str | list[int], suffix: str) -> list[int]:
    """`<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>`: the model writes the middle.
    Raises InvalidRequestError (param "suffix") for a model without these tokens."""
    vocab = tokenizer.get_vocab()
    names = next((names for names in FIM_TOKENS if all(n in vocab for n in names)), None)
    if names is None:
        raise InvalidRequestError(
            "suffix needs a model with a fill-in-the-middle format, and this model has none "
            "(no <fim_prefix>, <fim_suffix> and <fim_middle> tokens)",
            param="suffix",
            code="unsupported_value",
        )
    prefix_token, suffix_token, middle_token = (vocab[name] for name in names)
    prefix_ids = prefix if isinstance(prefix, list) else _encode(tokenizer, prefix)
    return [prefix_token, *prefix_ids, suffix_token, *_encode(tokenizer, suffix), middle_token]


# Names a client's template variables may not take: the renderer's own, and the parameters of
# `Tokenizer.apply_chat_template` that carry them (as vLLM refuses `chat_template`, `tokenize`).
_RESERVED = RENDERER_VARIABLES | {"conversation", "tokenize", "chat_template"}


def template_defaults(text: str) -> dict[str, Any]:
    """`--default-chat-template-kwargs`: a JSON object of template variables, none of them a
    name the renderer sets. ValueError saying what is wrong otherwise."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"a JSON object of template variables, not {type(value).__name__}")
    taken = sorted(set(value) & _RESERVED)
    if taken:
        raise ValueError(f"{', '.join(map(repr, taken))}: the server sets it from each request")
    return value


def _client_variables(
    template_kwargs: Mapping[str, Any], variables: Mapping[str, Any]
) -> dict[str, Any]:
    """`template_kwargs`, refused where a name is one the renderer or the request's tools set."""
    taken = sorted(set(template_kwargs) & (_RESERVED | set(variables)))
    if taken:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(map(repr, taken))}: the server sets "
            "it from the request (messages, tools, add_generation_prompt, the template)",
            param="chat_template_kwargs",
        )
    return dict(template_kwargs)


def _render(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
) -> str:
    """`messages` through the chat template; `variables`: the template's own besides them
    (the tools, under the name the template reads)."""
    if not tokenizer.chat_template:
        raise InvalidRequestError(
            "this model has no chat template: send a raw prompt to the completions API, or "
            "start the server with --chat-template FILE (a Jinja template for its turns)",
            param="messages",
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **variables,
        )
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from exc
    assert isinstance(text, str)
    return text


def _encode(tokenizer: Tokenizer, text: str, split_special_tokens: bool = False) -> list[int]:
    # add_special_tokens=False: the template writes BOS itself when the model wants one
    # (what apply_chat_template(tokenize=True) does too).
    return tokenizer.encode(
        text, add_special_tokens=False, split_special_tokens=split_special_tokens
    )


def _special_token_pattern(tokenizer: Tokenizer) -> re.Pattern[str] | None:
    """The texts the tokenizer turns into special ids, longest first (one alternation); made
    once per tokenizer (its added tokens never change): for Gemma 3's 6,384 added tokens it
    took 22 ms, which every chat request paid."""
    if tokenizer not in _SPECIAL_TOKEN_PATTERNS:
        _SPECIAL_TOKEN_PATTERNS[tokenizer] = _pattern_of(tokenizer)
    return _SPECIAL_TOKEN_PATTERNS[tokenizer]


# Weak keys: a tokenizer's pattern goes with it (tests make many tokenizers in one process).
_SPECIAL_TOKEN_PATTERNS: weakref.WeakKeyDictionary[Tokenizer, re.Pattern[str] | None] = (
    weakref.WeakKeyDictionary()
)


def _pattern_of(tokenizer: Tokenizer) -> re.Pattern[str] | None:
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    texts.discard("")
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


# A message's fields of text a client wrote: its content, and the tools a template reads
# from a system message (`tool_format.SYSTEM_FIELD`)
_TEXT_FIELDS = ("content", "tools")


def _contents(messages: list[dict[str, Any]]) -> Iterator[str]:
    return (m[field] for m in messages for field in _TEXT_FIELDS if isinstance(m.get(field), str))


def _split_content_specials(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    pattern: re.Pattern[str],
    variables: Mapping[str, Any],
) -> list[tuple[str, bool]]:
    """The prompt's text as segments; True marks special-token text written by content.

    Each content that holds special-token text is rendered as a unique marker wrapped in
    spaces: a template that keeps the spaces uses content verbatim, one that drops them trims
    it (Llama 3's `| trim`), and the content is put back accordingly. The caller checks that
    the segments join to the real rendering, which catches every other rewrite.
    """
    markers: dict[str, str] = {}
    probed = []
    for message in messages:
        for field in _TEXT_FIELDS:
            content = message.get(field)
            if isinstance(content, str) and pattern.search(content):
                marker = f"pgcontent{uuid.uuid4().hex}"
                markers[marker] = content
                message = {**message, field: f" {marker} "}
        probed.append(message)
    template_text = _render(tokenizer, probed, add_generation_prompt, variables)
    split = re.split("( ?(?:" + "|".join(markers) + ") ?)", template_text)
    segments: list[tuple[str, bool]] = []
    for i, piece in enumerate(split):
        if i % 2 == 0:  # the template's own text
            segments.append((piece, False))
            continue
        content = markers[piece.strip()]
        if piece != f" {piece.strip()} ":
            content = content.strip()  # the template trimmed the probe's spaces
        segments += _content_segments(content, pattern)
    return segments


def _content_segments(content: str, pattern: re.Pattern[str]) -> list[tuple[str, bool]]:
    segments: list[tuple[str, bool]] = []
    position = 0
    for match in pattern.finditer(content):
        segments += [(content[position : match.start()], False), (match.group(), True)]
        position = match.end()
    return [*segments, (content[position:], False)]


def _merge_text(segments: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    # Join neighbouring ordinary text: the tokenizer splits text only at special tokens, so
    # the template's markup and the content around it must be encoded in one call, as before.
    merged: list[tuple[str, bool]] = []
    for segment, is_special in segments:
        if merged and not is_special and not merged[-1][1]:
            merged[-1] = (merged[-1][0] + segment, False)
        elif segment:
            merged.append((segment, is_special))
    return merged
