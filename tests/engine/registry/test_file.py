"""engine.registry.file: validating prefixes.yaml as a whole and rendering entries to ids."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from engine.core.sampling_params import GrammarSpec
from engine.loading.source import ModelSource, load_tokenizer
from engine.registry.file import load_prefix_file, parse_prefix_text
from engine.registry.spec import PrefixContract, PrefixSpec, RegistryFileError
from engine.text.chat import chat_prompt_ids, text_prompt_ids

REPO_ROOT = Path(__file__).resolve().parents[3]
MAX_MODEL_LEN = 256

VALID_FILE = """\
version: 1
prefixes:
  - name: helper
    description: A short helpful system prompt.
    messages:
      - role: system
        content: You are a helpful assistant.
      - role: user
        content: What is the capital of France?
      - role: assistant
        content: The capital of France is Paris.
  - name: raw.doc_1
    text: "The model reads the prompt."
"""
HELPER_MESSAGES = (
    ("system", "You are a helpful assistant."),
    ("user", "What is the capital of France?"),
    ("assistant", "The capital of France is Paris."),
)
CHATML_LOOP = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Not prefix-stable: appends a token only when the rendering ends on a non-user message.
TRAILING_EOT_TEMPLATE = (
    CHATML_LOOP + "{% if messages[-1]['role'] != 'user' %}{{ '<|endoftext|>' }}{% endif %}"
)
# Not prefix-stable: the last message is closed differently when nothing follows it.
LAST_MESSAGE_CLOSED_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if loop.last and not add_generation_prompt %}{{ '<|endoftext|>' }}"
    "{% else %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma's way: a system message is rendered only folded into the first user turn.
SYSTEM_FOLDED_TEMPLATE = (
    "{{ '<|endoftext|>' }}"
    "{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set rest = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (prefix if loop.first else '') }}"
    "{{ message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Hopeless: the rendering starts with the last message, so nothing is shared.
LAST_MESSAGE_FIRST_TEMPLATE = (
    "{{ messages[-1]['content'] + '\n' }}"
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] }}{% endfor %}"
)


def _as_dicts(messages: tuple[tuple[str, str], ...]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in messages]


def _with_template(tokenizer: PreTrainedTokenizerBase, template: str) -> PreTrainedTokenizerBase:
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def _entry(body: str) -> str:
    """A file with one entry; `body` is the entry's YAML mapping, indented by 4."""
    return "version: 1\nprefixes:\n  - " + body.strip().replace("\n", "\n    ") + "\n"


def _chat_entry(messages: str, name: str = "a") -> str:
    return _entry(f"name: {name}\nmessages:\n" + messages.rstrip())


# --- valid files ------------------------------------------------------------------------------


def test_valid_file_renders_exact_ids(
    tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerBase
) -> None:
    path = tmp_path / "prefixes.yaml"
    path.write_text(VALID_FILE)
    # ChatML is prefix-stable and the entry ends with an assistant turn: nothing is cut
    chat_ids = chat_prompt_ids(
        tiny_tokenizer, _as_dicts(HELPER_MESSAGES), add_generation_prompt=False
    )
    specs = load_prefix_file(path, tiny_tokenizer, MAX_MODEL_LEN)
    assert specs == [
        PrefixSpec(
            name="helper",
            description="A short helpful system prompt.",
            kind="chat",
            messages=HELPER_MESSAGES,
            text="",
            token_ids=tuple(chat_ids),
        ),
        PrefixSpec(
            name="raw.doc_1",
            description="",
            kind="text",
            messages=(),
            text="The model reads the prompt.",
            token_ids=(285, 324, 375, 85, 264, 383, 16),
        ),
    ]
    assert chat_ids[-2:] == [2, 201]  # ...Paris.<|im_end|>\n
    assert specs[0].num_tokens == len(chat_ids)


def test_chat_ids_are_a_prefix_of_real_conversations(
    tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerBase
) -> None:
    path = tmp_path / "prefixes.yaml"
    path.write_text(VALID_FILE)
    ids = list(load_prefix_file(path, tiny_tokenizer, MAX_MODEL_LEN)[0].token_ids)
    conversation = [*_as_dicts(HELPER_MESSAGES), {"role": "user", "content": "anything at all"}]
    assert chat_prompt_ids(tiny_tokenizer, conversation)[: len(ids)] == ids
    assert len(chat_prompt_ids(tiny_tokenizer, conversation)) > len(ids)


