"""PyTorch caching allocator with expandable segments (PYTORCH_CUDA_ALLOC_CONF).

Saves: fragmentation. Segments grow in place instead of new fixed-size blocks being reserved, so
reserved memory stays closer to allocated and a large allocation late in a step (logits, the
optimizer step) is less likely to OOM while free memory sits in fragments. Costs: little; mapping
pages on growth. Must be set before CUDA initialises: it is an ENV technique, applied in the
worker's environment before torch is imported. Needs CUDA. The only allocator setting of its stack:
the model replays neither max_split_size nor garbage_collection_threshold with it.
"""

from __future__ import annotations

from . import _alloc_conf
from .base import Phase, Technique

SETTING = "expandable_segments:True"

_env, _apply = _alloc_conf.hooks("expandable_segments", lambda opts: SETTING)


TECHNIQUE = Technique(
    name="expandable_segments",
    summary="allocator segments grow in place: less fragmentation (reserved closer to allocated)",
    phase=Phase.ENV,
    slot="allocator",  # not with max_split_size (not modelled together), nor garbage_collection_threshold (its conflicts)
    requires_cuda=True,
    env=_env,
    apply=_apply,
)
