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

from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from engine.registry.checks import check_document
from engine.registry.render import render_entry
from engine.registry.spec import PrefixSpec, RegistryFileError

if TYPE_CHECKING:
    from engine.text.tokenizer import Tokenizer


def load_prefix_file(path: Path, tokenizer: Tokenizer, max_model_len: int) -> list[PrefixSpec]:
    """Read, validate and render the prefixes file at `path`; see `parse_prefix_text`."""
    return parse_prefix_bytes(read_prefix_file(path), path, tokenizer, max_model_len)


def read_prefix_file(path: Path) -> bytes:
    """The file's bytes, or a RegistryFileError saying why they cannot be read."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise RegistryFileError(path, [f"cannot read the file: {exc}"]) from exc


def parse_prefix_bytes(
    content: bytes, path: Path, tokenizer: Tokenizer, max_model_len: int
) -> list[PrefixSpec]:
    """`parse_prefix_text` over the file's raw bytes, which must be UTF-8."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RegistryFileError(path, [f"cannot read the file: {exc}"]) from exc
    return parse_prefix_text(text, path, tokenizer, max_model_len)


def parse_prefix_text(
    text: str, path: Path, tokenizer: Tokenizer, max_model_len: int
) -> list[PrefixSpec]:
    """Validate a whole prefixes file given as a string and render every entry to token ids.

    Returns the entries in file order, or raises one RegistryFileError listing every problem
    found (`path` only names the file in messages). Never returns a partial list. Each prefix
    must leave room for at least one more token: at most `max_model_len - 1` tokens.
    """
    assert max_model_len >= 2, "max_model_len must leave room for a prefix and one token"
    problems: list[str] = []
    data = _parse_yaml(text, path)
    entries = check_document(data, problems)
    specs = [render_entry(entry, tokenizer, max_model_len, problems) for entry in entries]
    if problems:
        raise RegistryFileError(path, problems)
    return [spec for spec in specs if spec is not None]


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
