"""The scratch of CUDA's column sums, which the fake run's sums do not allocate.

A norm's weight gradient sums `grad * x` over every row of a (rows, hidden) activation into one
(hidden,) vector. CUDA's reduction kernel (aten/src/ATen/native/cuda/Reduce.cuh) splits each output's
column across thread blocks when the rows are many, keeps their partial sums in a global buffer it takes
from the caching allocator after the output, and frees it as the op returns. No fake kernel allocates it.

Its size follows the kernel's launch configuration, which this does not model: it is the figure the
H200's cell traces show (torch 2.11 for CUDA 13; Llama-3.2-3B's RMSNorm weights, hidden 3072, bf16),
8 B per summed element, at 4096 rows (100,663,296 B, 57 a step: two norms a layer and the last) and
at 1024 rows (25,165,824 B). It is applied from 1024 rows, the fewest seen; fewer rows and other
shapes may take a smaller buffer or none.
"""

from __future__ import annotations

from typing import Any

from .counter import NO_SCRATCH, Scratch

SUM_OP = "sum"
BYTES_PER_ELEMENT = 8
MIN_ROWS = 1024


def column_sum_scratch(op: str, args: Any, kwargs: Any) -> Scratch:
    """The global buffer of a sum over every dimension but the last of a floating tensor of at least
    MIN_ROWS rows; nothing for another op or sum."""
    if op != SUM_OP or not args:
        return NO_SCRATCH
    tensor = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is None or not tensor.is_floating_point() or tensor.dim() < 2:
        return NO_SCRATCH
    dims = [dims] if isinstance(dims, int) else list(dims)
    if sorted(d % tensor.dim() for d in dims) != list(range(tensor.dim() - 1)):
        return NO_SCRATCH
    if tensor.numel() // tensor.shape[-1] < MIN_ROWS:
        return NO_SCRATCH
    return Scratch(after=(BYTES_PER_ELEMENT * tensor.numel(),))
