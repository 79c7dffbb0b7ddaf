"""Activation checkpointing (gradient checkpointing).

Saves: activation memory. Each decoder layer keeps only its input for backward instead of every
intermediate tensor, so activations shrink from O(layers x per-layer intermediates) to O(layers x
hidden) plus one layer's intermediates. Costs: one extra forward per layer in backward (about a
third more compute for the same tokens). Exact: the losses must match the baseline's.
"""

from __future__ import annotations

from typing import Any

from .. import models
from .base import Evidence, Options, Phase, Technique


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    kwargs = {"use_reentrant": opts["use_reentrant"]}
    # transformers >= 5.2x renamed the method; the GPU image's 5.17 only has the old name
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    checkpointed = sum(1 for m in model.modules() if getattr(m, "gradient_checkpointing", False))
    if checkpointed == 0:
        raise RuntimeError("gc: no module reports gradient_checkpointing=True after enabling it")
    return model, {"gc_modules": checkpointed}


TECHNIQUE = Technique(
    name="gc",
    summary="activation checkpointing: activations kept per layer input only; ~1/3 more compute",
    phase=Phase.PATCH,
    options={"use_reentrant": False},
    apply=_apply,
    check_cell=lambda cell, opts: models.checkpointing_problem(cell.model),
)
