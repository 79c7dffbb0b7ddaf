"""The FLOPs of a step as the dispatcher runs it, by torch's own formulas (torch.utils.flop_counter's
registry: matmuls, attention, convolutions; element-wise ops count nothing), and the grouped matmul
a mixture of experts runs its experts by, which that registry lacks. Recomputation under
activation checkpointing runs through the dispatcher again, so it is counted: what a checkpointing
policy costs in compute.

Not FlopCounterMode itself: its module tracker hooks every module's backward, and under activation
checkpointing that keeps the recomputed layers alive together (the fake run of `gc` at Llama-3.2-3B
seq 2048 batch 2 peaked at 32.9 GiB with it, 25.5 without: the GPU's figure).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The fake run's sdpa dispatches to flash attention for the CPU, which torch's registry gives a formula only
# from torch 2.15 on; before, attention counted nothing. The GPU's kernels (flash, cuDNN) compute the same
# products from the same query, key and value (and, backward, the output's gradient before them), so a CUDA
# flash op's formula counts the CPU one: the first arguments are the same in both.
CPU_ATTENTION_AS = {"_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_flash_attention_for_cpu_backward":
                        "_scaled_dot_product_flash_attention_backward"}


def grouped_mm_flops(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """A grouped matmul's FLOPs (torch's registry has no formula for it): a mixture of experts runs its
    experts by it, each routed row through its expert's weight. 2-D by 3-D (the rows by every expert's
    weight, forward and the input's gradient) and 2-D by 2-D (the weights' gradient, the rows split among
    the experts): 2 x rows x in x out over all the groups; 3-D by 3-D: a batch of matmuls; 3-D by 2-D:
    one matrix of rows by the groups' weights side by side."""
    if len(a) == 2:
        return 2 * a[0] * a[1] * b[-1]
    if len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[1] * a[2] * b[1]


class FlopCount(TorchDispatchMode):
    """While inside: `flops` sums the floating-point operations of every op with a known formula."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.name() == "aten::_grouped_mm":
            self.flops += grouped_mm_flops(tuple(args[0].shape), tuple(args[1].shape))
            return out
        formula = flop_registry.get(func._overloadpacket)
        if formula is None and func._opname in CPU_ATTENTION_AS:
            formula = flop_registry.get(getattr(torch.ops.aten, CPU_ATTENTION_AS[func._opname]))
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out
