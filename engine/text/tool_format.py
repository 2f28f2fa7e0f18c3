"""Tool calls in the format the served model was trained to write, chosen once from its
chat template (`tool_format_of`):

- `HERMES`: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per
  call (Qwen2.5/3, SmolLM3, Hermes; and every template that takes no tools, see below);
- `LLAMA3_JSON`: the bare object `{"name": ..., "parameters": {...}}`, calls separated by
  "; " (Llama 3.1/3.2/3.3's templates ask for it and render past calls that way);
- `PHI4_MINI`: one JSON list of `{"name": ..., "arguments": {...}}` objects after the word
  `functools`: `functools[{...}, {...}]` (Phi-4-mini, trained on it);
- `MISTRAL` and `GRANITE`: the same list after `[TOOL_CALLS]` (Mistral 7B v0.3, Nemo,
  Ministral 8B) or `<|tool_call|>` (Granite 3.x), tags their tokenizers hold as special
  tokens;
- `MISTRAL_ARGS`: `[TOOL_CALLS]name[ARGS]{...}` a call, the name outside the object
  (Ministral 3, Devstral);
- `MISTRAL_CALL_ID`: `[TOOL_CALLS]name[CALL_ID]a1b2c3d4e[ARGS]{...}`, the call's nine-character
  id between them, written by the model (Mistral Small 3.2).

How the tools reach the prompt is the template's own way too (`tool_prompt_of`):
- `ARGUMENT`: templates that take `tools` get them and render the conversation themselves;
- `SYSTEM_FIELD`: Phi-4-mini's template reads a `tools` field of the system message (JSON
  text it writes between `<|tool|>` tags) and writes every turn's content verbatim: the
  tools go in that field, and past calls are written into the assistant's content in the
  format the model writes them;
- `DESCRIBED`: for a template without tool support (SmolLM2's ChatML, for one) the tools
  are described in the system turn in Hermes' words, an assistant turn's calls are written
  back in the same tags, and a tool result becomes a user turn in `<tool_response>` tags.

A format's `grammar` makes the calls a grammar (so `required` and a named function produce
valid calls from the first token), and its `parse` reads them back out of the generated text.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser

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


ARGUMENT, SYSTEM_FIELD, DESCRIBED = "argument", "system field", "described"
# Phi-4-mini's model card writes its tools under this system prompt
SYSTEM_FIELD_PROMPT = "You are a helpful assistant with some tools."
# The variables templates read their tools from: SmolLM3's takes `xml_tools`, and never
# reads `tools` (tools passed under that name would vanish)
TOOL_ARGUMENTS = ("tools", "xml_tools")


@dataclass(frozen=True, slots=True)
class ToolPrompt:
    """How a chat template takes tools (`how`: `ARGUMENT`, under the variable `argument`;
    `SYSTEM_FIELD`; or `DESCRIBED`, module docstring) and whether it renders an assistant
    message's `tool_calls` itself (`reads_calls`; one that does not would drop them: they
    are written into the message's content instead, as the model writes them)."""

    how: str
    argument: str = "tools"
    reads_calls: bool = False

    @property
    def words(self) -> str:
        """What the start-up line says of it."""
        if self.how == ARGUMENT:
            return f"the template renders the tools (as `{self.argument}`)"
        if self.how == SYSTEM_FIELD:
            return "tools in the system message's tools field"
        return "tools described in the system turn"


