"""DeepSpeed ZeRO stage 2: optimizer states and gradients partitioned across data-parallel ranks.

Saves: with N GPUs, each keeps 1/N of the fp32 master weights, Adam states and gradients. On one GPU
it partitions nothing, so alone it saves nothing: it is the base that `offload` moves to host RAM.
Costs: DeepSpeed's bf16 mode keeps fp32 master weights and fp32 Adam states (16 B/param against the
pure-bf16 baseline's 8: compare with `mixed`), plus reduce / all-gather buckets; communication when
N > 1. Optimizer: torch AdamW (`adam=torch`, no JIT build) or DeepSpeed's (`adam=deepspeed`).
"""

from __future__ import annotations

from . import _zero

TECHNIQUE = _zero.technique(2, "DeepSpeed ZeRO-2: optimizer state + gradients sharded over ranks; fp32 master weights")
