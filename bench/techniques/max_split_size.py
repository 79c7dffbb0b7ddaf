"""PyTorch caching allocator that never splits large cached blocks (PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N).

The setting PyTorch's out-of-memory message long suggested when reserved memory far exceeds allocated.
Saves: fragmentation of large blocks. A cached block of N MiB or more ("oversize") is never carved up
by a smaller request, so it stays whole for the next request of its size; and before an OOM the
allocator first releases just the oversize blocks it needs, not its whole cache. Costs: a smaller
request cannot use an oversize cached block, nor a large one a block 20 MiB or more larger than
itself: each makes a new segment instead, so reserved memory can grow rather than shrink (the
predictor replays these rules: bench/predict/allocator.py). Must be set before CUDA initialises: an
ENV technique. Needs CUDA. Not with expandable_segments (slot "allocator"); with
garbage_collection_threshold, as the field's recipe has it.
"""

from __future__ import annotations

from . import _alloc_conf
from .base import Options, Phase, Technique


def _setting(opts: Options) -> str:
    return f"max_split_size_mb:{opts['mb']}"


_env, _apply = _alloc_conf.hooks("max_split_size", _setting)


TECHNIQUE = Technique(
    name="max_split_size",
    summary="allocator never splits cached blocks of N MiB or more: large blocks stay whole (may reserve more)",
    phase=Phase.ENV,
    options={"mb": 128},  # a common choice in the field; torch refuses 20 or less
    ranges={"mb": "(20, inf)"},
    slot="allocator",
    requires_cuda=True,
    env=_env,
    apply=_apply,
)
