"""DeepSpeed ZeRO stage 3: parameters too are partitioned, gathered layer by layer when used.

Saves: with N GPUs, weights, gradients, master weights and Adam states all divided by N; with
`offload(params=true)` parameters live in host RAM between uses. On one GPU, alone, it saves nothing.
Costs: what zero2 costs (fp32 master weights: compare with `mixed`), plus gathering each layer's
parameters in forward and again in backward (prefetch buffers), and a gather for checkpoint saves.
The model is built whole and partitioned by deepspeed.initialize (not under zero.Init), so the
build peak is the full bf16 model.
"""

from __future__ import annotations

from . import _zero

TECHNIQUE = _zero.technique(3, "DeepSpeed ZeRO-3: parameters, gradients and optimizer state sharded over ranks")
