"""The prefixes file (prefixes.yaml): load it, validate all of it, render each entry to ids.

The file is edited by operators and hot-reloaded, so a mistake must never leave a half-loaded
registry: every problem in the file is collected and raised as one RegistryFileError, and the
caller keeps its old registry. Messages name the file, the entry and the field, so the
operator can fix them all in one pass.

```yaml
version: 1
prefixes:
  - name: intent-classifier      # unique, [A-Za-z0-9._-]+, at most 64 characters
    description: "..."           # optional
    messages:                    # a chat prefix ...
      - {role: system, content: "..."}
  - name: raw-doc
    text: "..."                  # ... or a raw completion prefix (exactly one of the two)
    response_format:             # optional: the output contract of requests that hit it,
      type: json_schema          #   as in the API (json_object, or json_schema with a schema)
      json_schema: {name: label, schema: {...}}
    defaults: {temperature: 0, max_tokens: 16, stop: ["\n"]}   # optional
```
A request that hits an entry and does not set a field itself gets the entry's: its own
fields win (a request's `response_format: {type: text}` turns the entry's format off).
"""

from __future__ import annotations

import json
import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from engine.core.errors import EngineError, InvalidRequestError
from engine.core.sampling_params import MAX_STOP_STRINGS, GrammarSpec
from engine.text.chat import chat_prompt_ids, text_prompt_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FILE_VERSION = 1
MAX_NAME_LEN = 64
ROLES = ("system", "user", "assistant")
KINDS = ("chat", "text")
# User turns rendered after a chat prefix to find the ids it shares with real conversations.
# They differ in their first character and token, so nothing of a probe survives the
# common-prefix cut, and one holds digits and punctuation that BPE merges differently.
PROBE_USER_TEXTS = ("Hello", "Which way? 1 2 3")
# Continuations a completion prompt may add after a text prefix: a space-led word, a newline,
# punctuation. BPE can merge the prefix's last characters with any of them.
PROBE_TEXT_SUFFIXES = ("Hello", " Hello", "the", " the", "\nWhich way? 1 2 3", "?!")

_NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]+")
_TOP_LEVEL_KEYS = ("version", "prefixes")
_ENTRY_KEYS = (
    "name",
    "description",
    "messages",
    "text",
    "response_format",
    "defaults",
    "tenants",
)
_FORMAT_KEYS = ("type", "json_schema")
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")
_DEFAULT_KEYS = ("temperature", "max_tokens", "stop")
_MESSAGE_KEYS = ("role", "content")
_UNSTABLE_TEMPLATE = (
    "the chat template does not render this prefix stably: the messages rendered alone and "
    "followed by a user turn share no leading token"
)
_TYPE_NAMES = {
    type(None): "null",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a mapping",
}

Messages = tuple[tuple[str, str], ...]


