"""How long a step takes on a GPU, predicted from the work the fake run dispatched.

The fake run sees every op the step dispatches (bench/predict/flops.py): how many, which launch a kernel,
and each kernel's FLOPs and bytes. A GPU runs the kernels in order while the host dispatches the next
ones; the worker's measured steps follow each other without a synchronisation, so over many steps the
slower of the two sets the pace:

    device time = compute-bound FLOPs / matmul rate + memory-bound bytes / bandwidth + kernels x launch gap
    host time   = ops dispatched x host time an op
    step time   = the larger of the two

Four rates a GPU kind, fitted to the measured step times of published cells (`fit`, tools/fit_step_time.py)
and written in RATES with the run they come from; their error, each cell predicted by rates fitted
without it, is in results/PREDICTION.md. Not modelled: overlap of one kernel with the next, kernels'
efficiency by shape, communication between ranks, copies between host and device (offload), and a
ZeRO engine's own work: those cells are not predicted (`unsupported_reason`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepWork:
    """What one step dispatched (bench/predict/flops.py)."""

    flops: int  # matmuls and attention, by their formulas (step_tflop)
    ops: int  # every op the host dispatched, views included
    kernels: int  # of those, the ones that launch a kernel on a GPU
    compute_flops: int  # FLOPs of the compute-bound kernels
    memory_bytes: int  # bytes read and written by the memory-bound ones


@dataclass(frozen=True)
class StepRates:
    """A GPU kind's rates as the step time model uses them (fitted, not the datasheet's)."""

    matmul_tflops: float  # compute-bound kernels' FLOPs a second, TFLOP/s
    memory_gbps: float  # memory-bound kernels' bytes a second, GB/s
    kernel_us: float  # device time a kernel costs beyond its FLOPs or bytes, µs
    op_us: float  # host time a dispatched op costs (Python, autograd, the dispatcher), µs
    fitted_on: str  # the measured run(s) and cells they were fitted to


def step_ms(work: StepWork, rates: StepRates) -> float:
    """The predicted step time, ms: the larger of the device's time and the host's."""
    device_s = (work.compute_flops / (rates.matmul_tflops * 1e12) + work.memory_bytes / (rates.memory_gbps * 1e9)
                + work.kernels * rates.kernel_us * 1e-6)
    host_s = work.ops * rates.op_us * 1e-6
    return 1000 * max(device_s, host_s)


# The fitted rates (tools/fit_step_time.py); a GPU kind not here gets no predicted step time.
RATES: dict[str, StepRates] = {}


# Stack techniques whose time the model does not see: host-device copies (offload), kernels dispatched
# outside torch whose work is not counted (bitsandbytes' 4/8-bit matmuls, cut cross-entropy's).
UNTIMED = frozenset({"offload", "activation_offload", "qlora", "int8_lora", "cce", "zero2", "zero3", "compile"})


def unsupported_reason(stack_names: Sequence[str], gpus: int) -> str | None:
    """Why a cell's step time is not predicted, or None."""
    if gpus > 1:
        return "communication between ranks is not modelled"
    untimed = sorted(set(stack_names) & UNTIMED)
    if untimed:
        return f"{', '.join(untimed)}: work the fake run does not see or the model does not time"
    return None


def fit(works: Sequence[StepWork], measured_ms: Sequence[float], fitted_on: str) -> StepRates:
    """The rates that best predict the measured step times (least squares of the log ratio), by a
    coarse-to-fine search over a grid of the four rates: few cells, four parameters, no solver needed."""
    grid = {"matmul_tflops": (50.0, 1000.0), "memory_gbps": (200.0, 5000.0), "kernel_us": (0.5, 50.0),
            "op_us": (0.5, 100.0)}
    best = {name: math.sqrt(lo * hi) for name, (lo, hi) in grid.items()}
    span = {name: hi / lo for name, (lo, hi) in grid.items()}
    for _ in range(12):
        for name in grid:
            candidates = [best[name] * span[name] ** (k / 8 - 0.5) for k in range(9)]
            best[name] = min(candidates, key=lambda v: _loss(works, measured_ms, {**best, name: v}))
        span = {name: s ** 0.6 for name, s in span.items()}
    return StepRates(**best, fitted_on=fitted_on)


def _loss(works: Sequence[StepWork], measured_ms: Sequence[float], rates: dict[str, float]) -> float:
    r = StepRates(**rates, fitted_on="")
    return sum(math.log(step_ms(w, r) / m) ** 2 for w, m in zip(works, measured_ms, strict=True))
