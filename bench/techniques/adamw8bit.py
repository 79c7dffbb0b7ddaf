"""bitsandbytes AdamW8bit: AdamW's two moments stored in 8 bits (block-wise quantized).

Saves: optimizer state drops from 2 x the parameter dtype (4 B/param in pure bf16, 8 B in fp32)
to about 2 B/param (plus small per-block scales). Costs: quantize / dequantize in each step;
tensors under 4096 elements keep 32-bit state (bitsandbytes' min_8bit_size). Runs on the CPU with
bitsandbytes >= 0.48, so its code path is tested without a GPU.
"""

from __future__ import annotations

from typing import Any

from .base import Options, Phase, Technique, TrainSetup


def make(params: list[Any], setup: TrainSetup, opts: Options, paged: bool = False) -> Any:
    import bitsandbytes as bnb

    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    return cls(params, lr=setup.lr)


TECHNIQUE = Technique(
    name="adamw8bit",
    summary="bitsandbytes 8-bit AdamW: ~2 B/param of optimizer state instead of 4 (bf16) or 8 (fp32)",
    phase=Phase.OPTIMIZER,
    slot="optimizer",
    packages=("bitsandbytes",),
    preload=("bitsandbytes",),
    make_optimizer=make,
)
