"""The ways a request may constrain its output, and the one GrammarSpec each becomes.

OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `strict`) and the
extensions vLLM users send through `extra_body`: `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, and their newer form `structured_outputs` ({json, regex,
choice, grammar, json_object}). A request may use one of them; the engine compiles it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from engine import GrammarSpec
from gateway.protocol.common import RequestModel, json_type_name

# llguidance reads compile options from the schema itself: without `strict`, keywords it
# does not enforce are ignored (OpenAI's best-effort mode) instead of failing the request.
LENIENT = {"x-guidance": {"lenient": True}}
FORMAT_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a json_schema format's name


class JsonSchemaFormat(RequestModel):
    name: str = Field(pattern=FORMAT_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatModel(RequestModel):
    """One model rather than a union tagged by `type`: errors then name
    `response_format.json_schema.name`, not a union branch."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormatModel:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError(
                "invalid_value", "'json_schema' is required when 'type' is 'json_schema'"
            )
        return self

    def spec(self) -> GrammarSpec | None:
        """The GrammarSpec of this format, None for `text`."""
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        if schema is None:
            return GrammarSpec.json_schema(None)
        strict = self.json_schema is not None and self.json_schema.strict
        return GrammarSpec.json_schema(schema if strict else _lenient(schema))


def _expect(*types: type, expected: str) -> BeforeValidator:
    """Check the JSON type first, so that an error names the field, not a union branch."""

    def check(value: Any) -> Any:
        if not isinstance(value, types):
            raise PydanticCustomError(
                "invalid_type",
                "expected {expected}, but got {got} instead",
                {"expected": expected, "got": json_type_name(value)},
            )
        return value

    return BeforeValidator(check)


ResponseFormat = Annotated[ResponseFormatModel, _expect(dict, expected="an object")]
# A JSON schema as an object, or as JSON text (vLLM accepts both).
JsonSchemaValue = Annotated[
    dict[str, Any] | str, _expect(dict, str, expected="an object or a string")
]


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    json_: JsonSchemaValue | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def specs(self) -> list[GrammarSpec]:
        return [
            spec
            for spec in (
                _json_spec(self.json_) if self.json_ is not None else None,
                GrammarSpec("regex", self.regex) if self.regex is not None else None,
                GrammarSpec.choice(self.choice) if self.choice is not None else None,
                GrammarSpec("lark", self.grammar) if self.grammar is not None else None,
                GrammarSpec.json_schema(None) if self.json_object else None,
            )
            if spec is not None
        ]


def guided_specs(
    guided_json: dict[str, Any] | str | None,
    guided_regex: str | None,
    guided_choice: list[str] | None,
    guided_grammar: str | None,
) -> list[tuple[str, GrammarSpec]]:
    """The (field, spec) pairs of vLLM's guided_* fields that are set."""
    pairs = [
        ("guided_json", _json_spec(guided_json) if guided_json is not None else None),
        ("guided_regex", GrammarSpec("regex", guided_regex) if guided_regex is not None else None),
        ("guided_choice", GrammarSpec.choice(guided_choice) if guided_choice is not None else None),
        ("guided_grammar", GrammarSpec("lark", guided_grammar) if guided_grammar else None),
    ]
    return [(name, spec) for name, spec in pairs if spec is not None]


def _json_spec(schema: dict[str, Any] | str) -> GrammarSpec:
    if isinstance(schema, str):  # vLLM accepts the schema as JSON text too
        return GrammarSpec("json_schema", schema)
    return GrammarSpec.json_schema(_lenient(schema))


def _lenient(schema: dict[str, Any]) -> dict[str, Any]:
    return schema if "x-guidance" in schema else {**schema, **LENIENT}
