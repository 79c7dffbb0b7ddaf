"""APOLLO (`apollo-torch`): Adam's moments in a random low-rank projection, used only to scale the
raw gradient channel by channel (SGD-like memory, AdamW-like updates).

Saves: optimizer state, like GaLore but without an SVD: each 2-D weight of the decoder layers keeps
its moments at `rank` dimensions of a random projection (regenerated from a seed every
`update_proj_gap` steps); the embedding, output layer, norms and biases keep full AdamW state.
Full-parameter training. Costs: a projection per weight per step and a non-fused AdamW; `rank=1`
with `scale_type=tensor` is APOLLO-Mini. Not exact: losses follow the baseline's only at the first step.
"""

from __future__ import annotations

from typing import Any

from ._lowrank import LowRank, param_groups
from .base import Options, Phase, Technique, TrainSetup


def make(params: list[Any], setup: TrainSetup, opts: Options) -> LowRank:
    from apollo_torch import APOLLOAdamW

    low_rank = {"rank": opts["rank"], "proj": "random", "scale_type": opts["scale_type"], "scale": opts["scale"],
                "update_proj_gap": opts["update_proj_gap"], "proj_type": "std"}
    return LowRank(APOLLOAdamW(param_groups(params, low_rank), lr=setup.lr), "apollo", opts["rank"])


TECHNIQUE = Technique(
    name="apollo",
    summary="APOLLO: random rank-r projection of Adam's moments scales the raw gradient (SGD-like state)",
    phase=Phase.OPTIMIZER,
    slot="optimizer",
    options={"rank": 256, "scale_type": "channel", "scale": 1.0, "update_proj_gap": 200},
    choices={"scale_type": ("channel", "tensor")},
    ranges={"rank": "[1, inf)", "update_proj_gap": "[1, inf)", "scale": "(0, inf)"},
    packages=("apollo_torch",),
    conflicts=("zero2", "zero3", "fsdp", "lora", "dora", "qlora", "int8_lora"),  # full-parameter, plain engine
    make_optimizer=make,
)
