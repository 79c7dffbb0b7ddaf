"""The technique catalogue: one small file per technique, registered here by name."""

from __future__ import annotations

from . import (
    adamw,
    adamw8bit,
    eager_attention,
    expandable_segments,
    fault,
    gc,
    liger,
    lora,
    mixed,
    offload,
    paged_adamw8bit,
    zero2,
    zero3,
)
from .base import Phase, Technique, TrainSetup

REGISTRY: dict[str, Technique] = {
    t.name: t
    for t in (
        adamw.TECHNIQUE, adamw8bit.TECHNIQUE, eager_attention.TECHNIQUE, expandable_segments.TECHNIQUE, fault.TECHNIQUE,
        gc.TECHNIQUE, liger.TECHNIQUE, lora.TECHNIQUE, mixed.TECHNIQUE, offload.TECHNIQUE, paged_adamw8bit.TECHNIQUE,
        zero2.TECHNIQUE, zero3.TECHNIQUE,
    )
}

__all__ = ["REGISTRY", "Phase", "Technique", "TrainSetup"]
