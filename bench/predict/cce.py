"""Cut cross-entropy on fake tensors. `cce(impl=cce)`: its Python wrappers run as they are, its
Triton kernels launch nothing (bench/predict/triton_launch.py). `cce(impl=torch_compile)`: its
`torch.compile`d matmul and cross-entropy compiles for the CPU and runs on fake tensors as any compiled
code here does (bench/predict/compiled.py).

Its wrappers allocate the same buffers on any device, with two exceptions, both replaced here (the first
in the torch_compile path too):
- which labels are valid is found by value (`nonzero`), which fake tensors lack. The fake run takes
  every shifted label as valid: true for full batches; padded and packed batches ignore a few labels
  per row, which on a GPU makes the per-token buffers (12 bytes per token) that much smaller.
- the vocabulary ordering of the backward is a `torch.compile`d argsort; here the same argsort,
  eager (int64 indices, then int32: what the compiled graph returns; its own buffers are not modelled).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from . import triton_launch

REPLACED = ("_build_flat_valids", "sort_logit_avg")  # names in cut_cross_entropy.cce


def unsupported_reason(impl: str) -> str | None:
    """Why a cce cell with this `impl` cannot be predicted here, or None."""
    try:
        from cut_cross_entropy import cce, torch_compile
    except ImportError as error:  # the package, or triton under it
        return f"cut-cross-entropy does not import here ({error}); the fake run runs its Python wrappers"
    module, names = (cce, REPLACED) if impl == "cce" else (torch_compile, REPLACED[:1])
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        return f"this cut-cross-entropy has no {', '.join(missing)}: the fake run replaces them"
    return None


@contextlib.contextmanager
def predicting() -> Iterator[None]:
    """One cce cell's prediction: kernels launch nothing; value-dependent helpers replaced, in the Triton path's
    module and the torch_compile path's (which imports the first by name)."""
    from cut_cross_entropy import cce, torch_compile

    saved = [(cce, name, getattr(cce, name)) for name in REPLACED]
    saved.append((torch_compile, REPLACED[0], getattr(torch_compile, REPLACED[0])))
    cce._build_flat_valids, cce.sort_logit_avg = _all_labels_valid, _sort_eager
    torch_compile._build_flat_valids = _all_labels_valid
    try:
        with triton_launch.no_launches():
            yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _all_labels_valid(targets: Any, ignore_index: int, shift: bool) -> Any:
    """cut_cross_entropy.utils._build_flat_valids with every label valid: the same buffers, sized for
    all of them (a bool mask; `nonzero`'s int64 (n, dims) indices, made int32; their flat offsets)."""
    import torch

    if not shift:
        return None  # every label valid: the package passes no index at all
    mask = targets[..., 1:] != ignore_index
    indices = torch.empty((mask.numel(), mask.ndim), dtype=torch.int64, device=mask.device).to(torch.int32)
    del mask
    return indices.sum(1)


def _sort_eager(logit_avg: Any) -> Any:
    import torch

    return torch.argsort(logit_avg).to(torch.int32)
