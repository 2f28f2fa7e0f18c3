"""Tool calls in the format the served model was trained to write, chosen once from its
chat template (`tool_format_of`):

- `HERMES`: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per
  call (Qwen2.5/3, SmolLM3, Hermes; and every template that takes no tools, see below);
- `LLAMA3_JSON`: the bare object `{"name": ..., "parameters": {...}}`, calls separated by
  "; " (Llama 3.1/3.2/3.3's templates ask for it and render past calls that way).

Chat templates that take `tools` get them and render the conversation themselves; for a
template without tool support (SmolLM2's ChatML, for one) the tools are described in the
system turn in Hermes' words, an assistant turn's calls are written back in the same tags,
and a tool result becomes a user turn wrapped in `<tool_response>` tags. A format's
`grammar` makes the calls a grammar (so `required` and a named function produce valid calls
from the first token), and its `parse` reads them back out of the generated text.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jinja2
import jinja2.meta

from engine.core.sampling_params import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SYSTEM_TOOLS_PROMPT = (
    "You may call these functions:\n<tools>\n{tools}\n</tools>\nTo call one, answer with "
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as the API returns it
    # False: the length limit cut it, `arguments` holds what was written so far
    is_complete: bool = True


@functools.lru_cache(maxsize=8)
def template_takes_tools(chat_template: str | None) -> bool:
    """Whether the template renders the `tools` it is given: whether it reads a top-level
    `tools` variable. Naming the word is not enough: Phi-4-mini's template reads
    `message['tools']` (a system message's field) and ignores the argument, so tools passed
    to it would vanish; it gets them in the system turn like a template that takes none."""
    if chat_template is None:
        return False
    try:
        parsed = _TEMPLATE_PARSER.parse(chat_template)
    except jinja2.TemplateSyntaxError:
        # A tag only transformers' environment knows (`{% generation %}`): the word it is.
        return "tools" in chat_template
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


# Parsing only (nothing is rendered with it), with the loop controls HF templates may use.
_TEMPLATE_PARSER = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])


def messages_for_template(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation for a template without tool support: tools in the system turn,
    assistant calls as tagged text, tool results as tagged user turns."""
    converted = [_plain_message(m) for m in messages]
    if not tools:
        return converted
    described = "\n".join(json.dumps(tool.get("function", tool)) for tool in tools)
    tool_system = SYSTEM_TOOLS_PROMPT.format(tools=described)
    if converted and converted[0]["role"] == "system":
        converted[0] = {"role": "system", "content": f"{converted[0]['content']}\n\n{tool_system}"}
    else:
        converted.insert(0, {"role": "system", "content": tool_system})
    return converted


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    content = message.get("content") or ""
    if message.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls") or []
    written = [
        f"{OPEN}\n"
        + json.dumps({"name": c["function"]["name"], "arguments": _args(c)})
        + f"\n{CLOSE}"
        for c in calls
    ]
    return {"role": message["role"], "content": "\n".join(filter(None, [content, *written]))}


def with_argument_objects(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that takes tools: each assistant call's `arguments`
    as the object, not OpenAI's JSON text of it. Hugging Face templates take objects and
    write them with `tojson` (Llama 3.x's would write JSON text as one quoted string)."""
    converted = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            calls = [
                {**call, "function": {**call["function"], "arguments": _args(call)}}
                for call in calls
            ]
            message = {**message, "tool_calls": calls}
        converted.append(dict(message))
    return converted


def _args(call: Mapping[str, Any]) -> Any:
    arguments = call["function"].get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


@dataclass(frozen=True)
class ToolFormat:
    """How the model writes its calls: each call's JSON object (`arguments_key` holds the
    arguments) inside `opener` ... `closer`, calls joined by `separator`. A text answer never
    starts with `opener`'s first character: that is how a stream tells text from calls as
    soon as it begins (gateway/tool_stream.py)."""

    name: str
    opener: str
    closer: str
    separator: str
    arguments_key: str
    # The tags (the opener's and closer's text, stripped) that are one added token of the
    # served tokenizer (Qwen's `<tool_call>`): the grammar names that token, as the model
    # writes it and as the tokenizer encodes the opening put in the prompt; written as a
    # string, the grammar would make it spell the tag out and refuse the token
    token_tags: frozenset[str] = frozenset()

    @property
    def first_char(self) -> str:
        return self.opener[0] if self.opener else "{"

    def grammar(
        self,
        tools: Sequence[Mapping[str, Any]],
        only: str | None,
        is_required: bool,
        parallel: bool,
        answer: GrammarSpec | None = None,
    ) -> GrammarSpec:
        """Calls as a grammar: one call (several if `parallel`) of any tool, or of `only`;
        when not `is_required` the model may instead answer in text that does not start as
        a call does, or, given an `answer` JSON schema (the request's response format), in
        JSON of that schema: an agent with tools and a structured final output gets either
        a call or its output. A named function's grammar is its `reader`'s opening and its
        arguments' JSON: the call's closing is the reader's, no decode step."""
        if only is not None:
            return self._named_grammar(tools, only)
        schemas, defs = [], {}
        for tool in tools:
            name = tool["function"]["name"]
            if only is not None and name != only:
                continue
            parameters = dict(tool["function"].get("parameters") or {"type": "object"})
            # Pydantic-made schemas refer to "#/$defs/...": the definitions move to the root
            # of the call's schema, where those references resolve.
            defs.update(parameters.pop("$defs", {}))
            schemas.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, self.arguments_key: parameters},
                    "required": ["name", self.arguments_key],
                    "additionalProperties": False,
                }
            )
        one_of = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        call_schema = json.dumps({**one_of, **_COMPACT, **({"$defs": defs} if defs else {})})
        calls = f"call ({self._lark(self.separator)} call)*" if parallel else "call"
        call = " ".join(
            part
            for part in (
                self._lark(self.opener),
                f"%json {call_schema}",
                self._lark(self.closer),
            )
            if part
        )
        lark = f"calls: {calls}\ncall: {call}\n"
        if is_required:
            start = "start: calls\n"
        elif answer is not None:
            assert answer.kind == "json_schema", answer.kind
            start = f"start: answer | calls\nanswer: %json {answer.source}\n"
        else:
            start = f"start: TEXT | calls\nTEXT: /[^{self.first_char}](.|\\n)*/\n"
        return GrammarSpec("lark", start + lark)

    def _named_grammar(self, tools: Sequence[Mapping[str, Any]], only: str) -> GrammarSpec:
        [parameters] = [
            tool["function"].get("parameters") or {"type": "object"}
            for tool in tools
            if tool["function"]["name"] == only
        ]
        arguments = json.dumps({**parameters, **_COMPACT})
        return GrammarSpec("lark", f"start: {self._lark(self.opening(only))} %json {arguments}\n")

    def _lark(self, text: str) -> str:
        """`text` as a Lark sequence: strings, and each token tag as its token."""
        parts = [text]
        for tag in self.token_tags:
            parts = [piece for part in parts for piece in _split_keeping(part, tag)]
        return " ".join(
            f"<{part[1:-1]}>" if part in self.token_tags else json.dumps(part)
            for part in parts
            if part
        )

    def reader(self, only: str | None, is_required: bool) -> CallReader:
        """How an answer under `grammar(tools, only, is_required, ...)` is read for calls:
        with `is_required`, the start every answer has (`opening`) is in the prompt, and a
        named function's call ends where its arguments do (its closing is not generated)."""
        if not is_required:
            return CallReader(self)
        closing = "}" + self.closer if only is not None else ""
        return CallReader(self, self.opening(only), closing)

    def opening(self, only: str | None) -> str:
        """What `grammar(..., only, is_required=True)` makes every answer start with: the
        opening tag and `{"name":"`, and with a named function its name and the arguments
        key, in the grammar's compact JSON. The gateway puts it in the prompt (as vLLM
        constrains a named call to its arguments alone): it is no decode step and no share
        of max_tokens, and the grammar reads it there (`SamplingParams`'
        `num_grammar_prompt_tokens`)."""
        start = f'{self.opener}{{"name":"'
        if only is None:
            return start
        return f'{start}{only}","{self.arguments_key}":'

    def parse(self, text: str, is_cut: bool = False) -> tuple[str | None, list[ParsedToolCall]]:
        """(the text outside the calls, or None if nothing is left; the calls in order). A
        block that is not a JSON object with a name stays in the text. `is_cut`: the text
        ended at the length limit: a call it was writing comes back with its name and the
        arguments written so far (OpenAI's shape for a call cut by `max_tokens`), and the
        start of one that had no name yet is dropped: call markup never comes back as text."""
        calls, kept, rest = self._split(text)
        # After Hermes' opening tag anything is call markup; a bare object is one only once
        # it starts as a call does (a JSON answer starts with "{" too)
        if is_cut and rest is not None and (self.opener or _starts_a_call(rest)):
            cut = _cut_call(rest, self.arguments_key)
            return kept.strip() or None, calls + ([cut] if cut is not None else [])
        if is_cut and self.opener and (calls or text.lstrip().startswith(self.first_char)):
            kept = _without_partial_tag(kept, self.opener.strip())  # cut inside the tag
            if calls or not kept.strip():
                return kept.strip() or None, calls
        if not calls:
            return text, []
        return (kept + (rest or "")).strip() or None, calls

    def _split(self, text: str) -> tuple[list[ParsedToolCall], str, str | None]:
        """(the whole calls, the text outside them, what follows the opening of a call that
        does not end: the call being written, or None)."""
        if not self.opener:
            return self._split_bare(text)
        tags = re.escape(self.opener.strip()), re.escape(self.closer.strip())
        pattern = re.compile(tags[0] + r"\s*(\{.*?\})\s*" + tags[1], re.DOTALL)
        calls: list[ParsedToolCall] = []
        kept: list[str] = []
        position = 0
        for match in pattern.finditer(text):  # every block holding a call, anywhere
            call = _call_of(match.group(1), self.arguments_key)
            if call is None:
                continue
            kept.append(text[position : match.start()])
            calls.append(call)
            position = match.end()
        tail = text[position:]
        opened = tail.find(self.opener.strip())
        if opened == -1:
            return calls, "".join(kept) + tail, None
        return calls, "".join(kept) + tail[:opened], tail[opened + len(self.opener.strip()) :]

    def _split_bare(self, text: str) -> tuple[list[ParsedToolCall], str, str | None]:
        """Bare objects from the start of the text, joined by the separator; what follows
        the last call is text, or the call being written when it starts as calls do. A text
        that does not start with a call is all text."""
        decoder = json.JSONDecoder()
        calls: list[ParsedToolCall] = []
        position = len(text) - len(text.lstrip())
        while position < len(text):
            try:
                value, end = decoder.raw_decode(text, position)
            except json.JSONDecodeError:
                break
            call = _call_from(value, self.arguments_key)
            if call is None:
                break
            calls.append(call)
            rest = text[end:]
            stripped = rest.lstrip()
            if stripped.startswith(self.separator.strip()):
                stripped = stripped[len(self.separator.strip()) :].lstrip()
            position = len(text) - len(stripped)
        tail = text[position:]
        if tail.startswith(self.first_char):
            return calls, "", tail
        return calls, tail, None


