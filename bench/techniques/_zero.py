"""What the ZeRO stages share (not a technique): the DeepSpeed engine selected, its optimizer option."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..distributed import SINGLE_RANK_ENV
from .base import Options, Phase, Technique, TrainSetup

# DeepSpeed owns precision (bf16 + fp32 master weights) and the optimizer: no other may be stacked.
OWNED_BY_ENGINE = ("mixed", "adamw", "adamw8bit", "paged_adamw8bit")


def technique(stage: int, summary: str) -> Technique:
    def fragment(opts: Options) -> dict[str, Any]:
        # stage3_gather_16bit_weights_on_model_save: a model-only checkpoint save gathers the shards
        return {"zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": stage == 3},
                "optimizer": {"params": {"torch_adam": opts["adam"] == "torch"}}}

    def configure(setup: TrainSetup, opts: Options) -> TrainSetup:
        # ZeRO-3 partitions the parameters, so it builds as a checkpoint loads under it: never whole
        return replace(setup, engine="deepspeed", build_on_meta=stage == 3)

    return Technique(
        name=f"zero{stage}",
        summary=summary,
        phase=Phase.ENGINE,
        slot="engine",
        options={"adam": "torch"},
        choices={"adam": ("torch", "deepspeed")},
        packages=("deepspeed",),
        not_predicted="the DeepSpeed engine (partitioned fp32 master weights, its own buffers) is not simulated yet",
        conflicts=OWNED_BY_ENGINE,
        env=lambda opts: dict(SINGLE_RANK_ENV),  # torchrun's own values win on several ranks
        configure=configure,
        ds_config=fragment,
    )
