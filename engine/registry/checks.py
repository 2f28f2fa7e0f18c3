"""The checks of a parsed prefixes file: its structure, each entry's fields, every problem
collected (never the first alone), so an operator fixes a file in one pass. What passes is a
list of `Entry`s, ready to render to token ids (`render.py`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.core.sampling_params import MAX_STOP_STRINGS, GrammarSpec
from engine.registry.spec import MAX_NAME_LEN, Messages, PrefixContract, is_valid_name

FILE_VERSION = 1
ROLES = ("system", "user", "assistant")
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

_TYPE_NAMES = {
    type(None): "null",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a mapping",
}


@dataclass(frozen=True)
class Entry:
    """An entry whose fields are all valid, before rendering."""

    name: str
    description: str
    kind: str
    messages: Messages
    text: str
    contract: PrefixContract
    tenants: tuple[str, ...] | None


def check_document(data: object, problems: list[str]) -> list[Entry]:
    """The valid entries of a parsed file; what is wrong is appended to `problems`."""
    return _check_entries(_check_top_level(data, problems), problems)


def _type_name(value: object) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def field_at(label: str, field: str) -> str:
    return f"{label} field '{field}'"


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


def _check_entries(raw_entries: list[object], problems: list[str]) -> list[Entry]:
    entries: list[Entry] = []
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
    return name if isinstance(name, str) and is_valid_name(name) else None


def _check_entry(index: int, raw: object, problems: list[str]) -> Entry | None:
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
    return Entry(name, description, kind, messages, text, contract, tenants)


def _check_tenants(label: str, raw: dict[Any, Any], problems: list[str]) -> tuple[str, ...] | None:
    """`tenants`: the API key names (`--api-key NAME=KEY`) that may hit and see the entry."""
    if "tenants" not in raw:
        return None
    where, value = field_at(label, "tenants"), raw["tenants"]
    if not isinstance(value, list) or not value:
        problems.append(f"{where}: must be a non-empty list of API key names")
        return None
    names = [item for item in value if isinstance(item, str) and is_valid_name(item)]
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
    where = field_at(f"entry #{index}", "name")
    if "name" not in raw:
        problems.append(f"{where}: missing")
        return None
    name = _check_string(where, raw["name"], problems)
    if name is None:
        return None
    if not is_valid_name(name):
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
    problems.append(
        f"{field_at(label, 'description')}: must be a string, got {_type_name(description)}"
    )
    return ""


def _check_body(
    label: str, raw: dict[Any, Any], problems: list[str]
) -> tuple[str, Messages, str] | None:
    """(kind, messages, text) from exactly one of the `messages` and `text` fields."""
    if "messages" in raw and "text" in raw:
        problems.append(f"{label} fields 'messages' and 'text': give exactly one, not both")
        return None
    if "text" in raw:
        text = _check_string(field_at(label, "text"), raw["text"], problems)
        return None if text is None else ("text", (), text)
    if "messages" in raw:
        messages = _check_messages(label, raw["messages"], problems)
        return None if messages is None else ("chat", messages, "")
    problems.append(f"{label} field 'messages' or 'text': missing, give exactly one of them")
    return None


def _check_messages(label: str, value: object, problems: list[str]) -> Messages | None:
    where = field_at(label, "messages")
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
            f"{field_at(label, field)}: must be a mapping with role and content, "
            f"got {_type_name(value)}"
        )
        return None
    _check_unknown_keys(field_at(label, field), value, _MESSAGE_KEYS, problems)
    role = _check_role(field_at(label, f"{field}.role"), value, problems)
    content, where = None, field_at(label, f"{field}.content")
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


def _check_contract(label: str, raw: dict[Any, Any], problems: list[str]) -> PrefixContract:
    """The entry's `response_format` and `defaults` (an empty contract when it has none)."""
    response_format, grammar = None, None
    if "response_format" in raw:
        grammar = _check_response_format(field_at(label, "response_format"), raw, problems)
        response_format = json.dumps(raw["response_format"]) if grammar is not None else None
    defaults = raw.get("defaults", {})
    where = field_at(label, "defaults")
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
