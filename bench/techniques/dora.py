"""DoRA (peft `use_dora=True`): LoRA with each adapted weight split into a magnitude and a direction.

Saves: what LoRA saves (no base gradients or optimizer states), with a per-output-channel magnitude
vector trained beside the rank-r adapters. Costs more than LoRA: each adapted layer computes the norm
of its adapted weight (base + BA) in every forward, and keeps what that needs for backward: read it
beside `lora` at the same options. Options are LoRA's; adapters in fp32 by default, as peft does.
"""

from __future__ import annotations

from typing import Any

from . import lora
from .base import Evidence, Options, Phase, Technique


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    model, found = lora.adapt(model, opts, use_dora=True)
    magnitudes = sum(1 for name, _ in model.named_modules() if name.endswith("lora_magnitude_vector"))
    if magnitudes == 0:
        raise RuntimeError("dora: peft made no magnitude vectors")
    return model, {**found, "dora_magnitudes": magnitudes}


def _validate(names: frozenset[str], opts: Options) -> str | None:
    unreadable = lora.targets_problem(opts)
    if unreadable:
        return unreadable
    deferred = sorted(names.intersection(("fsdp", "zero3")))
    if deferred:
        # peft initialises each magnitude from its base weight's norm: values a build on meta does not have
        return (f"DoRA's magnitudes are initialised from the base weights' norms, and {deferred[0]} builds the "
                "model on meta (bench/deferred.py) where no weight has a value yet")
    return None


TECHNIQUE = Technique(
    name="dora",
    summary="LoRA with weight-decomposed adapters (magnitude + direction): LoRA's savings, more compute",
    phase=Phase.WRAP,
    options=dict(lora.TECHNIQUE.options),
    choices=dict(lora.TECHNIQUE.choices),
    ranges=dict(lora.TECHNIQUE.ranges),
    packages=("peft",),
    preload=("peft",),
    conflicts=("lora", "qlora", "int8_lora"),
    apply=_apply,
    validate=_validate,
    check_cell=lambda cell, opts: lora.peft_problem(cell.model, opts, use_dora=True),
)
