"""Triton kernels on fake tensors: a launch that does nothing.

A Triton kernel allocates no memory: it reads and writes buffers its Python wrapper allocated with
torch. So a wrapper run on fake tensors, with every launch a no-op, allocates and saves what it does
on a GPU (bench/predict/liger.py, bench/predict/cce.py). Autotuned and heuristic kernels are
launched the same way (`kernel[grid](...)`), so they are covered too.
"""

from __future__ import annotations

import contextlib
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


def _no_launch(*args: Any, **kwargs: Any) -> None:
    """Launches nothing; the kernel it stands for is counted (its tensors' bytes) for the step's time."""
    import torch

    from . import flops

    flops.count_undispatched_kernel([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])