def test_text_ids_are_what_a_completions_prompt_becomes(
    tiny_tokenizer: PreTrainedTokenizerBase,
) -> None:
    text = "The model reads the prompt."
    spec = parse_prefix_text(_entry(f"name: t\ntext: {text}"), Path("p.yaml"), tiny_tokenizer, 64)
    assert spec[0].token_ids == tuple(text_prompt_ids(tiny_tokenizer, text))


def test_empty_prefix_list_is_valid(tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    text = "version: 1\nprefixes: []\n"
    assert parse_prefix_text(text, Path("p.yaml"), tiny_tokenizer, MAX_MODEL_LEN) == []


def test_prefix_of_exactly_max_model_len_minus_one_fits(
    tiny_tokenizer: PreTrainedTokenizerBase,
) -> None:
    text = _entry("name: t\ntext: The model reads the prompt.")  # 7 tokens
    assert parse_prefix_text(text, Path("p.yaml"), tiny_tokenizer, 8)[0].num_tokens == 7
    with pytest.raises(RegistryFileError, match="7 tokens, more than max_model_len - 1 = 6"):
        parse_prefix_text(text, Path("p.yaml"), tiny_tokenizer, 7)


# --- invalid files ----------------------------------------------------------------------------

GOOD_MESSAGE = "  - role: system\n    content: Be brief."
BAD_FILES = [
    pytest.param("version: 1\nprefixes: [\n", 256, ["invalid YAML at line 3, column 1"], id="yaml"),
    pytest.param(
        _entry("name: a\nname: b\ntext: x"),
        256,
        ["invalid YAML at line 4, column 5: found duplicate key 'name'"],
        id="yaml_duplicate_key",
    ),
    pytest.param("", 256, ["top level: must be a mapping", "got an empty file"], id="empty_file"),
    pytest.param("- a\n- b\n", 256, ["top level: must be a mapping", "got a list"], id="top_list"),
    pytest.param(
        "version: 1\nprefixes: []\nprefix: []\n",
        256,
        ["top level: unknown field 'prefix'"],
        id="top_unknown_key",
    ),
    pytest.param("prefixes: []\n", 256, ["field 'version': missing"], id="version_missing"),
    pytest.param(
        "version: 2\nprefixes: []\n", 256, ["field 'version': must be 1, got 2"], id="version_2"
    ),
    pytest.param(
        "version: '1'\nprefixes: []\n",
        256,
        ["field 'version': must be 1, got '1'"],
        id="version_string",
    ),
    pytest.param("version: 1\n", 256, ["field 'prefixes': missing"], id="prefixes_missing"),
    pytest.param(
        "version: 1\nprefixes: {a: 1}\n",
        256,
        ["field 'prefixes': must be a list of entries, got a mapping"],
        id="prefixes_mapping",
    ),
    pytest.param(
        "version: 1\nprefixes:\n  - just text\n",
        256,
        ["entry #0: must be a mapping, got a string"],
        id="entry_not_mapping",
    ),
    pytest.param(_entry("text: x"), 256, ["entry #0 field 'name': missing"], id="name_missing"),
    pytest.param(
        _entry("name: 12\ntext: x"),
        256,
        ["entry #0 field 'name': must be a string, got an integer"],
        id="name_not_string",
    ),
    pytest.param(
        _entry("name: ''\ntext: x"),
        256,
        ["entry #0 field 'name': must not be empty"],
        id="name_empty",
    ),
    pytest.param(
        _entry("name: has space\ntext: x"),
        256,
        ["entry #0 field 'name': 'has space' must be at most 64 characters among letters"],
        id="name_bad_characters",
    ),
    pytest.param(
        _entry(f"name: {'n' * 65}\ntext: x"),
        256,
        [f"entry #0 field 'name': '{'n' * 65}' must be at most 64 characters"],
        id="name_too_long",
    ),
    pytest.param(
        "version: 1\nprefixes:\n  - {name: a, text: x}\n  - {name: a, text: y}\n",
        256,
        ["entry 'a' field 'name': duplicate name (entries #0 and #1)"],
        id="name_duplicate",
    ),
    pytest.param(
        _entry("name: a\ntext: x\nprompt: y"),
        256,
        [
            "entry 'a': unknown field 'prompt' (allowed: name, description, messages, text, "
            "response_format, defaults, tenants)"
        ],
        id="entry_unknown_key",
    ),
    pytest.param(
        _entry("name: a\ndescription: [x]\ntext: x"),
        256,
        ["entry 'a' field 'description': must be a string, got a list"],
        id="description_not_string",
    ),
    pytest.param(
        _chat_entry(GOOD_MESSAGE).replace("messages:", "text: x\n    messages:"),
        256,
        ["entry 'a' fields 'messages' and 'text': give exactly one, not both"],
        id="both_messages_and_text",
    ),
    pytest.param(
        _entry("name: a\ndescription: d"),
        256,
        ["entry 'a' field 'messages' or 'text': missing"],
        id="neither_messages_nor_text",
    ),
    pytest.param(
        _entry("name: a\ntext: '  '"),
        256,
        ["entry 'a' field 'text': must not be empty"],
        id="text_blank",
    ),
    pytest.param(
        _entry("name: a\ntext: 42"),
        256,
        ["entry 'a' field 'text': must be a string, got an integer"],
        id="text_not_string",
    ),
    pytest.param(
        _entry("name: a\nmessages: hello"),
        256,
        ["entry 'a' field 'messages': must be a list of {role, content}, got a string"],
        id="messages_not_list",
    ),
    pytest.param(
        _entry("name: a\nmessages: []"),
        256,
        ["entry 'a' field 'messages': must not be empty"],
        id="messages_empty",
    ),
    pytest.param(
        _chat_entry("  - hello"),
        256,
        ["entry 'a' field 'messages[0]': must be a mapping with role and content, got a string"],
        id="message_not_mapping",
    ),
    pytest.param(
        _chat_entry(GOOD_MESSAGE + "\n    name: bob"),
        256,
        ["entry 'a' field 'messages[0]': unknown field 'name' (allowed: role, content)"],
        id="message_unknown_key",
    ),
    pytest.param(
        _chat_entry(GOOD_MESSAGE.replace("system", "bot")),
        256,
        ["entry 'a' field 'messages[0].role': must be one of system, user, assistant, got 'bot'"],
        id="role_bad",
    ),
    pytest.param(
        _chat_entry("  - content: hi"),
        256,
        ["entry 'a' field 'messages[0].role': missing"],
        id="role_missing",
    ),
    pytest.param(
        _chat_entry(GOOD_MESSAGE + "\n  - role: user"),
        256,
        ["entry 'a' field 'messages[1].content': missing"],
        id="content_missing",
    ),
    pytest.param(
        _chat_entry("  - role: user\n    content: ''"),
        256,
        ["entry 'a' field 'messages[0].content': must not be empty"],
        id="content_empty",
    ),
    pytest.param(
        _chat_entry("  - role: user\n    content: [a, b]"),
        256,
        ["entry 'a' field 'messages[0].content': must be a string, got a list"],
        id="content_not_string",
    ),
    pytest.param(
        _entry("name: a\ntext: The model reads the prompt."),
        6,
        ["entry 'a' field 'text': 7 tokens, more than max_model_len - 1 = 5"],
        id="text_too_long",
    ),
    pytest.param(
        _chat_entry(GOOD_MESSAGE),
        8,
        ["entry 'a' field 'messages': ", " tokens, more than max_model_len - 1 = 7"],
        id="chat_too_long",
    ),
]


@pytest.mark.parametrize(("text", "max_model_len", "fragments"), BAD_FILES)
def test_bad_file_is_one_error_naming_file_entry_and_field(
    tmp_path: Path,
    tiny_tokenizer: PreTrainedTokenizerBase,
    text: str,
    max_model_len: int,
    fragments: list[str],
) -> None:
    path = tmp_path / "prefixes.yaml"
    path.write_text(text)
    with pytest.raises(RegistryFileError) as info:
        load_prefix_file(path, tiny_tokenizer, max_model_len)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    for fragment in fragments:
        assert fragment in message
    assert info.value.path == path
    assert len(info.value.problems) == 1, info.value.problems


def test_every_problem_in_a_file_is_reported(tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    text = """\
version: 3
extra: true
prefixes:
  - name: good
    text: The model reads the prompt.
  - name: bad name
    text: x
  - name: chat
    messages:
      - {role: bot, content: ''}
      - {role: user}
  - name: good
    text: ''
  - name: long
    text: The quick brown fox jumps over the lazy dog.
"""
    with pytest.raises(RegistryFileError) as info:
        parse_prefix_text(text, Path("conf/prefixes.yaml"), tiny_tokenizer, 9)
    assert info.value.problems == [
        "top level: unknown field 'extra' (allowed: version, prefixes)",
        "field 'version': must be 1, got 3",
        "entry #1 field 'name': 'bad name' must be at most 64 characters among letters, "
        "digits, '.', '_' and '-'",
        "entry 'chat' field 'messages[0].role': must be one of system, user, assistant, got 'bot'",
        "entry 'chat' field 'messages[0].content': must not be empty",
        "entry 'chat' field 'messages[1].content': missing",
        "entry 'good' field 'text': must not be empty",
        "entry 'good' field 'name': duplicate name (entries #0 and #3)",
        "entry 'long' field 'text': 20 tokens, more than max_model_len - 1 = 8 "
        "(a request must be able to add at least one token after the prefix)",
    ]
    assert str(info.value) == "conf/prefixes.yaml: " + "; ".join(info.value.problems)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        pytest.param(None, "No such file or directory", id="missing"),
        pytest.param(b"version: 1\nprefixes: []\n# \xff\xfe\n", "codec can't decode", id="utf8"),
    ],
)
def test_unreadable_file(
    tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerBase, content: bytes | None, problem: str
) -> None:
    path = tmp_path / "prefixes.yaml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(RegistryFileError, match="cannot read the file") as info:
        load_prefix_file(path, tiny_tokenizer, MAX_MODEL_LEN)
    assert str(info.value).startswith(f"{path}: ")
    assert problem in str(info.value)


