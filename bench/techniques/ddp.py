"""DDP: PyTorch's DistributedDataParallel, every rank a full replica, gradients all-reduced.

Saves: nothing per GPU (it is the data-parallel baseline the sharding engines are measured
against: fsdp and zero2/3 on the same ranks). Costs: the whole model, gradients and optimizer state
on every GPU, plus DDP's gradient buckets (`bucket_mb` each): a second copy of the gradients unless
`bucket_view=true` makes the gradients views into the buckets; an all-reduce per bucket during
backward. On one GPU it still wraps the model (the buckets and the hooks are its cost there).
Predicted: PyTorch's DDP itself on fake tensors and torch's fake process group, its C++ reducer's
buckets counted; what it does by value is set aside (bench/predict/ddp.py).
"""

from __future__ import annotations

from dataclasses import replace

from .base import Options, Phase, Technique, TrainSetup


def _configure(setup: TrainSetup, opts: Options) -> TrainSetup:
    return replace(setup, engine="ddp")


TECHNIQUE = Technique(
    name="ddp",
    summary="DistributedDataParallel: full replica per GPU, gradients all-reduced in buckets",
    phase=Phase.ENGINE,
    slot="engine",
    options={"bucket_mb": 25, "bucket_view": False},
    ranges={"bucket_mb": "(0, inf)"},
    configure=_configure,
)
