"""engine.text.tool_format: reading calls back out of generated text, and the call grammar."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from engine import GrammarSpec, SamplingParams
from engine.structured.grammar import GrammarCompiler
from engine.text.tool_format import ParsedToolCall, parse_tool_calls, tool_call_grammar
from tests.helpers import tiny_engine

PET = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 9}}}
PERSON = {
    "type": "object",
    "properties": {"pet": {"$ref": "#/$defs/Pet"}},
    "required": ["pet"],
    "additionalProperties": False,
    "$defs": {"Pet": {**PET, "required": ["age"], "additionalProperties": False}},
}


def test_calls_and_the_text_around_them() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert parse_tool_calls(text) == ("Let me check.", [ParsedToolCall("f", '{"x": 1}')])
    two = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
    two += '<tool_call>{"name": "g"}</tool_call>'
    expected = [ParsedToolCall("f", "{}"), ParsedToolCall("g", "{}")]
    assert parse_tool_calls(two) == (None, expected)


def test_text_without_valid_calls_stays_text() -> None:
    for text in (
        "Just words.",
        "<tool_call>not json</tool_call>",
        '<tool_call>{"x": 1}</tool_call>',
    ):
        assert parse_tool_calls(text) == (text, [])


def test_the_grammar_resolves_pydantic_defs(tiny_llama_path: Path) -> None:
    """A tool whose parameters use "$defs" (what pydantic writes for nested models)."""
    engine = tiny_engine(tiny_llama_path, max_model_len=256)
    tools = [{"type": "function", "function": {"name": "make", "parameters": PERSON}}]
    grammar = tool_call_grammar(tools, only="make", is_required=True, parallel=False)
    prompt = engine.tokenizer("Make one:")["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=120, grammar=grammar)
    [output] = engine.generate([prompt], params)
    text = engine.tokenizer.decode(output, skip_special_tokens=True)
    content, [call] = parse_tool_calls(text)
    assert content is None and call.name == "make"
    assert 0 <= json.loads(call.arguments)["pet"]["age"] <= 9


def test_an_answer_schema_replaces_free_text(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    """With a response format beside the tools (tool_choice auto), the model may call a tool
    or answer in JSON of the format, and nothing else."""
    compiler = GrammarCompiler(tiny_tokenizer, len(tiny_tokenizer), frozenset({0}))
    tools = [{"type": "function", "function": {"name": "make", "parameters": PERSON}}]
    answer = GrammarSpec.json_schema(
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    )
    grammar = compiler.compile(
        tool_call_grammar(tools, only=None, is_required=False, parallel=False, answer=answer)
    )
    call = '<tool_call>\n{"name":"make","arguments":{"pet":{"age":3}}}\n</tool_call>'

    def accepts(text: str) -> bool:
        matcher = grammar.new_matcher()
        ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        return bool(matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting())

    assert accepts('{"ok": true}')
    assert accepts(call)
    assert not accepts("Sure, here it is.")
    assert not accepts('{"ok": "yes"}')
    free = compiler.compile(tool_call_grammar(tools, only=None, is_required=False, parallel=False))
    matcher = free.new_matcher()
    ids = tiny_tokenizer("Sure, here it is.", add_special_tokens=False)["input_ids"]
    assert matcher.try_consume_tokens(ids) == len(ids)