@functools.lru_cache(maxsize=8)
def tool_prompt_of(chat_template: str | None) -> ToolPrompt:
    """How tools reach the prompt through this template: `ARGUMENT` when it reads a
    top-level tools variable (`TOOL_ARGUMENTS`), `SYSTEM_FIELD` when it reads a message's
    `tools` field instead (`message['tools']`, Phi-4-mini), `DESCRIBED` otherwise. Naming the
    word is not enough: a template that merely prints "tools" takes none."""
    if chat_template is None:
        return ToolPrompt(DESCRIBED)
    try:
        parsed = _TEMPLATE_PARSER.parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return ToolPrompt(DESCRIBED)  # nor would transformers render it
    variables = jinja2.meta.find_undeclared_variables(parsed)
    fields = {
        name
        for node in parsed.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem))
        if (name := _field_name(node)) is not None
    }
    reads_calls = "tool_calls" in fields
    for argument in TOOL_ARGUMENTS:
        if argument in variables:
            return ToolPrompt(ARGUMENT, argument, reads_calls)
    if "tools" in fields:
        return ToolPrompt(SYSTEM_FIELD, reads_calls=reads_calls)
    return ToolPrompt(DESCRIBED, reads_calls=reads_calls)


def _field_name(node: jinja2.nodes.Node) -> str | None:
    """The name `x.name` or `x['name']` reads."""
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        value = node.arg.value
        return value if isinstance(value, str) else None
    return None


class _GenerationBlocks(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's
    text for training masks), parsed as the body it wraps."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a set)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


# Parsing only (nothing is rendered with it), with the tags HF templates may use.
_TEMPLATE_PARSER = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _GenerationBlocks])


def conversation_for_template(
    chat_template: str | None,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the conversation, the template's variables holding the tools) to render through
    `chat_template`, in the template's own way of taking tools and calls (`tool_prompt_of`):
    the messages as they are when no tools or calls are in it."""
    conversation = [dict(message) for message in messages]
    has_tool_turns = any(m.get("tool_calls") or m.get("role") == "tool" for m in conversation)
    if not tools and not has_tool_turns:
        return conversation, {}
    prompt = tool_prompt_of(chat_template)
    if prompt.how == DESCRIBED:
        return messages_for_template(conversation, tools or []), {}
    tool_format = tool_format_of(chat_template)
    if prompt.reads_calls:
        conversation = with_argument_objects(conversation, tool_format.call_id_length)
    else:
        conversation = with_calls_written(conversation, tool_format)
    if prompt.how == SYSTEM_FIELD:
        return with_system_tools(conversation, tools or []), {}
    if not tools:
        return conversation, {}
    if prompt.argument == "tools":
        return conversation, {"tools": [dict(tool) for tool in tools]}
    # SmolLM3's template prints each of its `xml_tools` as its model card passes them: the
    # function objects
    return conversation, {prompt.argument: [dict(tool.get("function", tool)) for tool in tools]}


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


def with_calls_written(
    messages: Sequence[Mapping[str, Any]], tool_format: ToolFormat
) -> list[dict[str, Any]]:
    """The conversation for a template that renders only an assistant message's content
    (Phi-4-mini's, SmolLM3's): its calls written into the content after its text, as the
    model writes them, every content a string."""
    converted = []
    for message in messages:
        calls = message.get("tool_calls") or []
        content = message.get("content") or ""
        if calls:
            content = "\n".join(filter(None, [content, tool_format.written(calls)]))
        converted.append(
            {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
        )
    return converted


def with_system_tools(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation for a template that reads the system message's `tools` field
    (Phi-4-mini): the tools' function objects as JSON text in that field, under the
    conversation's system message or the model card's own."""
    converted = [dict(message) for message in messages]
    if not tools:
        return converted
    described = json.dumps([tool.get("function", tool) for tool in tools])
    if converted and converted[0]["role"] == "system":
        converted[0] = {**converted[0], "tools": described}
    else:
        converted.insert(0, {"role": "system", "content": SYSTEM_FIELD_PROMPT, "tools": described})
    return converted


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    content = message.get("content") or ""
    if message.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls") or []
    written = HERMES.written(calls) if calls else ""
    return {"role": message["role"], "content": "\n".join(filter(None, [content, written]))}


def with_argument_objects(
    messages: Sequence[Mapping[str, Any]], call_id_length: int = 0
) -> list[dict[str, Any]]:
    """The conversation for a template that takes tools: each assistant call's `arguments`
    as the object, not OpenAI's JSON text of it. Hugging Face templates take objects and
    write them with `tojson` (Llama 3.x's would write JSON text as one quoted string).
    `call_id_length`: the ids the template takes (`ToolFormat.call_id_length`): each call's
    id and each tool result's `tool_call_id` become such an id, the same for the same one."""
    converted = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            message["tool_calls"] = [
                {
                    **call,
                    "function": {**call["function"], "arguments": _args(call)},
                    **({"id": _call_id(call["id"], call_id_length)} if "id" in call else {}),
                }
                for call in calls
            ]
        if call_id_length and isinstance(message.get("tool_call_id"), str):
            message["tool_call_id"] = _call_id(message["tool_call_id"], call_id_length)
        converted.append(message)
    return converted


def _call_id(call_id: str, length: int) -> str:
    """`call_id` as `length` alphanumeric characters (itself if it is one already, else a
    digest of it: the same id always maps to the same); 0: as it is."""
    if not length or (len(call_id) == length and call_id.isascii() and call_id.isalnum()):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:length]


