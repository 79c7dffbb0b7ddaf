"""What qlora and int8_lora share (not a technique): a bitsandbytes-quantized base loaded from a
random checkpoint, then LoRA adapters (the quantized base cannot be trained, only adapted)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import lora
from .base import Evidence, Options, Phase, Technique

if TYPE_CHECKING:
    from ..cells import Cell

LORA_OPTIONS = dict(lora.TECHNIQUE.options)


def technique(name: str, summary: str, quantization: Callable[[Options], Any], layer_class: str,
              extra_options: dict[str, Any], not_predicted: str | None = None) -> Technique:
    def load(cell: Cell, device: str, attn_implementation: str, opts: Options) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        from .. import checkpoints

        if device == "meta":
            return _skeleton(cell, attn_implementation, quantization(opts))
        # use_kernels=False: transformers 5.25 made from_pretrained swap layers for the Hub's kernels by default
        # (`kernels`), which would change the stack's memory behind its name, differ from the plain build of the
        # other stacks and the fake run's skeleton, and need the Hub on an offline GPU host. A stack names its kernels.
        model = AutoModelForCausalLM.from_pretrained(
            checkpoints.for_load(cell.model, cell.seed, device), quantization_config=quantization(opts),
            dtype=torch.bfloat16, device_map={"": 0 if device == "cuda" else device},
            attn_implementation=attn_implementation, use_kernels=False)
        model.config.use_cache = False
        return model.train()

    def apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
        import bitsandbytes as bnb

        checkpoint = Path(model.name_or_path).name  # which random checkpoint: drawn on the CPU or the GPU
        quantized = sum(isinstance(m, getattr(bnb.nn, layer_class)) for m in model.modules())
        if quantized == 0:
            raise RuntimeError(f"{name}: no {layer_class} layer in the loaded model")
        if opts["prepare_kbit"]:
            from peft import prepare_model_for_kbit_training

            # Upcasts norms, embeddings and lm_head to fp32: visible option, not a hidden default.
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model, found = lora.TECHNIQUE.apply(model, {k: opts[k] for k in LORA_OPTIONS})  # type: ignore[misc]
        return model, {**found, "quantized_layers": quantized, "prepare_kbit": opts["prepare_kbit"],
                       "base_checkpoint": checkpoint}

    return Technique(
        name=name,
        summary=summary,
        phase=Phase.LOAD,
        slot="base",
        options={**LORA_OPTIONS, **extra_options, "prepare_kbit": False},
        choices=dict(lora.TECHNIQUE.choices),
        ranges=dict(lora.TECHNIQUE.ranges),
        packages=("bitsandbytes", "peft"),
        preload=("bitsandbytes", "peft"),
        not_predicted=not_predicted,
        # qlora brings its own adapters; its base dtype is fixed; ZeRO-3 would partition packed
        # 4-bit storage, which needs bnb_4bit_quant_storage plumbing this suite does not do.
        conflicts=("lora", "mixed", "zero3"),
        load=load,
        apply=apply,
        validate=lambda names, opts: lora.targets_problem(opts),
        check_cell=lambda cell, opts: lora.peft_problem(cell.model, opts),
    )


def _skeleton(cell: Cell, attn_implementation: str, config: Any) -> Any:
    """The model a quantized load makes, on the meta device (the predictor quantizes its weights on
    fake tensors): built from the config in bf16, its layers replaced by transformers' own quantizer,
    which keeps the same ones unquantized as a load does (lm_head)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.quantizers import AutoHfQuantizer

    from .. import models

    hf_config = models.hf_config(models.get(cell.model), attn_implementation)
    hf_config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
    quantizer.preprocess_model(model, device_map={"": "meta"})
    return (quantizer.postprocess_model(model) or model).train()
