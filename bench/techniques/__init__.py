"""The technique catalogue: one small file per technique, registered here by name."""

from __future__ import annotations

from . import fault, gc, lora, mixed
from .base import Phase, Technique, TrainSetup

REGISTRY: dict[str, Technique] = {t.name: t for t in (gc.TECHNIQUE, lora.TECHNIQUE, mixed.TECHNIQUE, fault.TECHNIQUE)}

__all__ = ["REGISTRY", "Phase", "Technique", "TrainSetup"]
