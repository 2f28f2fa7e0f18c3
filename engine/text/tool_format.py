"""Tool calling in one format: the model writes each call as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (the Hermes / Qwen layout).

Chat templates that take `tools` get them and render the conversation themselves; for a
template without tool support (SmolLM2's ChatML, for one) the tools are described in the
system turn below, an assistant turn's calls are written back in the same tags, and a tool
result becomes a user turn wrapped in `<tool_response>` tags. `tool_call_grammar` makes the
calls a grammar (so `required` and a named function produce valid calls from the first
token), and `parse_tool_calls` reads them back out of the generated text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.core.sampling_params import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(\{.*?\})\s*" + re.escape(CLOSE), re.DOTALL)
SYSTEM_TOOLS_PROMPT = (
    "You may call these functions:\n<tools>\n{tools}\n</tools>\nTo call one, answer with "
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as the API returns it


def template_takes_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


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


def _args(call: Mapping[str, Any]) -> Any:
    arguments = call["function"].get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]],
    only: str | None,
    is_required: bool,
    parallel: bool,
    answer: GrammarSpec | None = None,
) -> GrammarSpec:
    """Calls as a grammar: one call (several if `parallel`) of any tool, or of `only`; when
    not `is_required` the model may instead answer in text that does not start with '<', or,
    given an `answer` JSON schema (the request's response format), in JSON of that schema:
    an agent with tools and a structured final output gets either a call or its output."""
    schemas, defs = [], {}
    for tool in tools:
        name = tool["function"]["name"]
        if only is not None and name != only:
            continue
        parameters = dict(tool["function"].get("parameters") or {"type": "object"})
        # Pydantic-made schemas refer to "#/$defs/...": the definitions move to the root of
        # the call's schema, where those references resolve.
        defs.update(parameters.pop("$defs", {}))
        schemas.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "arguments": parameters,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    compact = {"x-guidance": {"whitespace_flexible": False}}  # as for response_format
    one_of = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    call_schema = json.dumps({**one_of, **compact, **({"$defs": defs} if defs else {})})
    calls = 'call ("\\n" call)*' if parallel else "call"
    lark = f'calls: {calls}\ncall: "{OPEN}\\n" %json {call_schema} "\\n{CLOSE}"\n'
    if is_required:
        start = "start: calls\n"
    elif answer is not None:
        assert answer.kind == "json_schema", answer.kind
        start = f"start: answer | calls\nanswer: %json {answer.source}\n"
    else:
        start = "start: TEXT | calls\nTEXT: /[^<](.|\\n)*/\n"
    return GrammarSpec("lark", start + lark)


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(the text outside the calls, or None if nothing is left; the calls in order). A
    tagged block that is not a JSON object with a name stays in the text."""
    calls: list[ParsedToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _CALL.finditer(text):
        call = _call_of(match.group(1))
        if call is None:
            continue
        kept.append(text[position : match.start()])
        calls.append(call)
        position = match.end()
    kept.append(text[position:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _call_of(body: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return ParsedToolCall(value["name"], json.dumps(value.get("arguments", {})))
