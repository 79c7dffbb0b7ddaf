"""Which attention kernels a cell's step ran, recorded in its row's evidence.

sdpa picks its kernel per call, from the shapes, the dtype, the mask, the card and the runtime cuDNN
(flash, cuDNN's, memory-efficient or the math fallback), and the kernels allocate differently: the
math path keeps the attention matrix, flash's backward allocates an fp32 dQ accumulator. The
predictor's fake run always runs the CPU's flash attention and adds what CUDA's flash backward
allocates (bench/predict/attention.py); a measured row says here whether flash is what ran.

A TorchDispatchMode is entered for each forward pass of the cell's first step and names every
attention op it sees (`_scaled_dot_product_flash_attention`, `..._cudnn_attention`,
`..._efficient_attention`, `_flash_attention_forward`, ...). It holds no tensor and allocates
nothing; its cost, a Python call per op of one forward, falls in `first_step_s`. Backward and the
optimizer step run without it. Evidence: `attention_ops` (sorted names) and `cudnn_version` (the
runtime's, which decides whether cuDNN's kernel ranks first). Not recorded for a stack whose forward
runs compiled code (`Technique.compiles_forward`): dynamo does not compile under a dispatch mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .cells import Cell

ATTENTION_MARKERS = ("attention", "attn")  # in an aten op's name: sdpa's kernels and the eager path's own ops


def recordable(cell: Cell) -> bool:
    return not any(use.technique.compiles_forward for use in cell.stack.uses)


@contextlib.contextmanager
def attention_recorded(model: Any, evidence: dict[str, Any]) -> Iterator[None]:
    """Within it, each forward pass of `model` runs under a mode that adds the attention ops it sees to
    evidence["attention_ops"]; the hooks and the mode are gone when it exits, even after an error."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[str] = set()

    class AttentionOps(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func.overloadpacket.__name__
            if any(marker in name for marker in ATTENTION_MARKERS):
                seen.add(name)
            return func(*args, **(kwargs or {}))

    active: list[AttentionOps] = []

    def enter(*_: Any) -> None:
        active.append(AttentionOps())
        active[-1].__enter__()

    def leave(*_: Any) -> None:
        if active:
            active.pop().__exit__(None, None, None)

    hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    try:
        yield
    finally:
        leave()  # a forward that raised left its mode entered
        for hook in hooks:
            hook.remove()
        evidence["attention_ops"] = sorted(seen)
        evidence["cudnn_version"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
