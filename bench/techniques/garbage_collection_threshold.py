"""PyTorch caching allocator that frees its oldest cached segments early (PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:F).

A setting often copied from fragmentation advice. Saves: under a memory fraction
(`torch.cuda.set_per_process_memory_fraction`, which is how `bench fit` emulates a smaller card), once
what the allocator reserves passes F of the fraction's allowance, a request that no cached block holds
first makes the allocator cudaFree whole cached segments of the large pool that have gone unused
longest (those older than the average, repeated until reserved is back under F), instead of waiting
for a segment that does not fit and then releasing the whole cache with a device-wide synchronisation
(counted in alloc_retries). Costs: cudaFree and cudaMalloc again for segments that would have been
reused. Without a memory fraction torch never runs it (c10/cuda/CUDACachingAllocator.cpp calls
garbage_collect_cached_blocks only when `set_fraction` is true): on a whole card the setting changes
nothing, and the predictor says so (bench/predict/allocator.py replays it only under a fraction).
Must be set before CUDA initialises: an ENV technique. Needs CUDA. One allocator setting per stack
(slot "allocator").
"""

from __future__ import annotations

import os
from typing import Any

from .base import Evidence, Options, Phase, Technique


def _setting(opts: Options) -> str:
    return f"garbage_collection_threshold:{opts['fraction']}"


def _env(opts: Options) -> dict[str, str]:
    return {"PYTORCH_CUDA_ALLOC_CONF": _setting(opts)}


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    seen = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if _setting(opts) not in seen.split(","):
        raise RuntimeError(f"garbage_collection_threshold: PYTORCH_CUDA_ALLOC_CONF is {seen!r} in the worker")
    return model, {"alloc_conf": seen}


TECHNIQUE = Technique(
    name="garbage_collection_threshold",
    summary="under a memory fraction, allocator frees its oldest cached segments past F of it (no effect without one)",
    phase=Phase.ENV,
    options={"fraction": 0.6},  # the value field recipes copy; torch requires 0 < F < 1
    ranges={"fraction": "(0, 1)"},
    slot="allocator",
    requires_cuda=True,
    env=_env,
    apply=_apply,
)
