"""DeepSpeed ZeRO stage 3: parameters too are partitioned, gathered layer by layer when used.

Saves: with N GPUs, weights, gradients, master weights and Adam states all divided by N; with
`offload(params=true)` parameters live in host RAM between uses. On one GPU, alone, it saves nothing.
Costs: what zero2 costs (fp32 master weights: compare with `mixed`), plus gathering each layer's
parameters in forward and again in backward (prefetch buffers), and a gather for checkpoint saves.
Built as a checkpoint loads under ZeRO-3 (bench/deferred.py): on the meta device, then each
parameter given its memory and partitioned at once (DeepSpeed's zero.Init), then the build's init
replayed into the partitions one gathered parameter at a time, so no GPU ever holds the whole model
(the weights are still a plain build's of the same seed, bit for bit).
"""

from __future__ import annotations

from . import _zero

TECHNIQUE = _zero.technique(3, "DeepSpeed ZeRO-3: parameters, gradients and optimizer state sharded over ranks")