@dataclass(frozen=True, slots=True)
class CallReader:
    """How one request's output is read for calls (`ToolFormat.reader`): the served model's
    format; the `opening` its grammar forces, which the prompt holds ("" when the model may
    answer in text); the `closing` a named call's grammar leaves out. The text read is the
    opening, the output, and the closing unless the length limit cut the output."""

    tool_format: ToolFormat
    opening: str = ""
    closing: str = ""

    def parse(self, output: str, is_cut: bool = False) -> tuple[str | None, list[ParsedToolCall]]:
        return self.tool_format.parse(self.text(output, is_cut), is_cut)

    def text(self, output: str, is_cut: bool) -> str:
        return self.opening + output + ("" if is_cut else self.closing)


HERMES = ToolFormat("hermes", OPEN + "\n", "\n" + CLOSE, "\n", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "; ", "parameters")


def tool_format_of(chat_template: str | None, added_tokens: Collection[str] = ()) -> ToolFormat:
    """The format the model's template teaches: Llama 3.x's templates ask for bare objects
    with "parameters" and return results in an `ipython` turn; every other template (and
    our own system prompt, for templates that take no tools) speaks Hermes. `added_tokens`:
    the tokenizer's added tokens, which tags are (`ToolFormat.token_tags`)."""
    if not template_takes_tools(chat_template) or chat_template is None:
        chosen = HERMES
    else:
        is_llama3 = '"parameters"' in chat_template and "ipython" in chat_template
        chosen = LLAMA3_JSON if is_llama3 else HERMES
    tags = {chosen.opener.strip(), chosen.closer.strip()} & set(added_tokens)
    return replace(chosen, token_tags=frozenset(tags)) if tags else chosen


