"""torch's Adafactor on fake tensors: its step runs as it is, but for its reads of a number.

Adafactor's step (torch/optim/_adafactor.py, read in torch 2.11 and 2.13) reads back, for each
parameter, its step count, the norm of the parameter and the norm of its update (`.item()`), and scales
the update by them. On fake tensors those reads have no value. While a cell is predicted, every read of a
floating-point number inside the step is answered 1.0: the numbers are Python floats that scale an
in-place update; no tensor's size, count or order depends on them. A read of anything else is not
answered (it fails the prediction, naming the op), so a torch whose step reads an index or a flag is
not silently mispredicted.

Left out: each parameter's step count is a 0-d tensor on the host (4 B, `torch.tensor(0.0)`), which the
fake run, where host and device are one, counts on the device: a 512 B block per parameter, well under
a MiB on the registry's models. AdamW's foreach and for-loop steps count theirs the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

ANSWER = 1.0


class _NumbersAnswered(TorchDispatchMode):
    """A read of a floating-point number (`.item()`) returns ANSWER; every other op runs as it is."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        import torch

        if func is torch.ops.aten._local_scalar_dense.default:
            if not args[0].is_floating_point():
                raise RuntimeError(f"adafactor's step reads a {args[0].dtype} value: not answered while predicting")
            return ANSWER
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def predicting(stack_names: tuple[str, ...]) -> Iterator[None]:
    """Adafactor's update (the function its step calls) runs with its reads answered; restored after.
    Nothing for another stack."""
    if "adafactor" not in stack_names:
        yield
        return
    from torch.optim import _adafactor

    update = _adafactor.adafactor

    def answered(*args: Any, **kwargs: Any) -> Any:
        with _NumbersAnswered():
            return update(*args, **kwargs)

    _adafactor.adafactor = answered  # the step looks the function up in its module
    try:
        yield
    finally:
        _adafactor.adafactor = update
