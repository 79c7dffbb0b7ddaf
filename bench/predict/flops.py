"""The FLOPs of a step as the dispatcher runs it, by torch's own formulas (torch.utils.flop_counter's
registry: matmuls, convolutions; element-wise ops count nothing), and by formulas of our own for two
it lacks or miscounts: attention (under grouped-query attention; the CPU's kernel) and the grouped
matmul a mixture of experts runs its experts by. Recomputation under
activation checkpointing runs through the dispatcher again, so it is counted: what a checkpointing
policy costs in compute.

Beside the FLOPs, what a step's time is predicted from (bench/predict/steptime.py): how many ops the
host dispatched, how many of them launch a kernel, and each kernel's bytes and FLOPs, summed as a
roofline sorts them (compute-bound: its FLOPs; memory-bound: its bytes). The FLOPs a kernel runs, where
fewer than torch's formula counts: causal attention's, the scores at or below the diagonal that a flash
kernel computes (`causal_share`: about half; fake-run/25).

Not FlopCounterMode itself: its module tracker hooks every module's backward, and under activation
checkpointing that keeps the recomputed layers alive together (the fake run of `gc` at Llama-3.2-3B
seq 2048 batch 2 peaked at 32.9 GiB with it, 25.5 without: the GPU's figure).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from . import grouped_mm, rng_ops
from .steptime import StepWork

# Where a roofline turns from memory-bound to compute-bound, FLOPs a byte moved: an H100's or H200's dense bf16 rate
# over its memory bandwidth (989 TFLOP/s over 3.35 or 4.8 TB/s: 295 or 206), rounded. A kernel above it counts its
# FLOPs, one below its bytes: a rank-16 LoRA matmul over a long sequence is memory-bound, a projection is not.
RIDGE_FLOP_PER_BYTE = 256

# Ops that launch no kernel on a GPU though they are not views (torch's is_view): an allocation, a reshape of
# metadata. Their dispatch costs host time all the same.
NO_KERNEL_OPS = frozenset({"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                           "lift_fresh", "_reshape_alias", "resize_", "set_", "_local_scalar_dense"})

# Ops that are no work on a GPU, not counted at all: a fake tensor answers C++'s questions of its device through
# the dispatcher (`prim.device`: the autograd engine's and each op's device checks; a real tensor answers them
# without dispatching), and the profiler's record_function markers (checkpointing's). Before fake-run/22 each device
# question counted as an op and a kernel reading its tensor: a Llama-3.2-3B step at seq 2048 batch 2 was counted
# 20,319 ops, 17,258 kernels and 639 GB moved where it dispatches 6,168, 3,107 and 236 GB.
NOT_OPS_NAMESPACES = frozenset({"prim", "profiler"})

# Fused optimizers whose schemas mark their gradients written (`Tensor(b!)[] grads`) though their CUDA kernels write
# them back only when a GradScaler hands them `grad_scale` to unscale by (fused_adam_utils.cuh's and FusedSgdKernel.cu's
# conditional gradient store): without one, a step reads each gradient and writes it not. Counted as written before
# fake-run/26: a full fine-tune's step moved its gradients' bytes once more (Llama-3.2-3B in bf16: 6.4 GB).
GRADS_WRITTEN_WITH_SCALE_ONLY = frozenset({"_fused_adam_", "_fused_adamw_", "_fused_sgd_"})

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


def causal_share(s_q: int, s_k: int) -> float:
    """The share of attention's scores a causal kernel computes: query i sees keys 0..i (torch's top-left causal
    mask). A flash kernel skips the blocks above the diagonal, so runs about half the FLOPs torch's formula counts;
    a kernel given an explicit mask (a padded or packed batch: on a GPU, memory-efficient attention) cannot skip
    them, and an attention of plain matmuls (eager) computes every score."""
    seen = s_q * (s_q + 1) // 2 if s_q <= s_k else s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k
    return seen / (s_q * s_k)


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


def _running() -> list[FlopCount]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, FlopCount)]


def count_undispatched_matmul(a: Any, b: Any, out: Any, accumulate: bool = False) -> None:
    """`out = a @ b` (or `out += a @ b`, `accumulate`), a matmul a mirror of a GPU path stands for without
    dispatching it (its output written in place on the GPU: bench/predict/liger.py), added to the FlopCount
    running as torch's own op would be: its FLOPs, and the bytes it reads and writes (`out` read too when
    accumulated), sorted by the roofline. A skinny matmul into a large output is memory-bound: Liger's chunk of
    128 rows by a 128,256-token vocabulary writes its logits and reads the whole output layer for 100 GFLOP."""
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    moved = _nbytes(a) + _nbytes(b) + _nbytes(out) * (2 if accumulate else 1)
    for mode in _running():
        mode.ops += 1  # the GPU path dispatches it (torch.mm or addmm with out=): the host's time
        mode.add_kernel(flops, moved)


def count_undispatched_call(*args: Any, **kwargs: Any) -> None:
    """A kernel called with these arguments but not run (a Triton launch, inductor's generated kernel: never built
    on fake tensors), counted as reading or writing each tensor among them once (`count_undispatched_kernel`)."""
    import torch

    count_undispatched_kernel([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])


def count_undispatched_kernel(tensors: list[Any]) -> None:
    """A kernel the dispatcher does not see (a Triton launch: bench/predict/triton_launch.py), added to the
    FlopCount running as one memory-bound kernel reading or writing each of its tensors once."""
    for mode in _running():
        mode.add_kernel(0, sum(_nbytes(t) for t in tensors))


def _argument(func: Any, args: Any, kwargs: Any, name: str) -> Any:
    """An op's argument by its schema's name, positional or keyword (None where not given)."""
    if name in kwargs:
        return kwargs[name]
    names = [a.name for a in func._schema.arguments]
    index = names.index(name) if name in names else None
    return args[index] if index is not None and index < len(args) else None


def _nbytes(tensor: Any) -> int:
    """The bytes a kernel reads or writes of a tensor: its elements, but no more than its storage holds (an
    expanded tensor repeats its elements without reading them again)."""
    elements = int(tensor.numel()) * tensor.element_size()
    return elements if tensor.is_contiguous() else min(elements, tensor.untyped_storage().nbytes())


def _tensors(tree: Any) -> list[Any]:
    """The tensors among an op's arguments or outputs: a tensor, or lists and tuples of them (an op's schema
    nests no deeper), and a dict's values (keyword arguments)."""
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if not isinstance(tree, (list, tuple)):
        return []
    return [t for leaf in tree for t in _tensors(leaf)]


