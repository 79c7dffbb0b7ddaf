"""How long a step takes on a GPU, predicted from the work the fake run dispatched.

The fake run sees every op the step dispatches (bench/predict/flops.py): how many, which launch a kernel,
and each kernel's FLOPs and bytes. A GPU runs the kernels in order while the host dispatches the next
ones; the worker's measured steps follow each other without a synchronisation, so over many steps the
slower of the two sets the pace, and where the two are close each waits on the other part of the time:

    device time = compute-bound FLOPs / matmul rate + memory-bound bytes / bandwidth + kernels x launch gap
    host time   = ops dispatched x host time an op (x a factor for a stack with gc, LoRA or DoRA)
    step time   = (device time^p + host time^p)^(1/p), p = 5: the larger of the two, more where they are close

Four rates a GPU kind, fitted to the measured step times of published cells (`fit`, tools/fit_step_time.py)
and written in RATES with the run they come from; their error, each cell predicted by rates fitted
without it, is in results/PREDICTION.md. Not modelled: overlap of one kernel with the next, kernels'
efficiency by shape, communication between ranks, copies between host and device (offload) and a ZeRO
engine's own work: those cells are not predicted (`unsupported_reason`).

An op's host time depends on the stack: under gc the recomputed forward runs each layer again under the
checkpoint's saved-tensor hooks (a recomputed op cost the host about twice a plain one: the split of
gc's ops by who dispatched them, 2026-11-29), and LoRA adds many small ops whose backward the autograd
engine dispatches cheaply. One host rate for all missed small gc steps by up to 22% short and LoRA's 20%
long, so the host's time is multiplied by a factor a technique (HOST_FACTOR_TECHNIQUES), fitted with the
rates. DoRA's weight norm adds peft's own Python ops to every adapted layer: gc + DoRA was the H200's one
step the host set by far (743 ms measured, 9.6 µs an op), 28% long at the H100's host side.

Selective checkpointing's op policy (`selective_gc(ops=matmuls)`) runs every op of forward and of the
recompute through a Python dispatch mode that asks the policy whether to save it: on the H200 its step took
380 ms where its counted work says 230 (9,920 ops: 38 µs an op). One cell cannot fit a factor of its own, so it is
not timed (`_timing_names` gives it a name of its own, in UNTIMED).

One kernel is slower than its bytes say: bitsandbytes' 8-bit optimizer step. It gets a fifth rate, device
time a trainable parameter, fitted to the measured cells with that optimizer once the four are fitted to
the others (`fit`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from . import grouped_mm

if TYPE_CHECKING:
    from ..stacks import Stack


@dataclass(frozen=True)
class StepWork:
    """What one step dispatched (bench/predict/flops.py)."""

    flops: int  # matmuls and attention, by their formulas (step_tflop)
    ops: int  # every op the host dispatched, views included
    kernels: int  # of those, the ones that launch a kernel on a GPU
    compute_flops: int  # FLOPs of the compute-bound kernels
    memory_bytes: int  # bytes read and written by the memory-bound ones
    optimizer_8bit_params: int = 0  # trainable parameters bitsandbytes' 8-bit optimizer steps (cell_work)
    host_techniques: frozenset[str] = frozenset()  # the stack's techniques with a host factor (cell_work)
    grouped_mm_fallbacks: int = 0  # grouped matmuls CUDA runs by its fallback: a sync each (bench/predict/grouped_mm.py)


@dataclass(frozen=True)
class StepRates:
    """A GPU kind's rates as the step time model uses them (fitted, not the datasheet's)."""

    matmul_tflops: float  # compute-bound kernels' FLOPs a second, TFLOP/s
    memory_gbps: float  # memory-bound kernels' bytes a second, GB/s
    kernel_us: float  # device time a kernel costs beyond its FLOPs or bytes, µs
    op_us: float  # host time a dispatched op costs (Python, autograd, the dispatcher), µs
    fitted_on: str  # the measured run(s) and cells they were fitted to
    left_out: str = ""  # the errors of those cells, each predicted by rates fitted to the others
    cells: int = 0  # how many measured cells they were fitted to
    # bitsandbytes' 8-bit optimizer step: device time a trainable parameter beyond its counted bytes, ps (None:
    # no measured cell of it to fit), and the cells it was fitted to with their left-out errors
    optimizer_8bit_ps: float | None = None
    optimizer_8bit_cells: int = 0
    optimizer_8bit_left_out: str = ""
    host_factors: tuple[tuple[str, float], ...] = ()  # (technique, its ops' host time over a plain op's); 1 if absent
    host_fitted: bool = True  # False: op_us and host_factors are another kind's, kept (too few host-bound cells)
    overlap_p: float = math.inf  # how the device's time and the host's combine (step_ms): math.inf, the larger


def step_ms(work: StepWork, rates: StepRates) -> float:
    """The predicted step time, ms: the device's time and the host's combined (`combined`)."""
    return combined(device_ms(work, rates), host_ms(work, rates), rates.overlap_p)


# How the two sides combine: their p-norm, (device^p + host^p)^(1/p). The larger where one dominates (at half the
# other, p = 5 adds 0.6%), more where they are close (equal: 2^(1/5), +15%): each waits on the other part of the
# time, the host falling behind where an op is slow (a Python hook, a synchronising call), the device where a kernel
# is. p = math.inf is the plain larger one. Chosen by the cells left out of the fit, one p for both GPU kinds
# (tools/choose_overlap.py, 2026-11-30, fake-run/23's counts; the root mean square of the left-out errors, H100 /
# H200): the larger 4.61% / 5.14% (the cells near the balance up to 14% short), p = 16 4.62 / 7.06, 8 4.16 / 5.61,
# 6 3.58 / 5.15, 5 3.41 / 4.40, 4 3.82 / 3.77 (its kernel gap fitted 0), 3 4.66 / 4.64. Again at fake-run/24's
# counts: the larger 4.54 / 5.06, 16 4.56 / 7.01, 8 4.10 / 6.07, 6 3.51 / 5.05, 5 3.34 / 4.29, 4 3.74 / 3.65 (the gap
# 0 again, one H100 cell 10.3% off), 3 4.57 / 4.13: over the 80 cells together 5 and 4 tie (3.70%, 3.71%). And at
# fake-run/25's (causal attention's skipped scores): the larger 4.61 / 5.87, 16 4.63 / 6.85, 8 4.06 / 5.93, 6 3.57 /
# 4.24, 5 3.38 / 3.46, 4 4.00 / 3.18, 3 5.03 / 3.44: over the 80 cells, 5 3.41%, 4 3.73%.
OVERLAP_P = 5.0


def combined(device: float, host: float, p: float) -> float:
    """The p-norm of the device's time and the host's (p = math.inf: the larger)."""
    larger = max(device, host)
    if math.isinf(p) or larger <= 0:
        return larger
    return larger * ((device / larger) ** p + (host / larger) ** p) ** (1 / p)


def device_ms(work: StepWork, rates: StepRates) -> float:
    return 1000 * (work.compute_flops / (rates.matmul_tflops * 1e12) + work.memory_bytes / (rates.memory_gbps * 1e9)
                   + work.kernels * rates.kernel_us * 1e-6 + work.optimizer_8bit_params * (rates.optimizer_8bit_ps or 0) * 1e-12)


def host_ms(work: StepWork, rates: StepRates) -> float:
    return 1000 * work.ops * rates.op_us * 1e-6 * host_factor(work, rates.host_factors)


def host_factor(work: StepWork, factors: Sequence[tuple[str, float]]) -> float:
    """What the stack's techniques multiply an op's host time by (1 without one)."""
    return math.prod(value for technique, value in factors if technique in work.host_techniques)


def tokens_per_s(batch_size: int, seq_len: int, step_ms: float) -> float:
    """The positions a step trains (every row padded to seq_len), a second at that step time."""
    return batch_size * seq_len / (step_ms / 1000)


def bound(work: StepWork, rates: StepRates) -> str:
    """Which of the two sets the predicted pace: "device" or "host"."""
    return "device" if device_ms(work, rates) >= host_ms(work, rates) else "host"


# The fake run's count of a step's work changed at fake-run/22: the device questions a fake tensor answers through
# the dispatcher, two thirds of the ops and four fifths of the kernels counted before, are no longer counted
# (bench/predict/flops.py); and at fake-run/25: causal attention's compute is the share of its scores a flash kernel
# computes (about half; Llama-3.2-3B baseline s2048 b2: 89.05 -> 84.01 compute-bound TFLOP); and at fake-run/26: a
# fused optimizer's gradients are read, not written (236.0 -> 229.6 GB moved). Rates are fitted to counts of this
# method on; an older row's counts are not theirs.
WORK_COUNTED_SINCE = 26
# And a technique's work counted as now only since a later method than the whole count's: none today (Liger's, since
# fake-run/24 for its fused loss's matmuls' bytes and its kernels' in-place writes, is older than fake-run/26).
TECHNIQUE_WORK_COUNTED_SINCE: dict[str, int] = {}


def work_of(row: Mapping[str, Any]) -> StepWork | None:
    """A prediction row's work (its step_* columns), None where it has none (an older method's, a stack
    whose kernels the fake run cannot count)."""
    if _method_before(row, WORK_COUNTED_SINCE):
        return None
    values: list[Any] = [row.get(c)
                         for c in ("step_tflop", "step_ops", "step_kernels", "step_compute_tflop", "step_memory_gb")]
    if any(_missing(v) for v in values):
        return None
    tflop, ops, kernels, compute_tflop, memory_gb = (float(v) for v in values)
    return StepWork(round(tflop * 1e12), round(ops), round(kernels), round(compute_tflop * 1e12), round(memory_gb * 1e9))


def _method_before(row: Mapping[str, Any], version: int) -> bool:
    """Whether a prediction row was made by the fake run before fake-run/`version`."""
    method = row.get("prediction_method")
    return not _missing(method) and str(method).startswith("fake-run/") and \
        int(str(method).removeprefix("fake-run/")) < version


def cell_work(row: Mapping[str, Any], stack: Stack) -> StepWork | None:
    """A prediction row's work with what its stack adds beyond the counted kernels: its techniques with a host
    factor, and the trainable parameters (the row's `trainable_params`) a bitsandbytes 8-bit optimizer steps."""
    work = work_of(row)
    if work is None or any(_method_before(row, since) for name, since in TECHNIQUE_WORK_COUNTED_SINCE.items()
                           if name in stack.names):
        return None
    names = set(_timing_names(stack))
    work = replace(work, host_techniques=frozenset(names & HOST_FACTOR_TECHNIQUES))
    if not names & SLOWER_THAN_COUNTED:
        return work
    params: Any = row.get("trainable_params")
    return None if _missing(params) else replace(work, optimizer_8bit_params=int(params))


def _missing(value: Any) -> bool:
    """None, NaN or pandas' NA (a table's empty cell)."""
    try:
        return value is None or bool(value != value)
    except TypeError:  # pandas.NA has no truth value
        return True


def predicted_ms(row: Mapping[str, Any], gpu_key: str, stack: Stack, gpus: int) -> float | None:
    """A prediction row's step time on its GPU kind, ms; None where not predicted (no rates for the kind,
    no work counted, a stack or rank count the model does not time)."""
    rates = RATES.get(gpu_key)
    work = cell_work(row, stack)
    if rates is None or work is None or unsupported_reason(stack, gpus, rates):
        return None
    return step_ms(work, rates)


# The fitted rates (`python tools/fit_step_time.py KIND`, run again when a GPU publishes more cells); a GPU kind not
# here gets no predicted step time. Effective rates, not the datasheet's: the matmul rate is the dense bf16 peak's
# (989 TFLOP/s) share the compute-bound kernels reached; the bandwidth, what memory-bound kernels reached of the HBM's
# 3.35 (H100) and 4.8 TB/s (H200); a kernel's gap, its launch and tail. Fitted under the releases the GPU ran (torch
# 2.11.0, transformers 5.17.0) to fake-run/26's counts (WORK_COUNTED_SINCE). The counts before fake-run/22,
# inflated by a fake tensor's device questions (bench/predict/flops.py), had fitted 798 and 708 TFLOP/s, 5,896 and
# 8,457 GB/s (above the HBM's: the phantom bytes), 0.31 and 0.85 µs a kernel, 5.5 and 6.7 µs an op, with larger host
# factors (gc x 1.2 and 1.3, LoRA x 0.8 and 0.85); each cell left out was then predicted median 2.8% (H100) and 2.5%
# (H200) off. With fake-run/22's counts and Liger's fused loss counted by FLOPs alone (its chunks' matmuls are
# memory-bound), 724 and 646 TFLOP/s, 2,689 and 3,166 GB/s, 5.8 and 0.64 µs, 14.8 and 19.4 µs; left out 2.6% and 4.5%
# (-18.3% to +12.5%, -14.2% to +21.4%: Liger's cells the short tail); with Liger's bytes, 1.9% and 3.1% (-12.0% to
# +12.5%, -14.0% to +10.8%). With the two sides' p-norm (OVERLAP_P; before, the larger), 2.0% and 2.3% (-7.6% to
# +7.2%, -9.5% to +10.7%): the kernel's gap falls (0.8 and 0.1 µs, from 3.1 and 4.2), the overlap's waits had stood
# for it. With Liger's in-place writes (fake-run/24: 5.6-6.6 GB a step more at seq 2048 batch 2), 2.0% and 2.7%
# (-7.3% to +7.2%, -9.7% to +6.8%): Liger's cells left out -2.4%, -6.3%, +0.3% on the H100 (were -3.5%, -7.6%,
# -0.1%), +0.3%, -3.9%, -9.3% on the H200 (were -0.6%, -4.6%, -9.8%); the H200's other cells moved with its rates.
# The H200's median moved 2.3% -> 2.7%, its worst 10.7% -> 9.7%, with a kernel gap of 0.3 µs for 0.1. With causal
# attention counted at the scores a flash kernel computes (fake-run/25: Llama-3.2-3B baseline s2048 b2, 89.05 -> 84.01
# compute-bound TFLOP), 1.8% and 2.2% (-8.0% to +6.6%, -9.7% to +6.3%; root mean square 3.34% -> 3.38% and 4.29% ->
# 3.46%), at 714 and 638 TFLOP/s (the matmuls' own rate: attention's half had run faster): the cells whose attention
# a GPU runs in full came in, H200 `padding` -5.0% -> -1.7%, `packing` -8.1% -> -4.8%, `eager_attention` -4.9% ->
# -3.6% (H100 -3.4% -> -0.4%). With a fused optimizer's gradients read, not written back (fake-run/26: 6.4 GB a step
# less for Llama-3.2-3B in bf16, 12.9 under mixed precision's fp32 ones), 1.8% and 1.9% (-7.5% to +9.4%, -9.6% to
# +6.5%; root mean square 3.25% and 3.49%): mixed precision's H100 cells, the longest, came in from +4..+6% to
# +3..+4%. The H200's rates are its 32 cells' at seq 2048 batch 2 (one at batch 4, one at seq 1024), fitted from the
# H100's: its bandwidth and kernel gap trade off against each other there.
RATES: dict[str, StepRates] = {
    "h100": StepRates(704.7, 2336.9, 0.738, 15.989,
                      "61 cells of llama3b-h100-20261122, llama3b-h100-repeats, regress-h100-image-a, "
                      "regress-h100-image-b, regress-h100-peft0212 (predictions axolotl3b-predicted-h100-torch211-20261130x, "
                      "llama3b-predicted-h100-torch211-20261130x, playbook-predicted-h100-torch211-20261130x, "
                      "regress-predicted-h100-torch211-20261130x)",
                      "median 1.7% off, -7.1% to +9.7%", cells=57,
                      host_factors=(("gc", 1.1), ("lora", 0.85)), overlap_p=5.0,
                      optimizer_8bit_ps=31.79, optimizer_8bit_cells=4,
                      optimizer_8bit_left_out="median 2.4% off, -5.0% to +3.1%"),
    "h200": StepRates(634.0, 3027.2, 0.042, 17.002,
                      "32 cells of llama3b-h200-20261127, llama3b-h200-20261127-segments (predictions "
                      "llama3b-predicted-h200-torch211-20261130x, playbook-predicted-h200-torch211-20261130x)",
                      "median 1.9% off, -9.6% to +6.5%", cells=28,
                      host_factors=(("dora", 1.2), ("gc", 1.15), ("lora", 0.95)), overlap_p=5.0,
                      optimizer_8bit_ps=33.06, optimizer_8bit_cells=4,
                      optimizer_8bit_left_out="median 4.6% off, -9.5% to +8.8%"),
}


# Stack techniques whose time the model does not see: host-device copies (offload), kernels dispatched
# outside torch whose work is not counted (bitsandbytes' 8-bit matmuls, cut cross-entropy's), a ZeRO engine's
# own work, compiled kernels the fake run runs unfused (torchao's step: not at all), and ops paying a Python
# dispatch mode's time (POLICY_GC). QLoRA's work is counted (bitsandbytes' 4-bit matmul as the kernels CUDA runs:
# bench/predict/bnb.py) but its time is not what it says: on the H200 at seq 2048 batch 2, qlora took 296.4 ms and
# qlora + gc 493.9 where the rates say 253.1 and 396.5 (-15%, -20%; lora and gc + lora, the same work but for the
# dequantization, 257.8 and 393.4 measured), though dequantizing every weight once a forward and once a backward
# (and once more in gc's recompute) moves some 14 GB (21), 4 ms (7) at the fitted bandwidth, where the steps take
# 39 ms (100) longer than LoRA's: bitsandbytes' 4-bit path costs where its bytes do not say.
POLICY_GC = "selective_gc(ops=matmuls)"
UNTIMED = frozenset({"offload", "activation_offload", "qlora", "int8_lora", "cce", "zero2", "zero3",
                     "torchao_adamw", POLICY_GC})
UNTIMED_WHY = {"qlora": "its work is counted, but on the H200 its cells took 17-25% longer than that work says "
                        "(bitsandbytes' 4-bit path)"}
# torch.compile is timed from its generated code's kernels (bench/predict/compiled.py: each counted as reading
# or writing its tensors once, as inductor planned them for the CPU): the H200's compile and compile + gc at seq
# 2048 batch 2, before any compiled cell was among the rates' fit, came out 163.4 and 206.7 ms against 165.3 and
# 211.3 measured (-1.2%, -2.2%; fake-run/19's counts and rates); left out of today's fit, +7.5% and +5.4%. Not
# with Liger: the H200's compile + gc + liger took 313.9 ms where its counted work says 208.7 (gc + liger eager:
# 231.6; fake-run/19's rates), time spent where the fake run sees no work (the graph breaks around Liger's RoPE,
# its kernels launched through inductor: a GPU profile would say).
UNTIMED_TOGETHER = {frozenset({"compile", "liger"}): "compile with liger: the H200's compile + gc + liger took 50% "
                                                      "longer than its counted work says"}

# Kernels whose work is counted but whose time is not their bytes': bitsandbytes' 8-bit optimizer step is one op per
# parameter reading and writing 6-8 bytes of it, yet on the H100 it took 95-112 ms a step for Llama-3.2-3B's 3.2B
# parameters (adamw8bit: 315.6 ms at seq 2048 batch 2, AdamW 220.4), the four rates predicting it 20-29% short;
# about as long on the H200 with its 1.43 times the bandwidth: its time is not spent moving bytes (the per-element
# quantization, likely). Timed by a rate a parameter of its own (StepRates.optimizer_8bit_ps).
SLOWER_THAN_COUNTED = frozenset({"adamw8bit", "paged_adamw8bit"})

# Techniques whose ops cost the host other than a plain op (the module's docstring), and the factors a fit tries.
HOST_FACTOR_TECHNIQUES = frozenset({"gc", "lora", "dora"})
FACTOR_GRID = tuple(round(0.6 + 0.05 * i, 2) for i in range(19))  # 0.60 to 1.50


def _timing_names(stack: Stack) -> tuple[str, ...]:
    """The stack's technique names as the model times them: its names, but selective_gc under its op policy
    is POLICY_GC (its ops cost the host a dispatch mode's time; with every=n it is plain checkpointing)."""
    return tuple(POLICY_GC if u.name == "selective_gc" and u.opts.get("ops") == "matmuls" else u.name
                 for u in stack.uses)


def untimed_reason(stack: Stack, gpus: int) -> str | None:
    """Why the model cannot time a cell on any GPU kind (several ranks, a technique in UNTIMED), or None."""
    if gpus > 1:
        return "communication between ranks is not modelled"
    untimed = sorted(set(_timing_names(stack)) & UNTIMED)
    if untimed:
        return "; ".join(f"{name}: {UNTIMED_WHY.get(name, 'work the fake run does not see or the model does not time')}"
                         for name in untimed)
    return next((why for together, why in UNTIMED_TOGETHER.items() if together <= set(stack.names)), None)


def unsupported_reason(stack: Stack, gpus: int, rates: StepRates | None = None) -> str | None:
    """Why a cell's step time is not predicted on a GPU kind with these rates, or None."""
    untimed = untimed_reason(stack, gpus)
    if untimed:
        return untimed
    slower = sorted(set(stack.names) & SLOWER_THAN_COUNTED)
    if slower and (rates is None or rates.optimizer_8bit_ps is None):
        return (f"{', '.join(slower)}: bitsandbytes' 8-bit optimizer step runs slower than its bytes say, and no "
                "measured cell of it on this GPU kind fits its rate")
    return None


def row_unsupported_reason(row: Mapping[str, Any], stack: Stack, gpus: int, rates: StepRates | None = None) -> str | None:
    """Why a prediction's step time is not predicted: its stack's reason (`unsupported_reason`), else what its fake run
    saw (its evidence: grouped matmuls CUDA runs by its synchronising fallback, bench/predict/grouped_mm.py)."""
    evidence = row.get("evidence_json")
    return unsupported_reason(stack, gpus, rates) or grouped_mm.untimed_reason(
        json.loads(evidence) if isinstance(evidence, str) and evidence else {})


# Where the fit starts: a GPU of the H100's class (how each cell is first judged device- or host-bound).
START = (800.0, 3000.0, 2.0, 5.0)


def fit(works: Sequence[StepWork], measured_ms: Sequence[float], fitted_on: str,
        start: StepRates | None = None) -> StepRates:
    """The rates that best predict the measured step times (least squares of the relative error): the four
    fitted to the cells without a bitsandbytes 8-bit optimizer with the host factors (`_fit_host_factors`; the
    start's host rate and factors where it says `host_fitted=False`), then the optimizer's rate a parameter to
    the cells with one, their other work timed by the four."""
    plain = [i for i, w in enumerate(works) if not w.optimizer_8bit_params]
    eight_bit = [i for i, w in enumerate(works) if w.optimizer_8bit_params]
    plain_works, plain_ms = [works[i] for i in plain], [measured_ms[i] for i in plain]
    if start is not None and not start.host_fitted:  # the host's side is the start's: the device's alone is fitted
        rates = replace(_fit_four(plain_works, plain_ms, fitted_on, start, start.host_factors, fit_host=False),
                        host_fitted=False)
    else:  # the factors' search finds a local optimum: from START and from the start given, the better
        starts = [None, start] if start is not None else [None]
        tried = [_fit_host_factors(plain_works, plain_ms, fitted_on, s) for s in starts]
        rates = min(tried, key=lambda r: _loss(plain_works, plain_ms, r))
    return replace(rates, optimizer_8bit_ps=_fit_8bit([works[i] for i in eight_bit],
                                                      [measured_ms[i] for i in eight_bit], rates),
                   optimizer_8bit_cells=len(eight_bit))


def _fit_host_factors(works: Sequence[StepWork], measured_ms: Sequence[float], fitted_on: str,
                      start: StepRates | None) -> StepRates:
    """The four rates with each technique's host factor (FACTOR_GRID) that fit best: a coordinate search, two
    passes over the techniques the works carry. A factor no host-bound cell shows (every value fits alike) keeps
    the start's."""
    factors = dict(start.host_factors) if start else {}
    present = sorted(set().union(*(w.host_techniques for w in works))) if works else []
    best = _fit_four(works, measured_ms, fitted_on, start, tuple(sorted(factors.items())))
    for _ in range(2):
        for technique in present:
            tried = {value: _fit_four(works, measured_ms, fitted_on, start,
                                      tuple(sorted({**factors, technique: value}.items())))
                     for value in FACTOR_GRID}
            losses = {value: _loss(works, measured_ms, rates) for value, rates in tried.items()}
            if max(losses.values()) - min(losses.values()) > 1e-12:
                factors[technique] = min(losses, key=lambda value: losses[value])
                best = tried[factors[technique]]
    return best


def _loss(works: Sequence[StepWork], measured_ms: Sequence[float], rates: StepRates) -> float:
    """The fit's objective: the sum of squared relative errors."""
    return sum((step_ms(w, rates) / m - 1) ** 2 for w, m in zip(works, measured_ms, strict=True))


def _fit_8bit(works: Sequence[StepWork], measured_ms: Sequence[float], rates: StepRates) -> float | None:
    """The 8-bit optimizer step's device time a parameter, ps, that best predicts these cells (least squares of
    the relative error; one coefficient), their other work at `rates`; None without a cell. The step adds device
    time: taken as device-bound, the cells give it in closed form (the measured ones are, by far), from which
    Gauss-Newton steps find it under the model's combination with the host's time (`combined`)."""
    if not works:
        return None
    seconds = np.asarray(measured_ms, dtype=float) / 1000
    other = np.array([device_ms(replace(w, optimizer_8bit_params=0), rates) for w in works]) / 1000
    host = np.array([host_ms(w, rates) for w in works]) / 1000
    params = np.array([w.optimizer_8bit_params for w in works], dtype=float)
    per_param = params / seconds
    per_param_s = max(float(np.sum(per_param * (1 - other / seconds)) / np.sum(per_param**2)), 0.0)
    for _ in range(20 if not math.isinf(rates.overlap_p) else 0):
        device = other + per_param_s * params
        step = np.array([combined(d, h, rates.overlap_p) for d, h in zip(device, host, strict=True)])
        slope = (device / step) ** (rates.overlap_p - 1) * params / seconds  # d (step / measured) / d per_param_s
        per_param_s = max(per_param_s - float(np.sum((step / seconds - 1) * slope) / np.sum(slope**2)), 0.0)
    return per_param_s * 1e12


def _fit_four(works: Sequence[StepWork], measured_ms: Sequence[float], fitted_on: str,
               start: StepRates | None = None, host_factors: tuple[tuple[str, float], ...] = (),
               fit_host: bool = True) -> StepRates:
    """The four rates that best predict the measured step times (least squares of the relative error). The model
    is nearly the larger of two sums, each linear in the inverse rates, so: judge each cell device- or host-bound,
    fit the device's three rates to the device-bound cells and the host's to the host-bound (linear least
    squares each), judge again, until no cell changes side (or 50 rounds: the best seen is kept); then refine
    them under the two sides' p-norm (`_refined`). A side with too few cells to fit keeps the start's rates
    (`start`, else START): `host_bound_cells` says so."""
    columns, seconds = _columns(works, host_factors), np.asarray(measured_ms, dtype=float) / 1000
    rates = replace(start if start else StepRates(*START, fitted_on=""), fitted_on=fitted_on, left_out="",
                    cells=len(works), host_factors=host_factors, overlap_p=OVERLAP_P)
    best, best_loss = rates, math.inf
    device_bound = np.zeros(len(seconds), dtype=bool)
    for round_ in range(50):
        judged = np.array([device_ms(w, rates) >= host_ms(w, rates) for w in works])
        if round_ and (judged == device_bound).all():
            break
        device_bound = judged
        inverse = _least_squares(columns[device_bound, :3], seconds[device_bound], fallback=_inverse(rates)[:3])
        host = _inverse(rates)[3:]
        if fit_host:
            host = _least_squares(columns[~device_bound, 3:], seconds[~device_bound], fallback=host)
        rates = _with_inverse(rates, np.concatenate([inverse, host]))
        loss = float(np.sum((np.array([step_ms(w, rates) for w in works]) / 1000 / seconds - 1) ** 2))
        if loss < best_loss:
            best, best_loss = rates, loss
    return _refined(columns, seconds, best, fit_host)


def _refined(columns: np.ndarray, seconds: np.ndarray, rates: StepRates, fit_host: bool) -> StepRates:
    """The rates that minimise the relative error's squares under the p-norm (`combined`), from those the
    alternating fit found (its optimum where p = math.inf): Gauss-Newton steps on the inverse rates, each scaled
    by its start (halved until the loss falls; a rate held at 0 stays unbounded), the host's held where
    `fit_host` is False."""
    if math.isinf(rates.overlap_p) or len(seconds) < 4:
        return rates
    p, free = rates.overlap_p, [0, 1, 2, 3] if fit_host else [0, 1, 2]
    theta = _inverse(rates)
    scale = np.where(theta > 1e-29, theta, _inverse(StepRates(*START, fitted_on="")))

    def times(t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        device, host = columns[:, :3] @ t[:3], columns[:, 3] * t[3]
        return device, host, np.array([combined(d, h, p) for d, h in zip(device, host, strict=True)])

    def loss(t: np.ndarray) -> float:
        return float(np.sum((times(t)[2] / seconds - 1) ** 2))

    current = loss(theta)
    for _ in range(50):
        device, host, step = times(theta)
        # d step / d device = (device / step)^(p - 1), and alike for the host's
        slopes = np.column_stack([columns[:, :3] * ((device / step) ** (p - 1))[:, None],
                                  columns[:, 3] * (host / step) ** (p - 1)]) * scale / seconds[:, None]
        move = np.zeros(4)
        move[free] = np.linalg.lstsq(slopes[:, free], 1 - step / seconds, rcond=None)[0]
        for shrink in (1, 0.5, 0.25, 0.125, 0.0625):
            tried = np.where(theta > 1e-29, np.maximum(theta + shrink * move * scale, 0), theta)
            tried_loss = loss(tried)
            if tried_loss < current:
                break
        else:
            break
        improvement, theta, current = current - tried_loss, tried, tried_loss
        if improvement < 1e-12:
            break
    return _with_inverse(rates, theta)


def host_bound_cells(works: Sequence[StepWork], rates: StepRates) -> int:
    """How many of the works the host's pace sets: with none, the host's rate was not fitted."""
    return sum(bound(w, rates) == "host" for w in works)


def _least_squares(x: np.ndarray, seconds: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the relative error of x @ coefficients against seconds (a
    coefficient that would go negative is held at 0: an active set, enough for three); the fallback
    where no cell is there to fit."""
    if len(seconds) < x.shape[1]:
        return fallback
    a, free = x / seconds[:, None], np.ones(x.shape[1], dtype=bool)
    while free.any():
        coefficients = np.zeros(x.shape[1])
        coefficients[free] = np.linalg.lstsq(a[:, free], np.ones(len(seconds)), rcond=None)[0]
        if (coefficients >= 0).all():
            return coefficients
        free &= coefficients > 0
    return fallback


def _inverse(rates: StepRates) -> np.ndarray:
    """Seconds per unit of each column (_columns): per FLOP, per byte, per kernel, per op."""
    return np.array([1 / (rates.matmul_tflops * 1e12), 1 / (rates.memory_gbps * 1e9), rates.kernel_us * 1e-6,
                     rates.op_us * 1e-6])


def _with_inverse(rates: StepRates, inverse: np.ndarray) -> StepRates:
    """The rates with the four of seconds per unit of each column (_inverse)."""
    per_flop, per_byte, per_kernel, per_op = (max(float(v), 1e-30) for v in inverse)  # 0: a rate without bound
    return replace(rates, matmul_tflops=1e-12 / per_flop, memory_gbps=1e-9 / per_byte, kernel_us=per_kernel * 1e6,
                   op_us=per_op * 1e6)


def left_out_errors(works: Sequence[StepWork], measured_ms: Sequence[float],
                    start: StepRates | None = None) -> list[float]:
    """Each cell's error (predicted - measured over measured) by rates fitted to the others (from `start`: the
    rates fitted to all, so each left-out fit searches near their optimum): how the model fares on a cell it has
    not seen, which in-sample errors overstate."""
    errors = []
    for i, (work, measured) in enumerate(zip(works, measured_ms, strict=True)):
        rates = fit([*works[:i], *works[i + 1:]], [*measured_ms[:i], *measured_ms[i + 1:]], "", start)
        errors.append(step_ms(work, rates) / measured - 1)
    return errors


def error_summary(errors: Sequence[float]) -> str:
    """Errors in a phrase: "median 6.1% off, -18.0% to +12.4%"."""
    return f"median {statistics.median(abs(e) for e in errors):.1%} off, {min(errors):+.1%} to {max(errors):+.1%}"


def _columns(works: Sequence[StepWork], host_factors: Sequence[tuple[str, float]]) -> np.ndarray:
    """The works as rows of (compute FLOPs, memory bytes, kernels, ops weighed by their host factor)."""
    return np.array([(w.compute_flops, w.memory_bytes, w.kernels, w.ops * host_factor(w, host_factors)) for w in works],
                    dtype=float).reshape(-1, 4)
