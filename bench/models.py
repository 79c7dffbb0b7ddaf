"""Model registry: a name -> a published config shipped in bench/model_configs/ (no hub download).

Models are built from these configs with random weights: memory and speed do not depend on the
weight values. Each JSON file is the model's published config.json (the fields that shape the
network) plus two keys of ours: `family` (which technique patches apply, e.g. liger) and `_source`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).parent / "model_configs"
_OUR_KEYS = ("family", "_source")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # the model_type unless the config names one: which family-specific patches apply (liger)
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


def register_file(path: Path) -> str:
    """A model outside the registry, from its config.json (as published on the hub: download that file
    alone), registered for this process under the name of its folder (or file); returns the name.
    ValueError, naming the problem, for a file that is not a config transformers can build."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable config.json ({err})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ValueError(f"{path}: a model's config.json is a JSON object with a 'model_type'")
    if raw.get("quantization_config") is not None:
        raise ValueError(f"{path}: {_prequantized(raw['quantization_config'])}")
    if isinstance(raw.get("text_config"), dict):
        text_type = raw["text_config"].get("model_type", "?")
        raise ValueError(f"{path}: a multimodal model's config (model_type {raw['model_type']!r} with a text_config): the "
                         "suite trains causal LMs on text; save its text_config as a config.json of its own (model_type "
                         f"{text_type!r}) to ask about its language model, whose memory excludes the other towers' weights")
    stem = path.parent.name if path.name == "config.json" else path.stem
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.") or "model"
    fields = {k: v for k, v in raw.items() if k not in _OUR_KEYS}
    spec = ModelSpec(name, str(raw.get("family") or raw["model_type"]), str(path), json.dumps(fields, sort_keys=True))
    from huggingface_hub.errors import StrictDataclassError  # transformers' config validators raise it

    try:
        hf_config(spec, "sdpa")
    except (ValueError, KeyError, TypeError, StrictDataclassError) as err:  # e.g. a model_type it does not know,
        # a per-layer list as long as another depth: the validator's own message is the cause, where there is one
        first = str(err.__cause__ or err).split(". ")[0][:300]  # it may go on to list every model type it knows
        raise ValueError(f"{path}: transformers cannot build this config: {first}") from None
    known = registry().get(name)
    if known is not None and known.config_json != spec.config_json:
        raise ValueError(f"{path}: the registry's model {name!r} has another config; rename the file or folder")
    registry()[name] = spec
    return name


def _prequantized(quantization: Any) -> str:
    """Why a pre-quantized checkpoint's config is refused: transformers applies its quantization only when
    loading the checkpoint, so a build from the config would be the bf16 model, silently not the one asked."""
    method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
    return (f"the config of a pre-quantized checkpoint (quantization_config, quant_method {method!r}): the suite "
            "builds a model from its config in bf16 and quantizes it only by a stack's technique (qlora, int8_lora); "
            "delete the key to ask about the model in bf16")


# The flag of transformers' model classes that says an attention implementation is there (eager always is).
_ATTENTION_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                    "flex_attention": "_supports_flex_attn"}


def attention_problem(name: str, attn_implementation: str) -> str | None:
    """Why transformers cannot build this model as a causal LM with that attention, or None. Its model
    class says (Gemma 2 and gpt-oss have no sdpa path in transformers 5.24: softcapping, attention
    sinks); the build would raise it only inside the worker, after the process and imports."""
    return _attention_problem(get(name), attn_implementation)


@cache
def _attention_problem(spec: ModelSpec, attn_implementation: str) -> str | None:
    import transformers

    model_class = _causal_lm_class(spec)
    if model_class is None:
        return f"transformers has no causal LM class for model_type {spec.hf_fields['model_type']!r} ({spec.name})"
    flag = _ATTENTION_FLAGS.get(attn_implementation)
    if flag is not None and not getattr(model_class, flag, False):
        return (f"{model_class.__name__} has no {attn_implementation} attention in transformers "
                f"{transformers.__version__}: add eager_attention to the stack")
    return None


def checkpointing_problem(name: str) -> str | None:
    """Why transformers cannot checkpoint this model's layers (its model class says: CTRL's cannot), or None;
    enabling it would raise only inside the worker."""
    import transformers

    model_class = _causal_lm_class(get(name))
    if model_class is None or model_class.supports_gradient_checkpointing:
        return None  # no class: attention_problem says so first
    return f"{model_class.__name__} does not support activation checkpointing in transformers {transformers.__version__}"


@cache
def _causal_lm_class(spec: ModelSpec) -> Any:
    """transformers' causal LM class for this model's config, or None."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(hf_config(spec, "eager"))]
    except KeyError:
        return None


def hf_config(spec: ModelSpec, attn_implementation: str):
    """A fresh transformers config for one build (a new object every call)."""
    from transformers import AutoConfig

    fields = spec.hf_fields
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = attn_implementation
    return config
