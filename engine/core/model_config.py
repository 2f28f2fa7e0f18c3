"""A model's config as the engine reads it: every field transformers' config class resolved
(its defaults, RoPE parameters and derived fields included), as plain attributes.

Why not transformers' class: building one imports transformers (0.6-1.0 s of a start on 2
vCPUs), and the engine only reads numbers and names from it. The fields come from the config
cache (engine/loading/config_cache.py), which asks transformers once per config file.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class ModelConfig:
    """Fields as attributes; a family's aliases (`attribute_map`: GPT-2's `hidden_size` is its
    `n_embd`) read through to the field they name."""

    def __init__(
        self,
        class_name: str,
        model_type: str,
        fields: dict[str, Any],
        attribute_map: dict[str, str] | None = None,
        name_or_path: str = "",
    ) -> None:
        """`name_or_path`: the folder it was read for, a field as in transformers' configs (an
        entry of the cache serves every copy of a model)."""
        fields = {**fields, "_name_or_path": name_or_path}
        self.__dict__.update(fields)
        self.__dict__["model_type"] = model_type
        self.__dict__["_class_name"] = class_name
        self.__dict__["_fields"] = dict(fields)
        self.__dict__["attribute_map"] = dict(attribute_map or {})

    def __getattr__(self, name: str) -> Any:  # only for names that are not fields
        aliases = self.__dict__.get("attribute_map", {})
        if name in aliases:
            return getattr(self, aliases[name])
        # `.get`: copy and pickle look names up before __dict__ is filled
        class_name = self.__dict__.get("_class_name", "ModelConfig")
        raise AttributeError(f"{class_name} has no field {name!r}")

    @property
    def class_name(self) -> str:
        """transformers' class for this family (`LlamaConfig`)."""
        return str(self._class_name)

    @property
    def name_or_path(self) -> str:
        return str(self._fields["_name_or_path"])

    def to_dict(self) -> dict[str, Any]:
        """The fields as transformers wrote them (`to_json_string(use_diff=False)`)."""
        fields: dict[str, Any] = json.loads(json.dumps(self._fields))
        return fields

    def to_json_string(self, use_diff: bool = False) -> str:
        del use_diff  # every field is kept: there is no default to leave out
        return json.dumps(self._fields, indent=2, sort_keys=True) + "\n"

    def as_transformers(self) -> PretrainedConfig:
        """transformers' base config under this family's name, for its RoPE initialisers
        (scaled RoPE: Llama 3's, LongRoPE); imports transformers."""
        from transformers import PretrainedConfig

        family: type[PretrainedConfig] = type(
            self._class_name,
            (PretrainedConfig,),
            {"model_type": self.model_type, "attribute_map": dict(self.attribute_map)},
        )
        config: PretrainedConfig = family.from_dict(dict(self._fields))
        present = config.to_dict()
        for key, value in self._fields.items():  # what the base class takes as a keyword and
            if key not in present:  # drops (`use_cache`): kept, as transformers' own has it
                setattr(config, key, value)
        return config
