"""Chat templates rendered as transformers' `apply_chat_template(tokenize=False)` renders them,
with jinja2 alone.

Why not through transformers: importing it scans its ~560 model folders and checks its
dependencies' versions (0.6-1.0 s of every start on a 2-vCPU machine), for what is a Jinja
environment and a few helpers. Templates come from the Hub and are untrusted code, so the
environment is the same immutable sandbox with the same globals and filters
(`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, a `dict` and a
`namespace` that reject underscore names, loop controls, and `{% generation %}` blocks, which
render their body). The inputs are prepared the same way too: keys whose value is None are
dropped from each message, anything that is not plain JSON data becomes an inert placeholder,
and a message's reasoning is offered under the names templates read. A test renders every
template we hold with both and compares the strings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning goes under; the first is the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# What `render_chat_template` sets itself; no other variable may take these names.
RENDERER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    variables: Mapping[str, Any] | None = None,
) -> str:
    """The template's text for `messages`; `variables`: more of the template's own (a tool
    list under another name, a client's `chat_template_kwargs` such as `enable_thinking`),
    over the special tokens as transformers puts them. Raises jinja2.TemplateError when the
    template refuses them (`raise_exception`) or cannot be parsed."""
    chat = [
        {key: value for key, value in dict(message).items() if value is not None}
        for message in messages
    ]
    context = {**_plain(dict(special_tokens)), **_plain(dict(variables or {}))}
    compiled = _compiled(template)
    try:
        return compiled.render(
            **context,
            messages=_with_reasoning_aliases(_plain(chat)),
            tools=_plain(list(tools)) if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )
    except (TypeError, ValueError, ArithmeticError, LookupError) as exc:
        # the template's own operations on a client's values ("Date: " + a number sent as
        # `date_string`): the request's fault, reported as the template refusing it
        raise jinja2.TemplateError(f"{type(exc).__name__}: {exc}") from exc


def default_template(chat_template: str | dict[str, str] | None) -> str | None:
    """The one template served: a tokenizer may hold named templates (a few older models:
    `default` and `tool_use`), of which the default."""
    if isinstance(chat_template, dict):
        return chat_template.get("default")
    return chat_template


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment.from_string(template)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks an assistant's tokens for training
    masks; rendering keeps its body as it is."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's own attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in a template, without the type's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore names (a way to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )


def _plain(value: Any) -> Any:
    """Plain JSON data only (subclasses of str and numbers become their base type); anything
    else becomes a placeholder naming its type, whose methods the sandbox cannot judge."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    aliased = []
    for message in chat:
        reasoning = next(
            (message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased
