"""Mixed precision: fp32 master weights, forward and backward under bf16 autocast.

Compared with the baseline's pure bf16 (weights, gradients and AdamW states all bf16), it costs
memory: weights and gradients double (4 B each per parameter) and AdamW's two states double
(8 B per parameter), 16 B/param instead of 8 B/param, plus bf16 copies of weights made by autocast.
It buys numerical headroom: small updates are not lost to bf16 rounding. This is the precision
DeepSpeed and most trainers use, so compare engines against this stack, not only the baseline.
"""

from __future__ import annotations

from dataclasses import replace

from .base import Options, Phase, Technique, TrainSetup


def _configure(setup: TrainSetup, opts: Options) -> TrainSetup:
    return replace(setup, param_dtype="fp32", autocast_dtype="bf16")


TECHNIQUE = Technique(
    name="mixed",
    summary="fp32 master weights + bf16 autocast: 16 B/param of state instead of pure bf16's 8",
    phase=Phase.LOAD,
    slot="precision",
    configure=_configure,
)
