"""GaLore and APOLLO on fake tensors: their optimizer steps run as they are, but for two host-side
reads of a value and the scratch of CUDA's SVD.

Both optimizers (bench/techniques/galore.py, apollo.py) project each decoder weight's gradient to
`rank` dimensions and keep Adam's moments there. Every tensor they make has a shape known from the
parameter's, so the fake run allocates what the GPU does, step for step (checked against the same
steps on real CPU tensors: tests/test_predict.py). Except:

- APOLLO's `next_seed` draws 15 int64 on the host with a CPU generator and reads one back
  (`.tolist()`) to seed the next random projection. On fake tensors that read has no value; the
  draw is host bookkeeping the GPU never holds. While predicting, the next seed is the seed + 1:
  a seed changes the projection's values, not its size.
- APOLLO's norm-growth limiter takes `max(ratio, 1.01)` of a 0-d tensor ratio: a comparison that
  reads its value. Either branch divides the scaled gradient (one new tensor of the gradient's
  size); the tensor branch makes one more 0-d tensor. While predicting, the tensor branch is taken:
  the one that allocates the most.
- GaLore renews its projection with `torch.linalg.svd` of the fp32 gradient (the first step, then
  every `update_proj_gap` steps). The fake kernel allocates U, S and Vh; CUDA's (cuSOLVER's gesvdj,
  `svd_cusolver` in aten/src/ATen/native/cuda/linalg/BatchLinearAlgebraLib.cpp, read in one recent
  release; a GPU test checks the torch a GPU runs) also allocates, after them and freed as the op
  returns, an int32 `info` per matrix and a column-major copy of the input, which cuSOLVER overwrites
  (`svd_scratch`). It then takes a workspace of cuSOLVER's choosing (gesvdj_bufferSize), which is not
  counted: its size is known only to the library, on a GPU. Measured once (tests/test_gpu.py, an H200,
  torch 2.11, CUDA 13): 242.3 MiB for a 3072 x 8192 fp32 matrix, 2.5 times the matrix, beside the
  228 MiB the fake run counts. So a GaLore prediction is low by about that much wherever a renewal
  sets the peak (not on the cells the paragraph below describes).

Where the peak lies: the optimizer phase's peak is set by the full AdamW step of the embedding and
output layer (their `exp_avg_sq.sqrt()` temporary), not by a projection's renewal: on
Llama-3.2-1B at seq 512 (gc + galore), every phase's peak is the same with `update_proj_gap=1` (a
renewal every step) as with 200. So the fake run's second step, which renews nothing at the default
gap, stands for the steps that do.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Iterator
from typing import Any

from .counter import NO_SCRATCH, Scratch

SVD_OP = "_linalg_svd"  # torch.linalg.svd's op, as the counter names it
INFO_BYTES = 4  # cuSOLVER's int32 status per matrix


def svd_scratch(op: str, args: Any, kwargs: Any) -> Scratch:
    """What CUDA's SVD allocates after its outputs and frees as it returns (see the module's text):
    `info`, then the column-major copy of the input; nothing for another op."""
    if op != SVD_OP:
        return NO_SCRATCH
    matrix = args[0]
    matrices = math.prod(matrix.shape[:-2])
    return Scratch(after=(INFO_BYTES * matrices, matrix.numel() * matrix.element_size()))


@contextlib.contextmanager
def predicting(stack_names: tuple[str, ...]) -> Iterator[None]:
    """APOLLO's two reads of a value answered while a cell is predicted (see the module's text); its
    modules restored after. Nothing for another stack."""
    if "apollo" not in stack_names:
        yield
        return
    projector: Any = importlib.import_module("apollo_torch.random_projector")
    optimizer: Any = importlib.import_module("apollo_torch.apollo")
    seed_before = projector.next_seed
    projector.next_seed = _next_seed
    optimizer.max = _tensor_branch  # the module's global `max` is looked up before the builtin
    try:
        yield
    finally:
        projector.next_seed = seed_before
        del optimizer.max


def _next_seed(seed: int, adv: int = 0) -> int:
    return seed + 1


def _tensor_branch(first: Any, second: Any) -> Any:
    """`max(ratio, 1.01)` with a tensor ratio: the ratio (the branch that allocates the most)."""
    import torch

    return first if isinstance(first, torch.Tensor) else max(first, second)
