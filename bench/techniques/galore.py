"""GaLore (`galore-torch`): Adam's moments kept in a low-rank projection of each gradient.

Saves: optimizer state. Each 2-D weight of the decoder layers keeps its moments at `rank` columns
(2 x rank x rows instead of 2 x rows x cols values) plus its projection matrix (rows x rank), renewed
by an SVD of the gradient every `update_proj_gap` steps; the embedding, output layer, norms and
biases keep full AdamW state. Full-parameter training: every weight still has its gradient.
Costs: an SVD per projected weight every `update_proj_gap` steps (the first step included), a
projection matmul per weight per step, and a non-fused AdamW. Not exact: the update is the projected
one, so losses follow the baseline's only at the first step.
"""

from __future__ import annotations

from typing import Any

from ._lowrank import LowRank, param_groups
from .base import Options, Phase, Technique, TrainSetup


def make(params: list[Any], setup: TrainSetup, opts: Options) -> LowRank:
    from galore_torch import GaLoreAdamW

    low_rank = {"rank": opts["rank"], "update_proj_gap": opts["update_proj_gap"], "scale": opts["scale"],
                "proj_type": "std"}
    optimizer = GaLoreAdamW(param_groups(params, low_rank), lr=setup.lr, no_deprecation_warning=True)
    return LowRank(optimizer, "galore", opts["rank"])


TECHNIQUE = Technique(
    name="galore",
    summary="GaLore: Adam moments of each layer weight in a rank-r gradient projection (SVD every N steps)",
    phase=Phase.OPTIMIZER,
    slot="optimizer",
    options={"rank": 128, "update_proj_gap": 200, "scale": 0.25},
    ranges={"rank": "[1, inf)", "update_proj_gap": "[1, inf)", "scale": "(0, inf)"},
    packages=("galore_torch",),
    conflicts=("zero2", "zero3", "fsdp", "lora", "dora", "qlora", "int8_lora"),  # full-parameter, plain engine
    make_optimizer=make,
)
