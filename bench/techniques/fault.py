"""Fault injection for the runner's tests (not a memory technique).

Fails the cell in a chosen way on the first forward pass, so tests can prove that every failure
ends as the right row and costs nothing else. With `over_tokens=N` it fails only when a forward
sees more than N tokens (batch x seq): a memory limit the fit search can find on a CPU. With
`only_rank=r` only rank r of a multi-GPU cell fails (the others then wait on it in a collective).
Refused unless BENCH_TEST_TECHNIQUES=1.
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
    if mode == "alloc":  # a real host allocation no machine can satisfy (1 PiB)
        torch.empty(2**50, dtype=torch.uint8)


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    mode, limit = opts["mode"], opts["over_tokens"]
    if opts["only_rank"] not in (-1, int(os.environ.get("RANK", "0"))):
        return model, {"fault": "none on this rank"}

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        tokens = kwargs["input_ids"].numel() if "input_ids" in kwargs else args[0].numel()
        if tokens > limit:
            _fail(mode)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model, {"fault": mode}


TECHNIQUE = Technique(
    name="fault",
    summary="test only: fails the first forward (raise | oom | hang | exit137 | sigkill | alloc)",
    phase=Phase.PATCH,
    options={"mode": "raise", "over_tokens": 0, "only_rank": -1},
    choices={"mode": ("raise", "oom", "hang", "exit137", "sigkill", "alloc")},
    ranges={"over_tokens": "[0, inf)", "only_rank": "[-1, inf)"},
    test_only=True,
    not_predicted="fault injection for the runner's tests",
    apply=_apply,
)
