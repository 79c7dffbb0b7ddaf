"""Cut cross-entropy (`cce(impl=cce)`) on fake tensors: its Python wrappers run as they are, its
Triton kernels launch nothing (bench/predict/triton_launch.py).

Its wrappers allocate the same buffers on any device, with two exceptions, both replaced here:
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
    if impl != "cce":
        return f"cce(impl={impl}) runs compiled kernels: not run on fake tensors"
    try:
        from cut_cross_entropy import cce
    except ImportError as error:  # the package, or triton under it
        return f"cut-cross-entropy does not import here ({error}); the fake run runs its Python wrappers"
    missing = [name for name in REPLACED if not hasattr(cce, name)]
    if missing:
        return f"this cut-cross-entropy has no {', '.join(missing)}: the fake run replaces them"
    return None


@contextlib.contextmanager
def predicting() -> Iterator[None]:
    """One cce cell's prediction: kernels launch nothing; value-dependent helpers replaced."""
    from cut_cross_entropy import cce

    saved = {name: getattr(cce, name) for name in REPLACED}
    cce._build_flat_valids, cce.sort_logit_avg = _all_labels_valid, _sort_eager
    try:
        with triton_launch.no_launches():
            yield
    finally:
        for name, value in saved.items():
            setattr(cce, name, value)


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
