"""The FLOPs of a step as the dispatcher runs it, by torch's own formulas (torch.utils.flop_counter's
registry: matmuls, convolutions; element-wise ops count nothing), and by formulas of our own for two
it lacks or miscounts: attention (under grouped-query attention; the CPU's kernel) and the grouped
matmul a mixture of experts runs its experts by. Recomputation under
activation checkpointing runs through the dispatcher again, so it is counted: what a checkpointing
policy costs in compute.

Not FlopCounterMode itself: its module tracker hooks every module's backward, and under activation
checkpointing that keeps the recomputed layers alive together (the fake run of `gc` at Llama-3.2-3B
seq 2048 batch 2 peaked at 32.9 GiB with it, 25.5 without: the GPU's figure).
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# sdpa's attention kernels, forward and backward: the fake run dispatches the CPU's, a GPU one of the others.
# They are counted here, not by torch's registry: its formulas come for the CPU's only from torch 2.15 on (before,
# attention counted nothing), and torch 2.11's assert that keys have as many heads as queries, which grouped-query
# attention passed as such (transformers 5.17's sdpa call, enable_gqa) does not have.
ATTENTION_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
ATTENTION_BACKWARD_OPS = tuple(f"{name}_backward" for name in ATTENTION_OPS)


def attention_flops(query: Any, key: Any, value: Any, backward: bool) -> int:
    """Attention's FLOPs, from its query, key and value tensors, as torch's formulas count them (causal
    masking not subtracted), every query head counted with the key and value heads it shares under
    grouped-query attention. Forward: scores (q @ k) and out (scores @ v). Backward: the scores again,
    the scores' and v's gradients from the output's, then q's and k's: 2 x batch x query heads x s_q x
    s_k times (d_qk + d_v) forward, (3 d_qk + 2 d_v) backward."""
    batch, heads, s_q, d_qk = query.shape
    s_k, d_v = key.shape[2], value.shape[3]
    return 2 * batch * heads * s_q * s_k * ((3 * d_qk + 2 * d_v) if backward else (d_qk + d_v))


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


def count_undispatched_matmul(rows: int, inner: int, cols: int) -> None:
    """A (rows x inner) @ (inner x cols) matmul a mirror of a GPU path stands for without dispatching it
    (its output written in place on the GPU: bench/predict/liger.py), added to the FlopCount running."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, FlopCount):
            mode.flops += 2 * rows * inner * cols


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
        if func._opname in ATTENTION_OPS:
            self.flops += attention_flops(args[0], args[1], args[2], backward=False)
            return out
        if func._opname in ATTENTION_BACKWARD_OPS:  # (the output's gradient, query, key, value, ...)
            self.flops += attention_flops(args[1], args[2], args[3], backward=True)
            return out
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out