def _args(call: Mapping[str, Any]) -> Any:
    arguments = call["function"].get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


@dataclass(frozen=True)
class ToolFormat:
    """How the model writes its calls: each call's JSON object (`arguments_key` holds the
    arguments) inside `opener` ... `closer`, calls joined by `separator`, all of them inside
    `list_opener` ... `list_closer` (Phi-4-mini's `functools[` ... `]`). A text answer never
    starts with `text_guard` (a call's first character, or the word that opens the list):
    that is how the grammar tells text from calls, and a stream as soon as it can
    (gateway/tool_stream.py)."""

    name: str
    opener: str
    closer: str
    separator: str
    arguments_key: str
    text_guard: str
    list_opener: str = ""
    list_closer: str = ""
    # The markup a tokenizer may hold as one added token (Qwen's `<tool_call>`, Mistral's
    # `[TOOL_CALLS]`)
    tags: tuple[str, ...] = ()
    # Those of `tags` that are one added token of the served tokenizer, with its id: the
    # grammar names that token, as the model writes it and as the tokenizer encodes the
    # opening put in the prompt (written as a string, the grammar would make it spell the tag
    # out and refuse the token); and the answer's text keeps it where it is a special token
    token_tags: tuple[tuple[str, int], ...] = ()
    # The length of the call ids the template takes in past turns (Mistral's refuse any but
    # nine alphanumeric characters); 0: any
    call_id_length: int = 0
    # Set: a call is `opener`, the function's name, this tag and the arguments' JSON object
    # (Ministral 3's `[TOOL_CALLS]get_weather[ARGS]{...}`), not one object holding both
    arguments_tag: str = ""
    # Set (with `arguments_tag`): the call's id stands between its name and `arguments_tag`
    # behind this tag, `call_id_length` letters and digits the model writes itself (Mistral
    # Small 3.2's `[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{...}`)
    id_tag: str = ""

    def starts_calls(self, text: str) -> bool | None:
        """Whether an answer that starts with `text` is calls; None while it cannot tell
        (`text` is blank or a start of `text_guard`)."""
        start = text.lstrip()
        if start.startswith(self.text_guard):
            return True
        return None if self.text_guard.startswith(start) else False

    def written(self, calls: Sequence[Mapping[str, Any]]) -> str:
        """OpenAI tool calls (`{"function": {"name", "arguments"}}`) as the model writes
        them: how a past assistant turn's calls go back into a prompt."""
        objects = [
            self.opener
            + (
                c["function"]["name"]
                + self._id_written(str(c.get("id") or "call"))
                + self.arguments_tag
                + json.dumps(_args(c))
                if self.arguments_tag
                else json.dumps({"name": c["function"]["name"], self.arguments_key: _args(c)})
            )
            + self.closer
            for c in calls
        ]
        return self.list_opener + self.separator.join(objects) + self.list_closer

    def _id_written(self, call_id: str) -> str:
        """A call's id part in the `id_tag` shape, the id in the template's own form ("" in
        the formats without one)."""
        return self.id_tag + _call_id(call_id, self.call_id_length) if self.id_tag else ""

    @property
    def _id_rule(self) -> str:
        """What follows a name and `id_tag` in the grammar up to the arguments' object: an id
        of the model's own, then the arguments' tag."""
        return f"/[a-zA-Z0-9]{{{self.call_id_length}}}/ {self._lark(self.arguments_tag)}"

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
        if self.arguments_tag:
            return self._tagged_grammar(tools, is_required, parallel, answer)
        schemas, defs = [], {}
        for tool in tools:
            name = tool["function"]["name"]
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
        one = f"call ({self._lark(self.separator)} call)*" if parallel else "call"
        calls = _sequence(self._lark(self.list_opener), one, self._lark(self.list_closer))
        call = _sequence(self._lark(self.opener), f"%json {call_schema}", self._lark(self.closer))
        return self._with_start(f"calls: {calls}\ncall: {call}\n", is_required, answer)

    def _tagged_grammar(
        self,
        tools: Sequence[Mapping[str, Any]],
        is_required: bool,
        parallel: bool,
        answer: GrammarSpec | None,
    ) -> GrammarSpec:
        """`grammar` for calls whose name stands before `arguments_tag` (`arguments_tag`):
        one alternative a tool, its name and its arguments' own schema."""
        alternatives = []
        for tool in tools:
            parameters = tool["function"].get("parameters") or {"type": "object"}
            arguments = json.dumps({**parameters, **_COMPACT})
            if self.id_tag:
                name = f"{self._lark(tool['function']['name'] + self.id_tag)} {self._id_rule}"
            else:
                name = self._lark(tool["function"]["name"] + self.arguments_tag)
            alternatives.append(f"{name} %json {arguments}")
        calls = "call+" if parallel else "call"
        call = _sequence(self._lark(self.opener), "named", self._lark(self.closer))
        rules = f"calls: {calls}\ncall: {call}\nnamed: {' | '.join(alternatives)}\n"
        return self._with_start(rules, is_required, answer)

    def _with_start(self, rules: str, is_required: bool, answer: GrammarSpec | None) -> GrammarSpec:
        """The `calls` rules as the whole answer, or beside a text or JSON answer."""
        if is_required:
            start = "start: calls\n"
        elif answer is not None:
            assert answer.kind == "json_schema", answer.kind
            start = f"start: answer | calls\nanswer: %json {answer.source}\n"
        else:
            start = f"start: TEXT | calls\nTEXT: /{_not_starting_with(self.text_guard)}/\n"
        return GrammarSpec("lark", start + rules)

    def _named_grammar(self, tools: Sequence[Mapping[str, Any]], only: str) -> GrammarSpec:
        [parameters] = [
            tool["function"].get("parameters") or {"type": "object"}
            for tool in tools
            if tool["function"]["name"] == only
        ]
        arguments = json.dumps({**parameters, **_COMPACT})
        return GrammarSpec("lark", f"start: {self._lark(self.opening(only))} %json {arguments}\n")

    def _lark(self, text: str) -> str:
        """`text` as a Lark sequence: strings, and each token tag as its token (by id)."""
        ids = dict(self.token_tags)
        parts = [text]
        for tag in ids:
            parts = [piece for part in parts for piece in _split_keeping(part, tag)]
        return " ".join(
            f"<[{ids[part]}]>" if part in ids else json.dumps(part) for part in parts if part
        )

    def reader(
        self, only: str | None, is_required: bool, opening_in_prompt: bool = True
    ) -> CallReader:
        """How an answer under `grammar(tools, only, is_required, ...)` is read for calls:
        with `is_required`, the start every answer has (`opening`) is in the prompt (unless
        not `opening_in_prompt`: a thinking model's, whose grammar writes it after the think
        block), and a named function's call ends where its arguments do (its closing is not
        generated)."""
        if not is_required:
            return CallReader(self)
        ends = self.closer + self.list_closer  # after the arguments' object
        closing = (ends if self.arguments_tag else "}" + ends) if only is not None else ""
        if opening_in_prompt:
            return CallReader(self, self.opening(only), closing)
        return CallReader(self, "", closing, written=self.opening(only))

    def opening(self, only: str | None) -> str:
        """What `grammar(..., only, is_required=True)` makes every answer start with: the
        opening tag and `{"name":"`, and with a named function its name and the arguments
        key, in the grammar's compact JSON. The gateway puts it in the prompt (as vLLM
        constrains a named call to its arguments alone): it is no decode step and no share
        of max_tokens, and the grammar reads it there (`SamplingParams`'
        `num_grammar_prompt_tokens`)."""
        if self.arguments_tag:  # the tag, then the name and its own tag (and an id: ours)
            start = self.list_opener + self.opener
            if only is None:
                return start
            return f"{start}{only}{self._id_written(only)}{self.arguments_tag}"
        start = f'{self.list_opener}{self.opener}{{"name":"'
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
        # After an opening tag (Hermes' `<tool_call>`, Phi-4-mini's `functools[`) anything
        # is call markup; a bare object is one only once it starts as a call does (a JSON
        # answer starts with "{" too)
        if is_cut and rest is not None and (self._tag or _starts_a_call(rest)):
            cut = (
                _cut_tagged_call(rest, self.arguments_tag, self.id_tag)
                if self.arguments_tag
                else _cut_call(rest, self.arguments_key)
            )
            return kept.strip() or None, calls + ([cut] if cut is not None else [])
        if is_cut and self._tag and (calls or self.starts_calls(text) is not False):
            kept = _without_partial_tag(kept, self._tag)  # cut inside the tag
            if calls or not kept.strip():
                return kept.strip() or None, calls
        if not calls:
            return text, []
        return (kept + (rest or "")).strip() or None, calls

    @property
    def _tag(self) -> str:
        """The text that opens calls ("" for bare objects)."""
        return (self.list_opener or self.opener).strip()

    def _split(self, text: str) -> tuple[list[ParsedToolCall], str, str | None]:
        """(the whole calls, the text outside them, what follows the opening of a call that
        does not end: the call being written, or None)."""
        if self.arguments_tag:
            return self._split_tagged(text)
        if self.list_opener:
            return self._split_list(text)
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
        calls, position = self._bare_calls(text, 0)
        tail = text[position:]
        if tail.startswith("{"):
            return calls, "", tail
        return calls, tail, None

    def _split_list(self, text: str) -> tuple[list[ParsedToolCall], str, str | None]:
        """The calls of the list after `list_opener` (blanks allowed before its bracket:
        Mistral 7B writes `[TOOL_CALLS] [`), wherever it starts; the text before it and
        after the list's closer is kept. A list that does not close (the output ended in
        it) gives what follows its last whole call as the call being written."""
        word, bracket = self.list_opener[:-1], self.list_opener[-1]
        opened = re.search(re.escape(word) + r"\s*" + re.escape(bracket), text)
        if opened is None:
            return [], text, None
        before = text[: opened.start()]
        calls, position = self._bare_calls(text, opened.end())
        tail = text[position:]
        if tail.startswith(self.list_closer):
            return calls, before + tail[len(self.list_closer) :], None
        if not tail or tail.startswith("{"):
            return calls, before, tail
        return calls, before + tail, None

    def _split_tagged(self, text: str) -> tuple[list[ParsedToolCall], str, str | None]:
        """Calls as `opener` name `arguments_tag` {arguments}, one after another from the
        first opener on; the text before it and after the last call is kept. A call whose
        arguments do not end (or whose tag was not written yet) is the call being written."""
        tag = self._tag
        opened = text.find(tag)
        if opened == -1:
            return [], text, None
        calls: list[ParsedToolCall] = []
        position = opened
        decoder = json.JSONDecoder()
        while text.startswith(tag, position):
            body = text[position + len(tag) :]
            named = body.find(self.arguments_tag)
            if named == -1:
                return calls, text[:opened], body
            name = (
                body[:named].partition(self.id_tag)[0].strip()
                if self.id_tag
                else body[:named].strip()
            )
            start = position + len(tag) + named + len(self.arguments_tag)
            start += len(text[start:]) - len(text[start:].lstrip())
            try:
                value, end = decoder.raw_decode(text, start)
            except json.JSONDecodeError:
                return calls, text[:opened], body
            if not name or not isinstance(value, dict):
                break
            calls.append(ParsedToolCall(name, json.dumps(value)))
            position = end + len(text[end:]) - len(text[end:].lstrip())
        if not calls:
            return [], text, None
        return calls, text[:opened] + text[position:], None

    def _bare_calls(self, text: str, position: int) -> tuple[list[ParsedToolCall], int]:
        """The calls written as bare objects joined by the separator from `position` on,
        and where what follows them starts (blanks skipped)."""
        decoder = json.JSONDecoder()
        calls: list[ParsedToolCall] = []
        position += len(text[position:]) - len(text[position:].lstrip())
        while position < len(text):
            try:
                value, end = decoder.raw_decode(text, position)
            except json.JSONDecodeError:
                break
            call = _call_from(value, self.arguments_key)
            if call is None:
                break
            calls.append(call)
            stripped = text[end:].lstrip()
            if stripped.startswith(self.separator.strip()):
                stripped = stripped[len(self.separator.strip()) :].lstrip()
            position = len(text) - len(stripped)
        return calls, position