# (op, args, kwargs) -> the kernels a GPU runs for an op the fake run dispatches as one, each (FLOPs, bytes read and
# written); None: the op is one kernel, counted from its tensors as any (bitsandbytes' 4-bit matmul: bnb.py)
KernelWork = Callable[[Any, Any, Any], "list[tuple[int, int]] | None"]


def one_kernel_each(func: Any, args: Any, kwargs: Any) -> list[tuple[int, int]] | None:
    return None


class FlopCount(TorchDispatchMode):
    """While inside: `flops` sums the floating-point operations of every op with a known formula;
    `ops` counts the ops dispatched, `kernels` those that launch a kernel on a GPU, and of those,
    `compute_flops` sums the FLOPs of the compute-bound and `memory_bytes` the bytes (inputs and
    outputs) of the memory-bound (RIDGE_FLOP_PER_BYTE). An op whose GPU kernels `kernel_work` knows
    counts those."""

    supports_higher_order_operators = True  # compiled code's random-state wrappers (bench/predict/rng_ops.py)

    def __init__(self, kernel_work: KernelWork = one_kernel_each) -> None:
        super().__init__()
        self.kernel_work = kernel_work
        self.flops = 0
        self.ops = 0
        self.kernels = 0
        self.compute_flops = 0
        self.memory_bytes = 0
        self.grouped_mm_fallbacks = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return rng_ops.run(self, func, args, kwargs)
        out = func(*args, **kwargs)
        if func.namespace in NOT_OPS_NAMESPACES:
            return out
        self.ops += 1
        self.grouped_mm_fallbacks += grouped_mm.takes_fallback(func, args, kwargs)
        known = self.kernel_work(func, args, kwargs)
        if known is not None:
            for flops, moved in known:
                self.add_kernel(flops, moved)
            return out
        flops = self._op_flops(func, args, kwargs, out)
        if not func.is_view and func._opname not in NO_KERNEL_OPS:
            moved = sum(_nbytes(t) for t in _tensors((args, kwargs))) + self._written_bytes(func, args, kwargs, out)
            self.add_kernel(flops, moved, self._run_flops(func, args, kwargs, flops))
        else:
            self.flops += flops
        return out

    def add_kernel(self, flops: int, moved: int, run_flops: int | None = None) -> None:
        """One kernel doing `flops` (as torch's formulas count them) and reading and writing `moved` bytes, sorted by
        the roofline on the FLOPs it runs (`run_flops`, where fewer: a causal flash kernel's skipped scores)."""
        self.flops += flops
        self.kernels += 1
        ran = flops if run_flops is None else run_flops
        if ran > RIDGE_FLOP_PER_BYTE * moved:
            self.compute_flops += ran
        else:
            self.memory_bytes += moved

    @staticmethod
    def _written_bytes(func: Any, args: Any, kwargs: Any, out: Any) -> int:
        """The bytes an op writes: its outputs; an in-place op that returns nothing (`_foreach_add_`) writes
        the arguments its schema marks as written (a fused optimizer its gradients only under a GradScaler)."""
        written = _tensors(out)
        if not written:
            unscaled = func._opname in GRADS_WRITTEN_WITH_SCALE_ONLY and _argument(func, args, kwargs, "grad_scale") is None
            marked = [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
                      and not (unscaled and a.name == "grads")]
            written = _tensors([args[i] for i in marked if i < len(args)])
        return sum(_nbytes(t) for t in written)

    def work(self) -> StepWork:
        return StepWork(self.flops, self.ops, self.kernels, self.compute_flops, self.memory_bytes,
                        grouped_mm_fallbacks=self.grouped_mm_fallbacks)

    @staticmethod
    def _run_flops(func: Any, args: Any, kwargs: Any, flops: int) -> int:
        """The FLOPs the op's GPU kernel runs: causal attention's share of its scores (`causal_share`; fake-run/25),
        else all it counts."""
        if func._opname not in ATTENTION_OPS + ATTENTION_BACKWARD_OPS or not _argument(func, args, kwargs, "is_causal"):
            return flops
        query = args[0] if func._opname in ATTENTION_OPS else args[1]
        key = args[1] if func._opname in ATTENTION_OPS else args[2]
        return round(flops * causal_share(query.shape[2], key.shape[2]))

    @staticmethod
    def _op_flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
        from torch.utils.flop_counter import flop_registry

        if func.name() == "aten::_grouped_mm":
            return grouped_mm_flops(tuple(args[0].shape), tuple(args[1].shape))
        if func._opname in ATTENTION_OPS:
            return attention_flops(args[0], args[1], args[2], backward=False)
        if func._opname in ATTENTION_BACKWARD_OPS:  # (the output's gradient, query, key, value, ...)
            return attention_flops(args[1], args[2], args[3], backward=True)
        formula = flop_registry.get(func._overloadpacket)
        return 0 if formula is None else int(formula(*args, **kwargs, out_val=out))
