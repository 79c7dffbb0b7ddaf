"""torch.compile on fake tensors: inductor's generated code run with its kernels stubbed out.

The `compile` technique compiles each decoder layer (bench/techniques/compile.py); cut cross-entropy's
`impl=torch_compile` loss is a compiled function too (bench/predict/cce.py). Their memory is not eager's:
AOTAutograd's partitioner chooses what forward saves for backward (fewer tensors than eager, recomputing
cheap ones), and inductor's fused kernels allocate their outputs from a plan of their own, reusing buffers.
Both are decided at compile time, from shapes: they need no values. So while a cell is predicted, dynamo,
AOTAutograd and inductor compile for real, for the CPU the fake tensors are on, and the compiled code runs
with what needs values taken out (`predicting`):

- the kernels inductor generates (C++ for a CPU) are never built: each becomes a function that does
  nothing, its outputs already allocated by the generated code;
- the generated code's own allocations and views (`empty_strided_cpu`, `reinterpret_tensor`, torch's C++
  helpers, unseen by a dispatch mode) go through torch's dispatcher instead, so the counter sees each buffer
  made and freed, in the code's order; its size and alignment asserts are dropped (a fake tensor has no
  address);
- the ops the generated code leaves to ATen (matmuls, attention) run as any op on fake tensors;
- the counter and the FLOP counter let compilation itself run unseen (`ignore_compile_internals`): dynamo
  does not compile under a dispatch mode that would see its tracing, and its runtime is what a GPU measures;
  the random-state wrappers torch 2.13's compiled code puts around the attention under checkpointing reach
  them whole, and run the op inside as any other (bench/predict/rng_ops.py).

What this leaves out: inductor plans a CPU's kernels, not a GPU's; where its fusion choices differ (Triton's
reductions and templates) the buffers differ. The GPU checks it (H200, Llama-3.2-3B, seq 2048 batch 2):
`compile` 33.618 GiB peak allocated predicted against 33.619 measured, `compile + gc` 25.468 against 25.469.
Liger's Triton kernels in a compiled layer are taken into its graph as on a GPU, each an opaque op writing the
buffers it mutates (bench/predict/triton_launch.py), so the partitioner and inductor plan around them as they do
there. `compile + gc + liger` on the H200 (2026-11-29) peaked at 25.471 GiB, 0.66 above gc + liger: not the
compiled layers, but the compile technique's own evidence hook as it then was, which kept the tied lm_head's
saved gradient from being summed in place (bench/techniques/compile.py); the fake run, as the step runs now,
predicts 24.812, what gc + liger measured (24.812), and the same 4 graphs and 1.43706 GiB saved for backward
as the H200 counted. Not predicted: the whole model compiled with Liger (`unsupported_reason`).
Not modelled: what the first step's compilation allocates on the GPU (Triton's autotuning runs its
candidate configs on copies of the arguments they mutate). For the step time, each generated kernel counts as
one reading or writing each of its tensors once (bench/predict/steptime.py times compile cells, not with Liger).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from unittest import mock

from . import triton_launch

if TYPE_CHECKING:
    from ..stacks import Stack


def applies(stack: Stack) -> bool:
    """Whether the cell runs compiled code: the compile technique, or cut cross-entropy's torch_compile loss
    (a `torch.compile`d matmul and cross-entropy, cut_cross_entropy.torch_compile)."""
    return "compile" in stack.names or any(use.name == "cce" and use.opts["impl"] == "torch_compile"
                                           for use in stack.uses)


def unsupported_reason(stack: Stack) -> str | None:
    """Why a compile cell is not predicted: under ZeRO (its hybrid reads which weights backward uses from eager
    hooks), or the whole model compiled with Liger (the fake run's mirror of Liger's fused loss would be compiled
    in place of Liger's own code, which compiles otherwise: it reads the labels' count as a Python number)."""
    if not applies(stack):
        return None
    if {"zero2", "zero3"} & set(stack.names):
        return "torch.compile under ZeRO: the hybrid's view of which weights backward uses is not taken in compiled code"
    scope = next((use.opts["scope"] for use in stack.uses if use.name == "compile"), None)
    if scope == "model" and "liger" in stack.names:
        return ("the whole model compiled with Liger: its fused loss would compile as the fake run's mirror of it, "
                "not as Liger's own code")
    return None


@contextlib.contextmanager
def predicting(stack: Stack, fake: bool = True) -> Iterator[None]:
    """For a cell running compiled code: compilation runs unseen and the compiled code runs on fake tensors
    (the module's text); dynamo's caches are emptied before and after, so no cell runs another's compiled
    code. With fake=False its kernels are built and run, on real tensors: what the tests compare the fake
    run with."""
    if not applies(stack):
        yield
        return
    import torch
    import torch._dynamo
    from torch._inductor import async_compile
    from torch._inductor import config as inductor_config

    from .counter import MemoryCounter
    from .flops import FlopCount

    guards = torch._C._dynamo.guards
    unseen = classmethod(lambda cls: True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters["stats"].clear()  # the graphs compile's evidence counts: this cell's, as in a GPU run's process
    try:
        with contextlib.ExitStack() as patches:
            # caches off: a graph compiled for real earlier in this process (or on disk) would bring real kernels
            patches.enter_context(inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False))
            patches.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
            if fake:
                for method in ("cpp_pybinding", "cpp"):
                    patches.enter_context(mock.patch.object(async_compile.AsyncCompile, method, _kernel_never_built))
            for name, replacement in (("_empty_strided_cpu", _empty_strided), ("_reinterpret_tensor", _reinterpret),
                                      ("assert_size_stride", _unchecked), ("assert_alignment", _unchecked)):
                patches.enter_context(mock.patch.object(guards, name, replacement))
            for mode in (MemoryCounter, FlopCount):
                patches.enter_context(mock.patch.object(mode, "ignore_compile_internals", unseen))
            if fake and "liger" in stack.names:  # Liger's kernels in the compiled layers, as on a GPU
                patches.enter_context(triton_launch.traced_by_dynamo())
            yield
    finally:
        torch._dynamo.reset()


@contextlib.contextmanager
def collector_paused(stack: Stack) -> Iterator[None]:
    """Around each step of a cell running compiled code: Python's cycle collector paused, then run. Compiled
    code leaves reference cycles: dynamo keeps each compiled frame's first call's locals (the guards' scope: a
    layer's hidden states, the rotary cos and sin) and its graph breaks' frames, which only the collector frees.
    When it runs on its own depends on what the process allocated before, and it moved the prediction: the first
    step's 24 MiB counted or not in the steady one (24.809 or 24.834 GiB allocated, compile + gc + liger), the
    allocator's replay with it (25.662 or 25.680 GiB reserved). Paused in a step and run after it, a cell comes out
    the same wherever it runs; a GPU run has collected the first step's by the steps it measures (the H200's
    compile + gc + liger holds what gc + liger holds through its measured forward, 2026-11-29)."""
    if not applies(stack) or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def _kernel_never_built(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A generated kernel, not compiled: calling it writes nothing (its outputs are allocated already); it is
    counted as a kernel reading or writing each of its tensors once."""
    from . import flops

    return flops.count_undispatched_call


def _unchecked(*args: Any, **kwargs: Any) -> None:
    return None


def _empty_strided(size: Any, stride: Any, dtype: Any) -> Any:
    import torch

    return torch.empty_strided(size, stride, dtype=dtype)


def _reinterpret(tensor: Any, size: Any, stride: Any, offset: int = 0) -> Any:
    """inductor's reinterpret_tensor: a view of the same storage, `offset` elements past the tensor's own."""
    return tensor.as_strided(size, stride, tensor.storage_offset() + offset)
