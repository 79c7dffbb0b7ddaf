"""The scratch of CUDA's embedding backward, which the fake `embedding_dense_backward` does not allocate.

An input embedding's weight gradient is made on CUDA (aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu)
with the indices sorted: each run of equal indices is summed in partial segments of at most 10 rows into
a buffer of the gradient's accumulate type (float for a bf16 or half gradient), and those partial sums
are then added into the gradient's rows. The buffer is taken from the caching allocator after the
gradient and freed as the op returns. Its rows are an upper bound known before the kernel runs (the
indices, and a tenth of them more), not the partial segments the batch makes: no host sync. With at
most 3,072 indices (and no `scale_grad_by_freq`) the kernel sums without sorting and takes no buffer.

Seen in the H200's cell traces (torch 2.11 for CUDA 13; Llama-3.2-3B, hidden 3072, a bf16 gradient):
55,357,440 B at 4,096 indices, (4096 + 409) x 3072 x 4 B, allocated after the 788 MB gradient and
freed at once; nothing at 1,024 indices. Other sizes follow the same rule, unseen.
"""

from __future__ import annotations

from typing import Any

import torch

from .counter import NO_SCRATCH, Scratch

BACKWARD_OP = "embedding_dense_backward"
MAX_UNSORTED_INDICES = 3072  # at most this many: summed without sorting, no partial-sum buffer
ROWS_PER_PARTIAL = 10  # NROWS_PER_THREAD: a partial segment's rows at most


def backward_scratch(op: str, args: Any, kwargs: Any) -> Scratch:
    """The partial-sum buffer of an embedding's weight gradient over more than 3,072 indices (or any
    number, scaled by frequency); nothing for another op."""
    if op != BACKWARD_OP or len(args) < 2:
        return NO_SCRATCH
    grad, indices = args[0], args[1]
    scale_grad_by_freq = args[4] if len(args) > 4 else kwargs.get("scale_grad_by_freq", False)
    indices_n = indices.numel()
    if indices_n <= MAX_UNSORTED_INDICES and not scale_grad_by_freq:
        return NO_SCRATCH
    accumulate_bytes = 8 if grad.dtype == torch.float64 else 4
    rows = indices_n + indices_n // ROWS_PER_PARTIAL
    return Scratch(after=(rows * grad.shape[-1] * accumulate_bytes,))