def test_template_that_rejects_an_entry_is_a_problem_of_that_entry(
    tiny_tokenizer: PreTrainedTokenizerBase,
) -> None:
    tokenizer = _with_template(tiny_tokenizer, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(RegistryFileError) as info:
        parse_prefix_text(_chat_entry(GOOD_MESSAGE), Path("p.yaml"), tokenizer, MAX_MODEL_LEN)
    assert info.value.problems == [
        "entry 'a' field 'messages': the chat template rejected the messages: roles must alternate"
    ]


# --- templates that are not prefix-stable -----------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [
        pytest.param(TRAILING_EOT_TEMPLATE, id="trailing_token"),
        pytest.param(LAST_MESSAGE_CLOSED_TEMPLATE, id="last_message_closed_differently"),
    ],
)
def test_unstable_template_registers_only_the_shared_ids(
    tiny_tokenizer: PreTrainedTokenizerBase, template: str
) -> None:
    tokenizer = _with_template(tiny_tokenizer, template)
    messages = _as_dicts(HELPER_MESSAGES)
    spec = parse_prefix_text(VALID_FILE, Path("p.yaml"), tokenizer, MAX_MODEL_LEN)[0]
    ids = list(spec.token_ids)
    naive = chat_prompt_ids(tokenizer, messages, add_generation_prompt=False)
    assert naive[-1] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert ids == naive[:-1]
    follow_ups = [
        [{"role": "user", "content": "anything at all"}],
        [{"role": "user", "content": "Hello"}],
        [
            {"role": "user", "content": "And Spain?"},
            {"role": "assistant", "content": "Madrid."},
            {"role": "user", "content": "Thanks!"},
        ],
    ]
    for follow_up in follow_ups:
        assert chat_prompt_ids(tokenizer, [*messages, *follow_up])[: len(ids)] == ids


