"""torch.compile on fake tensors: inductor's generated code run with its kernels stubbed out.

The `compile` technique compiles each decoder layer (bench/techniques/compile.py). Its memory is not eager's:
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
Not predicted: compile with Liger. The fake run runs a mirror of Liger's Triton kernels (bench/predict/liger.py),
exact in eager cells; compiled, `compile + gc + liger` came out 2.1% short of the H200 (24.94 GiB against 25.47:
on the GPU it peaks where gc does), and the mirror's compiled memory moved with the cells predicted before it in
the same process (24.81 first, 24.94 after compile + gc), which a prediction must not.
Not modelled either: what the first step's compilation allocates on the GPU (Triton's autotuning runs its
candidate configs on copies of the arguments they mutate), and the compiled graph's work for the step time
(`compile` is in bench/predict/steptime.py's UNTIMED).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock


def applies(stack_names: Sequence[str]) -> bool:
    return "compile" in stack_names


def unsupported_reason(stack_names: Sequence[str]) -> str | None:
    """Why a compile cell is not predicted: under ZeRO (its hybrid reads which weights backward uses from eager
    hooks), or with Liger (see the module's text)."""
    if not applies(stack_names):
        return None
    if {"zero2", "zero3"} & set(stack_names):
        return "torch.compile under ZeRO: the hybrid's view of which weights backward uses is not taken in compiled code"
    if "liger" in stack_names:
        return ("Liger's kernels in compiled code: the fake run's Liger mirror compiles unlike Liger's Triton kernels "
                "(the H200's compile + gc + liger 2.1% short) and not alike from one process's cells to the next")
    return None


@contextlib.contextmanager
def predicting(stack_names: Sequence[str], fake: bool = True) -> Iterator[None]:
    """For a compile cell: compilation runs unseen and the compiled code runs on fake tensors (the module's
    text); dynamo's caches are emptied before and after, so no cell runs another's compiled code. With
    fake=False its kernels are built and run, on real tensors: what the tests compare the fake run with."""
    if not applies(stack_names):
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
            yield
    finally:
        torch._dynamo.reset()


def _kernel_never_built(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A generated kernel, not compiled: calling it writes nothing (its outputs are allocated already)."""
    return _unchecked


def _unchecked(*args: Any, **kwargs: Any) -> None:
    return None


def _empty_strided(size: Any, stride: Any, dtype: Any) -> Any:
    import torch

    return torch.empty_strided(size, stride, dtype=dtype)


def _reinterpret(tensor: Any, size: Any, stride: Any, offset: int = 0) -> Any:
    """inductor's reinterpret_tensor: a view of the same storage, `offset` elements past the tensor's own."""
    return tensor.as_strided(size, stride, tensor.storage_offset() + offset)
