"""torch AdamW with an explicit implementation: fused (the baseline's), foreach, or a for-loop.

Saves / costs: the three keep the same state (two moments in the parameter dtype). `foreach`
batches the update over lists of tensors and allocates temporaries the size of a group of
parameters at the optimizer step, which can move a large model's peak by GiBs; `forloop` updates one
parameter at a time (smallest temporaries, slowest). `fused` runs one kernel per group, no
temporaries. Pinned in every cell, since torch's default choice depends on device and version.
"""

from __future__ import annotations

from dataclasses import replace

from .base import Options, Phase, Technique, TrainSetup


def _configure(setup: TrainSetup, opts: Options) -> TrainSetup:
    return replace(setup, optimizer_impl=opts["impl"])


TECHNIQUE = Technique(
    name="adamw",
    summary="torch AdamW, implementation pinned: fused (baseline) | foreach (step temporaries) | forloop",
    phase=Phase.OPTIMIZER,
    options={"impl": "fused"},
    choices={"impl": ("fused", "foreach", "forloop")},
    slot="optimizer",
    configure=_configure,
)