@dataclass(frozen=True, slots=True)
class CallReader:
    """How one request's output is read for calls (`ToolFormat.reader`): the served model's
    format; the `opening` its grammar forces, which the prompt holds ("" when the model may
    answer in text, or thinks first: then `written` is that opening, which the output holds
    once the call has started); the `closing` a named call's grammar leaves out. The text
    read is the opening, the output, and the closing unless the length limit cut the output
    or it ended before its call started (a stop inside a think block)."""

    tool_format: ToolFormat
    opening: str = ""
    closing: str = ""
    written: str = ""

    def parse(self, output: str, is_cut: bool = False) -> tuple[str | None, list[ParsedToolCall]]:
        return self.tool_format.parse(self.text(output, is_cut), is_cut)

    def text(self, output: str, is_cut: bool) -> str:
        closes = not is_cut and (not self.written or self.written in output)
        return self.opening + output + (self.closing if closes else "")


HERMES = ToolFormat(
    "hermes", OPEN + "\n", "\n" + CLOSE, "\n", "arguments", text_guard="<", tags=(OPEN, CLOSE)
)
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "; ", "parameters", text_guard="{")
PHI4_MINI = ToolFormat(
    "phi4_mini", "", "", ", ", "arguments", "functools[", list_opener="functools[", list_closer="]"
)
MISTRAL = ToolFormat(
    "mistral",
    "",
    "",
    ", ",
    "arguments",
    text_guard="[TOOL_CALLS]",
    list_opener="[TOOL_CALLS][",
    list_closer="]",
    tags=("[TOOL_CALLS]",),
    call_id_length=9,
)
MISTRAL_ARGS = ToolFormat(
    "mistral_args",
    "[TOOL_CALLS]",
    "",
    "",
    "arguments",
    text_guard="[TOOL_CALLS]",
    tags=("[TOOL_CALLS]", "[ARGS]"),
    arguments_tag="[ARGS]",
)
MISTRAL_CALL_ID = ToolFormat(
    "mistral_call_id",
    "[TOOL_CALLS]",
    "",
    "",
    "arguments",
    text_guard="[TOOL_CALLS]",
    tags=("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"),
    call_id_length=9,
    arguments_tag="[ARGS]",
    id_tag="[CALL_ID]",
)
GRANITE = ToolFormat(
    "granite",
    "",
    "",
    ", ",
    "arguments",
    text_guard="<|tool_call|>",
    list_opener="<|tool_call|>[",
    list_closer="]",
    tags=("<|tool_call|>",),
)