class RegistryFileError(EngineError):
    """Everything wrong with a prefixes file, as one error; message names file, entry, field."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        super().__init__(f"{path}: " + "; ".join(problems))
        self.path = path
        self.problems = list(problems)


@dataclass(frozen=True)
class PrefixContract:
    """What an entry declares for the requests that hit it; each field is a default that the
    request's own field overrides. `response_format` is the entry's format as JSON text (what
    the admin API shows); `grammar` is what it constrains (compiled when the file loads)."""

    response_format: str | None = None
    grammar: GrammarSpec | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None


@dataclass(frozen=True)
class PrefixSpec:
    """One validated entry of the prefixes file and the token ids the registry pins for it.

    For chat entries `token_ids` is the part of the rendering that every conversation
    continuing these messages with a user turn starts with (see `render_chat_prefix`), which
    may be a few tokens shorter than the messages rendered alone.
    """

    name: str
    description: str
    kind: str
    messages: Messages
    text: str
    token_ids: tuple[int, ...]
    contract: PrefixContract = PrefixContract()
    # API key names allowed to hit and see this entry; None: every tenant.
    tenants: tuple[str, ...] | None = None

    def visible_to(self, tenant: str | None) -> bool:
        return self.tenants is None or tenant in self.tenants

    def __post_init__(self) -> None:
        if not _is_valid_name(self.name):
            raise ValueError(f"invalid prefix name {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "chat") != bool(self.messages) or (self.kind == "text") != bool(self.text):
            raise ValueError("a chat prefix has messages and no text, a text prefix the reverse")
        if not self.token_ids:
            raise ValueError("a prefix needs at least one token")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class _Entry:
    """An entry whose fields are all valid, before rendering."""

    name: str
    description: str
    kind: str
    messages: Messages
    text: str
    contract: PrefixContract
    tenants: tuple[str, ...] | None


def load_prefix_file(
    path: Path, tokenizer: PreTrainedTokenizerBase, max_model_len: int
) -> list[PrefixSpec]:
    """Read, validate and render the prefixes file at `path`; see `parse_prefix_text`."""
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise RegistryFileError(path, [f"cannot read the file: {exc}"]) from exc
    return parse_prefix_bytes(content, path, tokenizer, max_model_len)


def parse_prefix_bytes(
    content: bytes, path: Path, tokenizer: PreTrainedTokenizerBase, max_model_len: int
) -> list[PrefixSpec]:
    """`parse_prefix_text` over the file's raw bytes, which must be UTF-8."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RegistryFileError(path, [f"cannot read the file: {exc}"]) from exc
    return parse_prefix_text(text, path, tokenizer, max_model_len)


def parse_prefix_text(
    text: str, path: Path, tokenizer: PreTrainedTokenizerBase, max_model_len: int
) -> list[PrefixSpec]:
    """Validate a whole prefixes file given as a string and render every entry to token ids.

    Returns the entries in file order, or raises one RegistryFileError listing every problem
    found (`path` only names the file in messages). Never returns a partial list. Each prefix
    must leave room for at least one more token: at most `max_model_len - 1` tokens.
    """
    assert max_model_len >= 2, "max_model_len must leave room for a prefix and one token"
    problems: list[str] = []
    data = _parse_yaml(text, path)
    entries = _check_entries(_check_top_level(data, problems), problems)
    specs = [_render(entry, tokenizer, max_model_len, problems) for entry in entries]
    if problems:
        raise RegistryFileError(path, problems)
    return [spec for spec in specs if spec is not None]


