"""Eager attention instead of the baseline's sdpa (PyTorch's fused / memory-efficient kernels).

Eager materializes the seq x seq score and probability matrices per head for backward: memory
grows quadratically with sequence length. sdpa (flash / memory-efficient backends) keeps it linear.
The stack exists to show that cost, not to recommend eager.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .base import Evidence, Options, Phase, Technique, TrainSetup


def _configure(setup: TrainSetup, opts: Options) -> TrainSetup:
    return replace(setup, attn_implementation="eager")


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    used = model.config._attn_implementation
    if used != "eager":
        raise RuntimeError(f"eager_attention: the built model uses {used!r} attention")
    return model, {"attn_implementation": used}


TECHNIQUE = Technique(
    name="eager_attention",
    summary="eager attention instead of sdpa: the seq^2 scores and probabilities are saved for backward",
    phase=Phase.LOAD,
    slot="attention",
    configure=_configure,
    apply=_apply,
)
