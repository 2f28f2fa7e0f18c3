"""Chat templates rendered without transformers give transformers' own strings: real
templates (Llama 3.2, Phi-4-mini, Qwen3) and one that uses every global, filter and tag the
environment offers, over conversations with tools, tool calls, reasoning and None values;
the sandbox refuses what transformers' refuses."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from engine.text.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "templates"
EVERYTHING = (
    "{{ bos_token }}{% set ns = namespace(count=0) %}"
    "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.count = ns.count + 1 %}"
    "{% generation %}{{ m.role }}: {{ m.content | tojson(indent=2) }}{% endgeneration %}\n"
    "{% if m.reasoning_content is defined %}[{{ m.reasoning_content }}|{{ m.thinking }}]"
    "{% endif %}"
    "{% if m.tool_calls is defined %}"
    "{{ m.tool_calls | tojson(sort_keys=True, separators=(',', ':')) }}{% endif %}"
    "{% if m.name is defined %}named {{ m.name }}{% endif %}"
    "{% endfor %}{{ dict(a=1) | tojson }}{{ dict.fromkeys(['x'], 2) | tojson }}"
    "{% if tools %}{{ tools | tojson }}{% endif %}{{ ns.count }}"
    "{{ strftime_now('%Y') }}{% if add_generation_prompt %}<go>{% endif %}{{ eos_token }}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, «quoted» <b>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief. Ünïcödé 日本"},
        {"role": "user", "content": "Weather in Paris?", "name": None},  # None: dropped
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "It said sunny."},
        {"role": "user", "content": "Thanks"},
    ],
]


@pytest.fixture(scope="module")
def tokenizers(tiny_tokenizer: PreTrainedTokenizerFast) -> tuple[Any, Tokenizer]:
    reference = PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer.backend_tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
    )
    return reference, Tokenizer.from_transformers(reference)


@pytest.mark.parametrize(
    "template",
    [EVERYTHING, *(p.read_text() for p in sorted(TEMPLATES.glob("*.jinja")))],
    ids=["everything", *(p.stem for p in sorted(TEMPLATES.glob("*.jinja")))],
)
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one-turn", "tools-and-reasoning"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_a_template_renders_as_transformers_renders_it(
    tokenizers: tuple[Any, Tokenizer],
    template: str,
    conversation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> None:
    reference, ours = tokenizers
    reference.chat_template = ours.chat_template = template
    kwargs: dict[str, Any] = {"tools": tools, "add_generation_prompt": add_generation_prompt}
    try:
        expected = reference.apply_chat_template(conversation, tokenize=False, **kwargs)
    except jinja2.TemplateError as refused:  # Mistral's refuses the "skip" role: so must ours
        with pytest.raises(jinja2.TemplateError, match=re.escape(str(refused))):
            ours.apply_chat_template(conversation, **kwargs)
        return
    assert ours.apply_chat_template(conversation, **kwargs) == expected
    if template == EVERYTHING:  # what the probe template shows of the inputs
        assert expected.startswith("<|endoftext|>") and expected.endswith("<|im_end|>")
        assert "named" not in expected


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{{ raise_exception('no system turns') }}", jinja2.TemplateError),
        ("{% set ns = namespace(_secret=1) %}", jinja2.exceptions.SecurityError),
        ("{% set ns = namespace() %}{% set ns._x = 1 %}", jinja2.exceptions.SecurityError),
        ("{{ messages.__class__.__mro__ }}", jinja2.exceptions.SecurityError),
        ("{{ messages.append(1) }}", jinja2.exceptions.SecurityError),
    ],
)
def test_the_sandbox_refuses_what_transformers_refuses(
    tokenizers: tuple[Any, Tokenizer], template: str, error: type[Exception]
) -> None:
    reference, ours = tokenizers
    reference.chat_template = ours.chat_template = template
    conversation = CONVERSATIONS[0]
    with pytest.raises(error):
        reference.apply_chat_template(conversation, tokenize=False)
    with pytest.raises(error):
        ours.apply_chat_template(conversation)
