"""PyTorch caching allocator with expandable segments (PYTORCH_CUDA_ALLOC_CONF).

Saves: fragmentation. Segments grow in place instead of new fixed-size blocks being reserved, so
reserved memory stays closer to allocated and a large allocation late in a step (logits, the
optimizer step) is less likely to OOM while free memory sits in fragments. Costs: little; mapping
pages on growth. Must be set before CUDA initialises: it is an ENV technique, applied in the
worker's environment before torch is imported. Needs CUDA. One allocator setting per stack.
"""

from __future__ import annotations

import os
from typing import Any

from .base import Evidence, Options, Phase, Technique

SETTING = "expandable_segments:True"


def _env(opts: Options) -> dict[str, str]:
    return {"PYTORCH_CUDA_ALLOC_CONF": SETTING}


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    seen = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if SETTING not in seen:
        raise RuntimeError(f"expandable_segments: PYTORCH_CUDA_ALLOC_CONF is {seen!r} in the worker")
    return model, {"alloc_conf": seen}


TECHNIQUE = Technique(
    name="expandable_segments",
    summary="allocator segments grow in place: less fragmentation (reserved closer to allocated)",
    phase=Phase.ENV,
    slot="allocator",  # PYTORCH_CUDA_ALLOC_CONF holds one setting per stack (max_split_size, garbage_collection_threshold)
    requires_cuda=True,
    env=_env,
    apply=_apply,
)
