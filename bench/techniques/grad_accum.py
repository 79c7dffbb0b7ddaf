"""Gradient accumulation: the cell's batch in `steps` micro-batches, gradients summed, one optimizer step.

Saves: activation memory, which scales with the micro-batch (batch / steps), at the same effective
batch and the same loss (exact up to summation order: the losses must track the baseline's).
Costs: smaller matmuls use the GPU less well, and weights are read `steps` times per optimizer step.
The batch must divide by `steps`. Not combined with the DeepSpeed engines here (they accumulate
through their own `gradient_accumulation_steps`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .base import Options, Phase, Technique, TrainSetup

if TYPE_CHECKING:
    from ..cells import Cell


def _configure(setup: TrainSetup, opts: Options) -> TrainSetup:
    return replace(setup, micro_batches=opts["steps"])


def _check_cell(cell: Cell, opts: Options) -> str | None:
    if cell.batch_size % opts["steps"]:
        return f"batch {cell.batch_size} does not split into {opts['steps']} equal micro-batches"
    return None


TECHNIQUE = Technique(
    name="grad_accum",
    summary="gradient accumulation: same batch in smaller micro-batches, less activation memory, slower",
    phase=Phase.OPTIMIZER,
    options={"steps": 2},
    conflicts=("zero2", "zero3"),
    configure=_configure,
    ranges={"steps": "[2, inf)"},
    check_cell=_check_cell,
)