def tool_format_of(
    chat_template: str | None, added_tokens: Mapping[str, int] | None = None
) -> ToolFormat:
    """The format the model's template teaches: Llama 3.x's templates ask for bare objects
    with "parameters" and return results in an `ipython` turn; Mistral's (7B v0.3, Nemo,
    Ministral 8B) write past calls as one `[TOOL_CALLS][...]` list and their later ones
    (Ministral 3, Devstral) as `[TOOL_CALLS]name[ARGS]{...}`, Granite 3's ask for one
    `<|tool_call|>[...]` list; Mistral Small 3.2's put a `[CALL_ID]` and an id between a
    call's name and its `[ARGS]`; a template that reads
    the system message's `tools` field is Phi-4-mini's; every other template (and our own
    system prompt, for templates that take no tools) speaks Hermes.
    `added_tokens`: the tokenizer's added tokens and their ids, which tags are
    (`ToolFormat.token_tags`)."""
    chosen = _template_format(chat_template)
    added = added_tokens or {}
    tags = tuple((tag, added[tag]) for tag in chosen.tags if tag in added)
    return replace(chosen, token_tags=tags) if tags else chosen


@functools.lru_cache(maxsize=8)
def _template_format(chat_template: str | None) -> ToolFormat:
    """`tool_format_of` before the tokenizer's tags: read once a template (every prompt with
    tools asks)."""
    how = tool_prompt_of(chat_template).how
    if how == SYSTEM_FIELD:
        return PHI4_MINI
    if how != ARGUMENT or chat_template is None:
        return HERMES
    if '"parameters"' in chat_template and "ipython" in chat_template:
        return LLAMA3_JSON
    if "[TOOL_CALLS][" in chat_template and "[ARGS]" not in chat_template:
        return MISTRAL
    if "[TOOL_CALLS]" in chat_template and "[ARGS]" in chat_template:
        return MISTRAL_CALL_ID if "[CALL_ID]" in chat_template else MISTRAL_ARGS
    if "<|tool_call|>" in chat_template:
        return GRANITE
    return HERMES