def _split_keeping(text: str, tag: str) -> list[str]:
    """`text` split around each `tag`, the tags kept as pieces of their own."""
    pieces = text.split(tag)
    return [x for i, piece in enumerate(pieces) for x in ((tag, piece) if i else (piece,))]


# The calls' JSON without optional whitespace, as for response_format
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def _call_of(body: str, arguments_key: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_from(value, arguments_key)


_CUT_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"(.*)', re.DOTALL)
_CUT_ARGUMENTS = re.compile(r'\s*,\s*"(\w+)"\s*:\s*(.*)', re.DOTALL)


def _without_partial_tag(text: str, tag: str) -> str:
    """`text` without a start of `tag` it ends with (a tag the length limit cut)."""
    for length in range(len(tag) - 1, 0, -1):
        if text.endswith(tag[:length]):
            return text[:-length]
    return text


def _starts_a_call(body: str) -> bool:
    """`body` is, or begins, `{"name"`: the start of a call's object."""
    compact = re.sub(r"\s+", "", body)
    return compact.startswith('{"name"') or '{"name"'.startswith(compact)


def _cut_call(body: str, arguments_key: str) -> ParsedToolCall | None:
    """The call a text cut at the length limit was writing: its name and the arguments
    written so far ("" before any; the whole object when only the call's closing was cut),
    or None when its name was not whole."""
    named = _CUT_NAME.match(body)
    if named is None:
        return None
    name = json.loads(f'"{named.group(1)}"')
    keyed = _CUT_ARGUMENTS.match(named.group(2))
    if keyed is None or keyed.group(1) not in (arguments_key, "arguments"):
        return ParsedToolCall(name, "", is_complete=False)
    arguments = keyed.group(2)
    try:
        value, _ = json.JSONDecoder().raw_decode(arguments)
    except json.JSONDecodeError:
        return ParsedToolCall(name, arguments.rstrip(), is_complete=False)
    if not isinstance(value, dict):
        return ParsedToolCall(name, arguments.rstrip(), is_complete=False)
    return ParsedToolCall(name, json.dumps(value))


def _call_from(value: Any, arguments_key: str) -> ParsedToolCall | None:
    """A call of a JSON value: an object with a string name and its arguments object under
    `arguments_key` (or "arguments", which Llama 3.x also writes at times), or none."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the object as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments))
