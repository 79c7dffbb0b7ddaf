"""bitsandbytes PagedAdamW8bit: 8-bit AdamW whose state lives in CUDA unified (managed) memory.

Saves: what adamw8bit saves; in addition, under memory pressure the driver pages optimizer state
to host RAM instead of failing, so a step that would OOM can still run. Costs: page migration when
that happens (slow steps). Managed memory is invisible to torch's allocator counters: only
`nvml_peak_gib` sees it, so compare this stack on that column. Needs CUDA.
Predicted: its large state buffers counted apart as managed memory, in the device figure only
(bench/predict/bnb.py).
"""

from __future__ import annotations

from typing import Any

from . import adamw8bit
from .base import Options, Phase, Technique, TrainSetup


def _make(params: list[Any], setup: TrainSetup, opts: Options) -> Any:
    return adamw8bit.make(params, setup, opts, paged=True)


TECHNIQUE = Technique(
    name="paged_adamw8bit",
    summary="8-bit AdamW in CUDA managed memory: pages to host under pressure instead of OOM",
    phase=Phase.OPTIMIZER,
    slot="optimizer",
    requires_cuda=True,
    packages=("bitsandbytes",),
    preload=("bitsandbytes",),
    make_optimizer=_make,
)