def test_a_system_message_folded_into_the_user_turn_is_registered(
    tiny_tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Gemma's templates render a system message only inside the first user turn: alone, the
    messages are one special token. The registry pins what conversations share: the system
    text too."""
    tokenizer = _with_template(tiny_tokenizer, SYSTEM_FOLDED_TEMPLATE)
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    alone = chat_prompt_ids(tokenizer, messages, add_generation_prompt=False)
    assert alone == tokenizer.encode("<|endoftext|>")
    spec = parse_prefix_text(
        _chat_entry("  - role: system\n    content: You are a helpful assistant."),
        Path("p.yaml"),
        tokenizer,
        MAX_MODEL_LEN,
    )[0]
    text = tokenizer.decode(spec.token_ids)
    assert text.startswith("<|endoftext|><|im_start|>user\nYou are a helpful assistant.")
    for question in ("Hi", "What is 2 + 2?"):
        turn = {"role": "user", "content": question}
        rendered = chat_prompt_ids(tokenizer, [*messages, turn])
        assert rendered[: len(spec.token_ids)] == list(spec.token_ids)


def test_a_system_prompt_pins_the_next_user_turns_opening(
    tiny_tokenizer: PreTrainedTokenizerBase,
) -> None:
    """A system prompt is always followed by a user turn: its entry pins that turn's opening
    too; an entry ending in another turn pins no more than its rendering alone."""
    system = [{"role": "system", "content": "Be brief."}]
    spec = parse_prefix_text(_chat_entry(GOOD_MESSAGE), Path("p.yaml"), tiny_tokenizer, 256)[0]
    alone = chat_prompt_ids(tiny_tokenizer, system, add_generation_prompt=False)
    assert list(spec.token_ids) == alone + tiny_tokenizer.encode("<|im_start|>user\n")


def test_template_sharing_nothing_is_reported(tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    tokenizer = _with_template(tiny_tokenizer, LAST_MESSAGE_FIRST_TEMPLATE)
    with pytest.raises(RegistryFileError) as info:
        parse_prefix_text(_chat_entry(GOOD_MESSAGE), Path("p.yaml"), tokenizer, MAX_MODEL_LEN)
    assert info.value.problems == [
        "entry 'a' field 'messages': the chat template does not render this prefix stably: "
        "the messages followed by different user turns share no leading token"
    ]


# --- PrefixSpec -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"name": "bad name"}, "invalid prefix name", id="name"),
        pytest.param({"kind": "json"}, "kind must be one of", id="kind"),
        pytest.param({"text": "also text"}, "a chat prefix has messages", id="chat_with_text"),
        pytest.param({"messages": ()}, "a chat prefix has messages", id="chat_no_messages"),
        pytest.param({"token_ids": ()}, "at least one token", id="no_tokens"),
    ],
)
def test_prefix_spec_rejects_inconsistent_fields(fields: dict[str, object], message: str) -> None:
    valid: dict[str, object] = {
        "name": "a",
        "description": "",
        "kind": "chat",
        "messages": (("system", "Be brief."),),
        "text": "",
        "token_ids": (1, 2),
    }
    with pytest.raises(ValueError, match=message):
        PrefixSpec(**{**valid, **fields})  # type: ignore[arg-type]


# --- the shipped prefixes.yaml on the real tokenizer ------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_source: ModelSource) -> PreTrainedTokenizerBase:
    return load_tokenizer(smollm2_source.path)


@pytest.mark.e2e
def test_shipped_prefixes_load_on_the_default_model(
    smollm2_tokenizer: PreTrainedTokenizerBase,
) -> None:
    specs = load_prefix_file(REPO_ROOT / "prefixes.yaml", smollm2_tokenizer, 2048)
    assert [(spec.name, spec.kind) for spec in specs] == [
        ("intent-classifier", "chat"),
        ("support-assistant", "chat"),
        ("doc-qa", "text"),
    ]
    assert all(spec.description for spec in specs)
    assert 850 <= specs[0].num_tokens <= 1000


@pytest.mark.e2e
def test_shipped_prefixes_are_prefixes_of_real_requests(
    smollm2_tokenizer: PreTrainedTokenizerBase,
) -> None:
    specs = load_prefix_file(REPO_ROOT / "prefixes.yaml", smollm2_tokenizer, 2048)
    user_turn = {"role": "user", "content": "My uploads have been stuck at 99% since Monday."}
    for spec in specs:
        ids = list(spec.token_ids)
        if spec.kind == "chat":
            conversation = [*_as_dicts(spec.messages), user_turn]
            request_ids = chat_prompt_ids(smollm2_tokenizer, conversation)
        else:
            prompt = spec.text + " How do I cancel my plan?\nAnswer:"
            request_ids = text_prompt_ids(smollm2_tokenizer, prompt)
        assert request_ids[: len(ids)] == ids, spec.name


def test_text_prefix_drops_a_last_token_that_merges_with_continuations(
    tiny_tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    text = "The quick brown fox jumps over the lazy dog. The scheduler admits new requests "
    naive = text_prompt_ids(tiny_tokenizer, text)
    [spec] = parse_prefix_text(
        f'version: 1\nprefixes:\n  - name: t\n    text: "{text}"\n',
        tmp_path / "p.yaml",
        tiny_tokenizer,
        512,
    )
    assert list(spec.token_ids) == naive[: len(spec.token_ids)]
    assert len(spec.token_ids) < len(naive)  # the trailing space merges with " Hello" etc.
    for continuation in ("Hello", "and more", "\nNext"):
        ids = text_prompt_ids(tiny_tokenizer, text + continuation)
        assert ids[: len(spec.token_ids)] == list(spec.token_ids)


# --- the output contract ------------------------------------------------------------------

CONTRACT_ENTRY = """\
name: labels
text: "Classify:"
response_format:
  type: json_schema
  json_schema:
    name: label
    strict: true
    schema: {type: object, properties: {label: {enum: [a, b]}}, required: [label]}
defaults: {temperature: 0, max_tokens: 12, stop: ["\\n", "END"]}
"""


def test_an_entry_declares_its_output_contract(tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    [spec] = parse_prefix_text(
        _entry(CONTRACT_ENTRY), Path("p.yaml"), tiny_tokenizer, MAX_MODEL_LEN
    )
    schema = {
        "type": "object",
        "properties": {"label": {"enum": ["a", "b"]}},
        "required": ["label"],
    }
    assert spec.contract == PrefixContract(
        response_format=json.dumps(
            {
                "type": "json_schema",
                "json_schema": {"name": "label", "strict": True, "schema": schema},
            }
        ),
        grammar=GrammarSpec.json_schema(schema),
        temperature=0.0,
        max_tokens=12,
        stop=("\n", "END"),
    )


def test_an_entry_without_a_contract_has_an_empty_one(
    tiny_tokenizer: PreTrainedTokenizerBase,
) -> None:
    [spec] = parse_prefix_text(_entry("name: t\ntext: hi"), Path("p.yaml"), tiny_tokenizer, 64)
    assert spec.contract == PrefixContract()


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ("response_format: json", "field 'response_format': must be a mapping, got a string"),
        (
            "response_format: {type: xml}",
            "field 'response_format'.type: must be json_object or json_schema, got 'xml'",
        ),
        (
            "response_format: {type: json_schema, json_schema: {name: x}}",
            "field 'response_format'.json_schema: must be a mapping with a 'schema' mapping",
        ),
        ("defaults: [1]", "field 'defaults': must be a mapping, got a list"),
        ("defaults: {temperature: 3}", "field 'defaults'.temperature: must be a number in [0, 2]"),
        ("defaults: {max_tokens: 0}", "field 'defaults'.max_tokens: must be a positive integer"),
        ('defaults: {stop: [""]}', "field 'defaults'.stop: must be a non-empty string or a list"),
        ("defaults: {top_k: 3}", "field 'defaults': unknown field 'top_k'"),
    ],
)
def test_a_bad_contract_names_entry_and_field(
    tiny_tokenizer: PreTrainedTokenizerBase, extra: str, problem: str
) -> None:
    with pytest.raises(RegistryFileError) as raised:
        parse_prefix_text(_entry(f"name: t\ntext: hi\n{extra}"), Path("p.yaml"), tiny_tokenizer, 64)
    assert f"entry 't' {problem}" in str(raised.value)
