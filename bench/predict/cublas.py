"""cuBLAS's workspaces: device memory each GEMM needs beside its operands, which no fake kernel allocates.

PyTorch takes them from the caching allocator, so they are in peak allocated and reserved. How long they
live depends on the release, read from the two CUDA builds on PyPI (their libtorch_cuda.so):

- **up to torch 2.14** each (thread, stream) that runs a GEMM gets a cuBLAS handle with one workspace,
  kept for the process's life; cuBLASLt's calls (an addmm with a bias) share it. A training step runs
  GEMMs on two threads, forward on Python's and backward on autograd's device thread, so two are alive
  once backward has run a GEMM: 64 MiB on Hopper.
- **from torch 2.15** the cached workspace is off by default (`TORCH_CUBLAS_WORKSPACE_CACHE`, checked:
  `at::cuda::isCUDABlasWorkspaceCachingEnabled()` is false in 2.15.0+cu132 and missing from 2.14.1):
  every cuBLAS GEMM (gemm, bgemm, gemv, dot) asks `getCurrentCUDABlasHandleWithWorkspace()`, which takes
  a workspace of the same size from the caching allocator after the op's output and gives it back as the
  call returns. cuBLASLt's calls keep a workspace of their own per thread, 1 MiB
  (`getCUDABlasLtWorkspaceSize()` in 2.15.0). So at a peak outside a GEMM no workspace is alive.

The size: 32 MiB from compute capability 9.0 (Hopper) on, else 4096 KiB x 2 + 16 KiB x 8
(`parseChosenWorkspaceSize`). Not modelled: `CUBLAS_WORKSPACE_CONFIG`, `CUBLASLT_WORKSPACE_SIZE`,
`TORCH_CUBLAS_WORKSPACE_CACHE` and `DISABLE_ADDMM_CUDA_LT` set on the GPU host (each is taken at its default).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

MIB = 2**20

# Ops that run a cuBLAS (or cuBLASLt) GEMM on CUDA
CUBLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_scaled_mm",
                        "_addmm_activation", "gemm_4bit"})  # bitsandbytes' 4-bit matmul: F.linear on training shapes
FIRST_PER_CALL = (2, 15)  # the first torch release whose cuBLAS GEMMs take their workspace per call
LT_WORKSPACE_BYTES = 1 * MIB  # cuBLASLt's own workspace in those releases
LT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Workspaces:
    """The workspaces of the GPU and torch release predicted for (`for_gpu`); none: a real CPU run."""

    bytes_per_thread: int = 0  # cuBLAS's workspace; 0: none
    per_call: bool = False  # taken for each cuBLAS call and given back as it returns (torch >= 2.15)
    lt_bytes_per_thread: int = 0  # with per_call: cuBLASLt's own, kept per thread

    def thread_of(self, where: str) -> str:
        return "backward" if where.endswith("/backward") else "forward"

    def of(self, op: str, args: Any, kwargs: Any) -> tuple[str, int, bool] | None:
        """The workspace a GEMM op takes, once its outputs exist: (`cublas` or `cublaslt`, bytes, whether it is kept
        for its thread); None for an op that runs no GEMM, or in a real CPU run."""
        if not self.bytes_per_thread or op not in CUBLAS_OPS:
            return None
        if not self.per_call:
            return "cublas", self.bytes_per_thread, True  # cuBLASLt shares it
        if runs_on_cublaslt(op, args, kwargs):
            return "cublaslt", self.lt_bytes_per_thread, True
        return "cublas", self.bytes_per_thread, False


NONE = Workspaces()  # a real CPU run's


def for_gpu(workspace_bytes: int, torch_version: str | None = None) -> Workspaces:
    """The workspaces a CUDA build of `torch_version` (default: this one's release, which the GPU host is taken
    to run) gives a GPU whose cuBLAS workspace is `workspace_bytes`."""
    if _major_minor(torch_version or torch.__version__) >= FIRST_PER_CALL:
        return Workspaces(workspace_bytes, per_call=True, lt_bytes_per_thread=LT_WORKSPACE_BYTES)
    return Workspaces(workspace_bytes)


def _major_minor(version: str) -> tuple[int, int]:
    """'2.15.0+cu132', '2.16.0.dev20261130', '2.15.0a0' -> (2, 15)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found[1]), int(found[2])


def runs_on_cublaslt(op: str, args: Any, kwargs: Any) -> bool:
    """Whether CUDA runs this GEMM op through cuBLASLt: `_scaled_mm` always; addmm and `_addmm_activation` where
    the bias can ride in Lt's epilogue (Blas.cpp `isInputCompliesAddmmCudaLt`: beta 1, a contiguous bias of one
    dimension as wide as the output's rows, or with an activation one that broadcasts to the output;
    floating operands of more than one row and column)."""
    if op == "_scaled_mm":
        return True
    if op not in ("addmm", "_addmm_activation") or len(args) < 3:
        return False
    bias, mat1, mat2 = args[:3]
    rows, cols = mat1.shape[0], mat2.shape[1]
    fused = bias.is_contiguous() and (bias.dim() == 1 or bias.squeeze().dim() == 1) and bias.shape[-1] == cols
    # a bias of two dimensions only with an activation to fuse (Lt is faster then)
    broadcast = (op == "_addmm_activation" and bias.dim() == 2
                 and all(b in (1, n) for b, n in zip(bias.shape, (rows, cols), strict=True)))
    return (kwargs.get("beta", 1) == 1 and (fused or broadcast) and mat1.dtype in LT_DTYPES
            and min(*mat1.shape, *mat2.shape) > 1)
