"""The FLOPs of a step as the dispatcher runs it, by torch's own formulas (torch.utils.flop_counter's
registry: matmuls, attention, convolutions; element-wise ops count nothing). Recomputation under
activation checkpointing runs through the dispatcher again, so it is counted: what a checkpointing
policy costs in compute.

Not FlopCounterMode itself: its module tracker hooks every module's backward, and under activation
checkpointing that keeps the recomputed layers alive together (the fake run of `gc` at Llama-3.2-3B
seq 2048 batch 2 peaked at 32.9 GiB with it, 25.5 without: the GPU's figure).
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class FlopCount(TorchDispatchMode):
    """While inside: `flops` sums the floating-point operations of every op with a known formula."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out
