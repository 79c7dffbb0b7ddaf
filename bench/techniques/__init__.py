"""The technique catalogue: one small file per technique, registered here by name."""

from __future__ import annotations

from . import (
    adamw,
    adamw8bit,
    eager_attention,
    expandable_segments,
    fault,
    fsdp,
    gc,
    grad_accum,
    int8_lora,
    liger,
    lora,
    mixed,
    offload,
    packing,
    padding,
    paged_adamw8bit,
    qlora,
    zero2,
    zero3,
)
from .base import Phase, Technique, TrainSetup

_MODULES = (adamw, adamw8bit, eager_attention, expandable_segments, fault, fsdp, gc, grad_accum, int8_lora, liger, lora,
            mixed, offload, packing, padding, paged_adamw8bit, qlora, zero2, zero3)
REGISTRY: dict[str, Technique] = {m.TECHNIQUE.name: m.TECHNIQUE for m in _MODULES}

__all__ = ["REGISTRY", "Phase", "Technique", "TrainSetup"]