def render_chat_prefix(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> list[int]:
    """The ids that `messages` rendered alone and followed by any user turn all start with.

    Chat templates are often not prefix-stable: the last message may be closed differently
    when nothing follows it, and BPE may merge tokens across the boundary. Registering the
    naive rendering would then never match a real request. The longest prefix common to the
    rendering alone and to renderings with several different probe user turns is what real
    conversations share. An empty result means the template renders the prefix unstably.
    """
    base = [{"role": role, "content": content} for role, content in messages]
    renderings = [chat_prompt_ids(tokenizer, base, add_generation_prompt=False)]
    for probe in PROBE_USER_TEXTS:
        probe_turn = {"role": "user", "content": probe}
        renderings.append(chat_prompt_ids(tokenizer, [*base, probe_turn]))
    return _common_prefix(renderings)


def render_text_prefix(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The ids that `text` alone and `text` followed by typical continuations all start with,
    so a completion whose prompt extends the text still matches at the token level."""
    renderings = [text_prompt_ids(tokenizer, text)]
    renderings += [text_prompt_ids(tokenizer, text + suffix) for suffix in PROBE_TEXT_SUFFIXES]
    return _common_prefix(renderings)


def _common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    num_shared = 0
    for column in zip(*sequences, strict=False):
        if len(set(column)) != 1:
            break
        num_shared += 1
    return list(sequences[0][:num_shared])


# --- YAML -------------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that rejects duplicate mapping keys, which plain YAML silently overwrites
    (a second `content:` in a message would otherwise replace the first without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(text: str, path: Path) -> object:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        context = f" ({exc.context})" if exc.context else ""
        raise RegistryFileError(path, [f"invalid YAML{where}: {exc.problem}{context}"]) from exc
    except yaml.YAMLError as exc:
        raise RegistryFileError(path, [f"invalid YAML: {exc}"]) from exc


# --- structure --------------------------------------------------------------------------------


def _type_name(value: object) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _at(label: str, field: str) -> str:
    return f"{label} field '{field}'"


def _is_valid_name(name: str) -> bool:
    return len(name) <= MAX_NAME_LEN and _NAME_PATTERN.fullmatch(name) is not None


def _check_unknown_keys(
    where: str, mapping: dict[Any, Any], allowed: tuple[str, ...], problems: list[str]
) -> None:
    for key in mapping:
        if key not in allowed:
            problems.append(f"{where}: unknown field {key!r} (allowed: {', '.join(allowed)})")


def _check_top_level(data: object, problems: list[str]) -> list[object]:
    """The raw entries under `prefixes`, after checking the keys around them."""
    if not isinstance(data, dict):
        got = "an empty file" if data is None else _type_name(data)
        problems.append(f"top level: must be a mapping with 'version' and 'prefixes', got {got}")
        return []
    _check_unknown_keys("top level", data, _TOP_LEVEL_KEYS, problems)
    version = data.get("version")
    if "version" not in data:
        problems.append(f"field 'version': missing (must be {FILE_VERSION})")
    elif type(version) is not int or version != FILE_VERSION:
        problems.append(f"field 'version': must be {FILE_VERSION}, got {version!r}")
    prefixes = data.get("prefixes")
    if "prefixes" not in data:
        problems.append("field 'prefixes': missing (a list of entries, may be empty)")
    elif not isinstance(prefixes, list):
        problems.append(f"field 'prefixes': must be a list of entries, got {_type_name(prefixes)}")
    return prefixes if isinstance(prefixes, list) else []


def _check_entries(raw_entries: list[object], problems: list[str]) -> list[_Entry]:
    entries: list[_Entry] = []
    first_index: dict[str, int] = {}
    for index, raw in enumerate(raw_entries):
        entry = _check_entry(index, raw, problems)
        # Checked on the raw name, so a duplicate is reported even if either copy is broken.
        name = _usable_name(raw)
        if name in first_index:
            problems.append(
                f"entry '{name}' field 'name': duplicate name "
                f"(entries #{first_index[name]} and #{index})"
            )
        elif name is not None:
            first_index[name] = index
            entries.extend([entry] if entry is not None else [])
    return entries


def _usable_name(raw: object) -> str | None:
    name = raw.get("name") if isinstance(raw, dict) else None
    return name if isinstance(name, str) and _is_valid_name(name) else None


def _check_entry(index: int, raw: object, problems: list[str]) -> _Entry | None:
    """The entry if all its fields are valid; otherwise None, with its problems recorded."""
    if not isinstance(raw, dict):
        problems.append(f"entry #{index}: must be a mapping, got {_type_name(raw)}")
        return None
    num_problems = len(problems)
    name = _check_name(index, raw, problems)
    label = f"entry '{name}'" if name is not None else f"entry #{index}"
    _check_unknown_keys(label, raw, _ENTRY_KEYS, problems)
    description = _check_description(label, raw, problems)
    body = _check_body(label, raw, problems)
    contract = _check_contract(label, raw, problems)
    tenants = _check_tenants(label, raw, problems)
    if len(problems) > num_problems or name is None or body is None:
        return None
    kind, messages, text = body
    return _Entry(name, description, kind, messages, text, contract, tenants)


def _check_tenants(label: str, raw: dict[Any, Any], problems: list[str]) -> tuple[str, ...] | None:
    """`tenants`: the API key names (`--api-key NAME=KEY`) that may hit and see the entry."""
    if "tenants" not in raw:
        return None
    where, value = _at(label, "tenants"), raw["tenants"]
    if not isinstance(value, list) or not value:
        problems.append(f"{where}: must be a non-empty list of API key names")
        return None
    names = [item for item in value if isinstance(item, str) and _is_valid_name(item)]
    if len(names) != len(value):
        problems.append(
            f"{where}: each must be an API key name of at most {MAX_NAME_LEN} characters among "
            "letters, digits, '.', '_' and '-'"
        )
        return None
    if len(set(names)) != len(names):
        problems.append(f"{where}: names a tenant twice")
        return None
    return tuple(names)


def _check_string(where: str, value: object, problems: list[str]) -> str | None:
    """`value` if it is a string that is not blank; else None, with the problem recorded."""
    if not isinstance(value, str):
        problems.append(f"{where}: must be a string, got {_type_name(value)}")
        return None
    if not value.strip():
        problems.append(f"{where}: must not be empty")
        return None
    return value


def _check_name(index: int, raw: dict[Any, Any], problems: list[str]) -> str | None:
    where = _at(f"entry #{index}", "name")
    if "name" not in raw:
        problems.append(f"{where}: missing")
        return None
    name = _check_string(where, raw["name"], problems)
    if name is None:
        return None
    if not _is_valid_name(name):
        problems.append(
            f"{where}: {name!r} must be at most {MAX_NAME_LEN} characters among letters, "
            "digits, '.', '_' and '-'"
        )
        return None
    return name


def _check_description(label: str, raw: dict[Any, Any], problems: list[str]) -> str:
    description = raw.get("description", "")
    if isinstance(description, str):
        return description
    problems.append(f"{_at(label, 'description')}: must be a string, got {_type_name(description)}")
    return ""


def _check_body(
    label: str, raw: dict[Any, Any], problems: list[str]
) -> tuple[str, Messages, str] | None:
    """(kind, messages, text) from exactly one of the `messages` and `text` fields."""
    if "messages" in raw and "text" in raw:
        problems.append(f"{label} fields 'messages' and 'text': give exactly one, not both")
        return None
    if "text" in raw:
        text = _check_string(_at(label, "text"), raw["text"], problems)
        return None if text is None else ("text", (), text)
    if "messages" in raw:
        messages = _check_messages(label, raw["messages"], problems)
        return None if messages is None else ("chat", messages, "")
    problems.append(f"{label} field 'messages' or 'text': missing, give exactly one of them")
    return None


def _check_messages(label: str, value: object, problems: list[str]) -> Messages | None:
    where = _at(label, "messages")
    if not isinstance(value, list):
        problems.append(f"{where}: must be a list of {{role, content}}, got {_type_name(value)}")
        return None
    if not value:
        problems.append(f"{where}: must not be empty")
        return None
    checked = [_check_message(label, i, message, problems) for i, message in enumerate(value)]
    pairs = [pair for pair in checked if pair is not None]
    return tuple(pairs) if len(pairs) == len(checked) else None


def _check_message(
    label: str, index: int, value: object, problems: list[str]
) -> tuple[str, str] | None:
    field = f"messages[{index}]"
    if not isinstance(value, dict):
        problems.append(
            f"{_at(label, field)}: must be a mapping with role and content, got {_type_name(value)}"
        )
        return None
    _check_unknown_keys(_at(label, field), value, _MESSAGE_KEYS, problems)
    role = _check_role(_at(label, f"{field}.role"), value, problems)
    content, where = None, _at(label, f"{field}.content")
    if "content" not in value:
        problems.append(f"{where}: missing")
    else:
        content = _check_string(where, value["content"], problems)
    return None if role is None or content is None else (role, content)


def _check_role(where: str, message: dict[Any, Any], problems: list[str]) -> str | None:
    role = message.get("role")
    if "role" not in message:
        problems.append(f"{where}: missing")
    elif not isinstance(role, str) or role not in ROLES:
        problems.append(f"{where}: must be one of {', '.join(ROLES)}, got {role!r}")
    else:
        return role
    return None


# --- the output contract ---------------------------------------------------------------------


def _check_contract(label: str, raw: dict[Any, Any], problems: list[str]) -> PrefixContract:
    """The entry's `response_format` and `defaults` (an empty contract when it has none)."""
    response_format, grammar = None, None
    if "response_format" in raw:
        grammar = _check_response_format(_at(label, "response_format"), raw, problems)
        response_format = json.dumps(raw["response_format"]) if grammar is not None else None
    defaults = raw.get("defaults", {})
    where = _at(label, "defaults")
    if not isinstance(defaults, dict):
        problems.append(f"{where}: must be a mapping, got {_type_name(defaults)}")
        defaults = {}
    _check_unknown_keys(where, defaults, _DEFAULT_KEYS, problems)
    return PrefixContract(
        response_format=response_format,
        grammar=grammar,
        temperature=_check_temperature(f"{where}.temperature", defaults, problems),
        max_tokens=_check_max_tokens(f"{where}.max_tokens", defaults, problems),
        stop=_check_stop(f"{where}.stop", defaults, problems),
    )


def _check_response_format(
    where: str, raw: dict[Any, Any], problems: list[str]
) -> GrammarSpec | None:
    value = raw["response_format"]
    if not isinstance(value, dict):
        problems.append(f"{where}: must be a mapping, got {_type_name(value)}")
        return None
    _check_unknown_keys(where, value, _FORMAT_KEYS, problems)
    kind = value.get("type")
    if kind == "json_object":
        return GrammarSpec.json_schema(None)
    if kind != "json_schema":
        problems.append(f"{where}.type: must be json_object or json_schema, got {kind!r}")
        return None
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        problems.append(f"{where}.json_schema: must be a mapping with a 'schema' mapping")
        return None
    _check_unknown_keys(f"{where}.json_schema", spec, _JSON_SCHEMA_KEYS, problems)
    return GrammarSpec.json_schema(spec["schema"])


def _check_temperature(where: str, defaults: dict[Any, Any], problems: list[str]) -> float | None:
    value = defaults.get("temperature")
    if value is None:
        return None
    if type(value) not in (int, float) or not 0 <= value <= 2:
        problems.append(f"{where}: must be a number in [0, 2], got {value!r}")
        return None
    return float(value)


def _check_max_tokens(where: str, defaults: dict[Any, Any], problems: list[str]) -> int | None:
    value = defaults.get("max_tokens")
    if value is None:
        return None
    if type(value) is not int or value < 1:
        problems.append(f"{where}: must be a positive integer, got {value!r}")
        return None
    return value


def _check_stop(
    where: str, defaults: dict[Any, Any], problems: list[str]
) -> tuple[str, ...] | None:
    value = defaults.get("stop")
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        problems.append(f"{where}: must be a non-empty string or a list of them, got {value!r}")
        return None
    if len(stops) > MAX_STOP_STRINGS:
        problems.append(f"{where}: at most {MAX_STOP_STRINGS} stop strings")
        return None
    return tuple(stops)


# --- rendering --------------------------------------------------------------------------------


def _render(
    entry: _Entry, tokenizer: PreTrainedTokenizerBase, max_model_len: int, problems: list[str]
) -> PrefixSpec | None:
    where = _at(f"entry '{entry.name}'", "messages" if entry.kind == "chat" else "text")
    try:
        ids = _entry_ids(entry, tokenizer)
    except InvalidRequestError as exc:
        problems.append(f"{where}: {exc.message}")
        return None
    if not ids and entry.kind == "chat":
        problems.append(f"{where}: {_UNSTABLE_TEMPLATE}")
    elif not ids and entry.text.strip():
        problems.append(f"{where}: no token of this text is stable under continuation")
    elif not ids:
        problems.append(f"{where}: tokenizes to 0 tokens")
    elif len(ids) > max_model_len - 1:
        problems.append(
            f"{where}: {len(ids)} tokens, more than max_model_len - 1 = {max_model_len - 1} "
            "(a request must be able to add at least one token after the prefix)"
        )
    else:
        return PrefixSpec(
            entry.name,
            entry.description,
            entry.kind,
            entry.messages,
            entry.text,
            tuple(ids),
            entry.contract,
            entry.tenants,
        )
    return None


def _entry_ids(entry: _Entry, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if entry.kind == "chat":
        return render_chat_prefix(tokenizer, entry.messages)
    return render_text_prefix(tokenizer, entry.text)
