"""Model registry: a name -> a published config shipped in bench/model_configs/ (no hub download).

Models are built from these configs with random weights: memory and speed do not depend on the
weight values. Each JSON file is the model's published config.json (the fields that shape the
network) plus two keys of ours: `family` (which technique patches apply, e.g. liger) and `_source`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).parent / "model_configs"
_OUR_KEYS = ("family", "_source")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # llama | qwen2 | mistral
    source: str
    config_json: str  # the config.json fields, canonical JSON (hashable, and a fresh copy per load)

    @property
    def hf_fields(self) -> dict[str, Any]:
        return json.loads(self.config_json)  # a new dict every time: from_config mutates configs


@cache
def registry() -> dict[str, ModelSpec]:
    specs = {}
    for path in sorted(CONFIG_DIR.glob("*.json")):
        raw = json.loads(path.read_text())
        fields = {k: v for k, v in raw.items() if k not in _OUR_KEYS}
        specs[path.stem] = ModelSpec(
            name=path.stem,
            family=raw["family"],
            source=raw["_source"],
            config_json=json.dumps(fields, sort_keys=True),
        )
    return specs


def get(name: str) -> ModelSpec:
    try:
        return registry()[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(registry())}") from None


def hf_config(spec: ModelSpec, attn_implementation: str):
    """A fresh transformers config for one build (a new object every call)."""
    from transformers import AutoConfig

    fields = spec.hf_fields
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = attn_implementation
    return config
