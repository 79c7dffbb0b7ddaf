"""torchao's low-bit AdamW on fake tensors: its states made as torchao makes them, its compiled step
allocating what the GPU's kernels allocate.

torchao's AdamW8bit, AdamW4bit and AdamWFp8 (bench/techniques/torchao_adamw.py) make each parameter's two
moments on its first step: tensor subclasses holding codes, a scale a block and (8- and 4-bit) a lookup
table of 256 or 16 floats. On fake tensors they are made as they are, once the lookup tables exist: torchao
computes them from numbers (`.tolist()`) and caches them, so they are computed before the fake run begins.

The step is `torch.compile(single_param_adam)`, a parameter at a time: inductor's fused kernels, which fake
tensors cannot run. While a cell is predicted the compiled step is replaced by the buffers its compiled code
allocates, in its order, freed as it returns (the parameter, codes and scales are updated in place). Read from
inductor's code for the CPU (torch 2.11, torchao 0.18: `TORCHINDUCTOR_CACHE_DIR`, the graph's `call`), a
parameter of n elements in blocks of b:

- 8-bit: two fp32 scales (n / b each), then the two moments in fp32 (n each);
- 4-bit: the first moment's codes unpacked into two uint8 halves (n / 2 each) and joined (uint8, n), the second's
  into the same halves and joined (uint8, n), the halves freed; then two fp32 scales, the two moments in fp32 and
  their new codes before packing in int64 (n each): 26 bytes an element at once;
- fp8: two fp32 scales, then the two moments' new values in float8 (n each).

The GPU checks them (H200, 2026-11-29, Llama-3.2-3B at seq 2048 batch 2): gc + torchao_adamw's peak, in the
optimizer step, is the model states plus two fp32 copies of the 394M-element embedding, and
torchao_adamw(state=int4) reserved 3006 MiB segments, the size of an int64 copy of it. Not modelled: what the
first step's compilation allocates (inductor benchmarks its kernels on copies of the inputs they mutate); a
tensor under torchao's quantization size keeps plain state and its step allocates nothing here; each
parameter's step count is a 0-d tensor on the host that the fake run, where host and device are one, counts
on the device (512 B a parameter). The step's time is not predicted (bench/predict/steptime.py: its work is
not counted).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

COMPILED_STEP = "single_param_adam"  # torchao/optim/adam.py: the one function its step compiles


@contextlib.contextmanager
def predicting(stack_names: tuple[str, ...]) -> Iterator[None]:
    """torchao's lookup tables made and its compiled step replaced while a torchao_adamw cell is predicted
    (enter it before the fake mode); nothing for another stack."""
    if "torchao_adamw" not in stack_names:
        yield
        return
    import torch
    from torchao.optim import subclass_4bit, subclass_8bit

    for table in (subclass_8bit.get_qmap_signed, subclass_8bit.get_qmap_unsigned,
                  subclass_4bit.get_qmap_signed, subclass_4bit.get_qmap_unsigned):
        table()  # cached by torchao: made here from real numbers, read later by the fake step's state
    with mock.patch.object(torch, "compile", _as_compiled):
        yield


def _as_compiled(fn: Callable[..., Any], **_: Any) -> Callable[..., None]:
    if getattr(fn, "__name__", "") != COMPILED_STEP:
        raise RuntimeError(f"torch.compile of {getattr(fn, '__name__', fn)!r} while predicting torchao's step: "
                           "what its kernels allocate is not known")
    return _step_allocations


def _step_allocations(p: Any, grad: Any, step: Any, exp_avg: Any, *_: Any) -> None:
    """The compiled step's buffers for this parameter's state (the module's docstring), made and then freed."""
    import torch

    n = p.numel()
    kind = type(exp_avg).__name__
    if kind not in ("OptimState8bit", "OptimState4bit", "OptimStateFp8"):
        return  # a small tensor's plain state: its step's buffers are negligible
    blocks = exp_avg.scale.numel()
    held: list[Any] = []

    def made(count: int, dtype: torch.dtype) -> None:
        held.extend(torch.empty(count, dtype=dtype, device=p.device) for _ in range(2))

    if kind == "OptimState4bit":
        halves = [torch.empty(n // 2, dtype=torch.uint8, device=p.device) for _ in range(2)]
        held.extend(torch.empty(n, dtype=torch.uint8, device=p.device) for _ in range(2))  # each moment's codes joined
        del halves
    made(blocks, torch.float32)  # the new scales
    if kind == "OptimStateFp8":
        made(n, torch.float8_e4m3fn)
        return
    made(n, torch.float32)  # the moments in fp32
    if kind == "OptimState4bit":
        made(n, torch.int64)  # their codes before packing
