"""Fault injection for the runner's tests (not a memory technique).

Fails the cell in a chosen way on the first forward pass, so tests can prove that every failure
ends as the right row and costs nothing else. Refused unless BENCH_TEST_TECHNIQUES=1.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from .base import Evidence, Options, Phase, Technique


def _fail(mode: str) -> None:
    import torch

    if mode == "raise":
        raise ValueError("injected failure")
    if mode == "oom":
        raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 1.00 GiB")
    if mode == "hang":
        time.sleep(3600)
    if mode == "exit137":
        os._exit(137)
    if mode == "sigkill":  # what the kernel's OOM killer does
        os.kill(os.getpid(), signal.SIGKILL)


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    mode = opts["mode"]
    model.register_forward_pre_hook(lambda module, args: _fail(mode))
    return model, {"fault": mode}


TECHNIQUE = Technique(
    name="fault",
    summary="test only: fails the first forward (raise | oom | hang | exit137 | sigkill)",
    phase=Phase.PATCH,
    options={"mode": "raise"},
    choices={"mode": ("raise", "oom", "hang", "exit137", "sigkill")},
    test_only=True,
    apply=_apply,
)
