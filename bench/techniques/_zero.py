"""What the ZeRO stages share (not a technique): the DeepSpeed engine selected, its optimizer option, and
the size of its gradient reduction bucket.

`bucket` is DeepSpeed's `reduce_bucket_size`, in elements: the 16-bit buffer that backward's gradients
are copied into before they are reduced to their ranks. DeepSpeed allocates it whole whatever the
model's size (5e8 elements by default: 1 GB in bf16; ZeRO-2 for each backward, ZeRO-3 from initialize
on), so for a small model it can outweigh the gradients themselves. A smaller bucket saves that memory
and costs more, smaller reductions. The suite pins DeepSpeed's default, so a DeepSpeed release that
changes it does not change the cells."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..distributed import SINGLE_RANK_ENV
from .base import Options, Phase, Technique, TrainSetup

# DeepSpeed owns precision (bf16 + fp32 master weights) and the optimizer: no other may be stacked.
OWNED_BY_ENGINE = ("mixed", "adamw", "adamw8bit", "paged_adamw8bit")
DEFAULT_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default reduce_bucket_size (0.19.8)


def technique(stage: int, summary: str) -> Technique:
    def fragment(opts: Options) -> dict[str, Any]:
        # stage3_gather_16bit_weights_on_model_save: a model-only checkpoint save gathers the shards
        return {"zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": stage == 3,
                                      "reduce_bucket_size": opts["bucket"]},
                "optimizer": {"params": {"torch_adam": opts["adam"] == "torch"}}}

    def configure(setup: TrainSetup, opts: Options) -> TrainSetup:
        # ZeRO-3 partitions the parameters, so it builds as a checkpoint loads under it: never whole
        return replace(setup, engine="deepspeed", build_on_meta=stage == 3)

    return Technique(
        name=f"zero{stage}",
        summary=summary,
        phase=Phase.ENGINE,
        slot="engine",
        options={"adam": "torch", "bucket": DEFAULT_BUCKET_ELEMENTS},
        added_options=("bucket",),  # after the ZeRO cells were published: their ids stay
        choices={"adam": ("torch", "deepspeed")},
        ranges={"bucket": "[1, inf)"},
        packages=("deepspeed",),
        not_predicted="the DeepSpeed engine (partitioned fp32 master weights, its own buffers) is not simulated yet",
        conflicts=OWNED_BY_ENGINE,
        env=lambda opts: dict(SINGLE_RANK_ENV),  # torchrun's own values win on several ranks
        configure=configure,
        ds_config=fragment,
    )
