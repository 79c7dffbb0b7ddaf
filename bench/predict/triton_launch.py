"""Triton kernels on fake tensors: a launch that does nothing.

A Triton kernel allocates no memory: it reads and writes buffers its Python wrapper allocated with
torch. So a wrapper run on fake tensors, with every launch a no-op, allocates and saves what it does
on a GPU (bench/predict/liger.py, bench/predict/cce.py). Autotuned and heuristic kernels are
launched the same way (`kernel[grid](...)`), so they are covered too.

In code torch.compile compiles (a decoder layer with Liger's kernels in it), a launch is not run but
traced: on a GPU, dynamo puts each Triton kernel into the graph as an opaque op that writes the buffers
it mutates, and inductor plans around it (`traced_by_dynamo`). A no-op launch there would be a Python
function for dynamo to trace instead, which breaks the graph at every kernel.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def no_launches() -> Iterator[None]:
    """While inside: `kernel[grid](...)` does nothing, for every Triton kernel."""
    from triton.runtime import jit

    launch = jit.KernelInterface.__getitem__
    jit.KernelInterface.__getitem__ = lambda self, grid: _no_launch  # type: ignore[method-assign]
    try:
        yield
    finally:
        jit.KernelInterface.__getitem__ = launch  # type: ignore[method-assign]


@contextlib.contextmanager
def traced_by_dynamo() -> Iterator[None]:
    """While inside: torch.compile takes Triton kernels into its graphs as on a GPU, for fake CPU tensors.
    Dynamo checks for a device Triton runs on (`has_triton`): none here, so it is told yes. Which buffers
    a kernel mutates is read from its Triton IR, generated for a CUDA target (sm90: H100 and H200) by
    Triton's frontend alone (no driver, no compiler). Where that analysis fails torch assumes every
    input mutated, on a GPU as here: torch 2.11 hands the frontend every scalar argument as a constant,
    and Liger's RMSNorm kernels call `.to` on theirs, so theirs fail; its warning, with a traceback per
    kernel compiled, is kept out of the prediction's output. The kernels inductor would compile and
    launch (`async_compile.triton`) are never built, their launches do nothing."""
    from unittest import mock

    import torch.utils._triton
    import triton
    from torch._inductor.async_compile import AsyncCompile

    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addFilter(_mutation_analysis_failed)
    try:
        with mock.patch.object(torch.utils._triton, "has_triton", lambda: True), \
                mock.patch.object(triton.runtime.driver, "_active", _CudaTarget()), \
                mock.patch.object(AsyncCompile, "triton", lambda self, *args, **kwargs: _NeverBuilt()):
            yield
    finally:
        dynamo_log.removeFilter(_mutation_analysis_failed)


def _mutation_analysis_failed(record: logging.LogRecord) -> bool:
    """False for torch's warning that a kernel's mutations could not be read (so it is not logged)."""
    return not record.getMessage().startswith("Encountered an exception in identify_mutated_tensors")


class _CudaTarget:
    """What Triton's frontend asks of its active driver: the target to generate IR for."""

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


class _NeverBuilt:
    """A kernel inductor would have compiled: its generated code calls `run`, which launches nothing."""

    def run(self, *args: Any, **kwargs: Any) -> None:
        _no_launch(*args, **kwargs)


def _no_launch(*args: Any, **kwargs: Any) -> None:
    """Launches nothing; the kernel it stands for is counted (its tensors' bytes) for the step's time."""
    from . import flops

    flops.count_undispatched_call(*args, **kwargs)