def _sequence(*parts: str) -> str:
    """Lark items in order, the empty ones left out."""
    return " ".join(part for part in parts if part)


def _not_starting_with(guard: str) -> str:
    """A regular expression of the non-empty texts that do not start with `guard`: those
    that leave it at some character, and its proper starts (an answer may end there)."""
    leaving = [
        f"{_regex_text(guard[:i])}[^{_regex_text(guard[i])}](.|\\n)*" for i in range(len(guard))
    ]
    starts = [_regex_text(guard[:i]) for i in range(1, len(guard))]
    return "|".join(leaving + starts)


def _regex_text(text: str) -> str:
    """`text` matched literally inside a Lark /.../ regular expression."""
    return re.escape(text).replace("/", "\\/")


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


def _cut_tagged_call(body: str, arguments_tag: str, id_tag: str = "") -> ParsedToolCall | None:
    """The call a text cut at the length limit was writing, in the `arguments_tag` shape
    (`body`: what follows its opener): its name and the arguments written so far, or None
    when its name was not whole (its tag, or `id_tag`, not written yet)."""
    if id_tag:
        name, tagged, rest = body.partition(id_tag)
        arguments = rest.partition(arguments_tag)[2]
    else:
        name, tagged, arguments = body.partition(arguments_tag)
    if not tagged or not name.strip():
        return None
    arguments = arguments.strip()
    try:
        value, _ = json.JSONDecoder().raw_decode(arguments)
    except json.JSONDecodeError:
        return ParsedToolCall(name.strip(), arguments, is_complete=False)
    if not isinstance(value, dict):
        return ParsedToolCall(name.strip(), arguments, is_complete=False)
    return ParsedToolCall(name.strip(), json.dumps(value))


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
