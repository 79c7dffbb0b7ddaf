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
Must be set before CUDA initialises: an ENV technique. Needs CUDA. Combines with max_split_size, as the
recipe copied in the field does (`garbage_collection_threshold:0.6,max_split_size_mb:128`); not with
expandable_segments, whose memory the collection never releases (it frees only whole cudaMalloc'ed
segments) and which the model does not replay together with it.
"""

from __future__ import annotations

from . import _alloc_conf
from .base import Options, Phase, Technique


def _setting(opts: Options) -> str:
    return f"garbage_collection_threshold:{opts['fraction']}"


_env, _apply = _alloc_conf.hooks("garbage_collection_threshold", _setting)


TECHNIQUE = Technique(
    name="garbage_collection_threshold",
    summary="under a memory fraction, allocator frees its oldest cached segments past F of it (no effect without one)",
    phase=Phase.ENV,
    options={"fraction": 0.6},  # the value field recipes copy; torch requires 0 < F < 1
    ranges={"fraction": "(0, 1)"},
    conflicts=("expandable_segments",),
    requires_cuda=True,
    env=_env,
    apply=_apply,
)
