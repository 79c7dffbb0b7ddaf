"""Where a cell's step time goes on the GPU, beside what the step time model counts for it.

    python tools/step_profile.py record MATRIX CELL_ID OUT.json.gz   # on a GPU
    python tools/step_profile.py summary MATRIX OUT.json.gz... [--gpu h200]  # on any CPU

`record` runs the cell as a worker does (bench/worker.py) with torch's profiler on its measured steps (CUDA
activity alone: each kernel's name, start and end), and keeps per kernel name its count and device time, and
the measured steps' span and the time the device was busy in it. A few KB gzipped. One cell a process, as the
suite runs them: Liger's patch and torch.compile's caches outlive a cell.

`summary` sorts the kernels into classes by name (`CLASSES`: cuBLAS's matmuls, attention, bitsandbytes',
copies, ATen's element-wise and reductions, the rest: Triton's, Liger's and inductor's) and prints each class's
kernels and milliseconds a step, the device's busy time and idle time beside the measured step, and the step
time model's sums for the same cell from a fake run here (bench/predict/steptime.py): compute, bytes,
kernels' gaps and the host. Where the model is off (Liger's cells 1-10% short, QLoRA's 13-19%, compile with
Liger 50%), the classes say whether the device's kernels ran longer than their work says, or the device
waited.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from cell_trace import refuse  # noqa: E402

# Kernel classes by name, the first that matches: cuBLAS's and CUTLASS's matmuls, attention, bitsandbytes',
# copies and fills, ATen's own kernels; the rest are Triton's (Liger's, inductor's) and libraries' others.
CLASSES = (("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm\d\d_", re.I)),
           ("attention", re.compile(r"flash|fmha|attention|cudnn", re.I)),
           ("bitsandbytes", re.compile(r"kDequantize|kQuantize|kgemm|kOptimizer|kPreconditionOptimizer|bitsandbytes")),
           ("copy", re.compile(r"^Memcpy|^Memset|CatArrayBatched|copy_kernel|direct_copy")),
           ("aten", re.compile(r"at::|void \w+<")),
           ("triton and other", re.compile(r"")))


def kernel_class(name: str) -> str:
    return next(label for label, pattern in CLASSES if pattern.search(name))


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """The time covered by the union of (start, end) intervals: the device busy with at least one kernel."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def record(matrix_name: str, cell_id: str, out: Path) -> None:
    import torch
    from cell_trace import one_gpu_cell
    from torch.profiler import ProfilerActivity, profile, schedule

    from bench import measure, worker

    cell = one_gpu_cell(matrix_name, cell_id)
    step_done = measure.PhaseTracker.step_done
    # the profiler on the measured steps alone: it waits out the first step and the warm-up ones (at least one)
    plan = schedule(wait=cell.warmup_steps - 1, warmup=1, active=cell.measure_steps, repeat=1)
    with profile(activities=[ProfilerActivity.CUDA], schedule=plan) as profiler:

        def stepped(tracker: Any, *args: Any, **kwargs: Any) -> None:
            step_done(tracker, *args, **kwargs)
            profiler.step()

        measure.PhaseTracker.step_done = stepped  # type: ignore[method-assign,assignment]
        try:
            row = worker.run_cell(cell)
        finally:
            measure.PhaseTracker.step_done = step_done  # type: ignore[method-assign]
    found = {"matrix": matrix_name, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
             "cuda": torch.version.cuda, "cells": [_profiled(cell, row, profiler.events())]}
    with gzip.open(out, "wt") as handle:
        json.dump(found, handle, separators=(",", ":"))
    print(f"{cell_id}: {row.get('status')}, step {row.get('step_ms_p50')} ms (median, under the profiler) -> {out}")


def _profiled(cell: Any, row: dict[str, Any], events: Any) -> dict[str, Any]:
    """One cell's record: its row's step times, and per kernel name the count and device time (µs) over the
    measured steps, with their span and the time the device was busy in it."""
    kernels = [e for e in events if str(e.device_type).endswith("CUDA")]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        tally = by_name.setdefault(e.name, [0, 0.0])
        tally[0] += 1
        tally[1] += e.time_range.end - e.time_range.start
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    return {"cell_id": cell.cell_id, "steps": cell.measure_steps,
            **{k: row.get(k) for k in ("status", "step_ms_p50", "step_ms_p10", "step_ms_p90", "error")},
            "span_us": (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0,
            "busy_us": busy_us(spans), "kernels": sorted(([n, c, us] for n, (c, us) in by_name.items()),
                                                         key=lambda k: -k[2])}


def by_class(cell: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """A recorded cell's kernels a step and milliseconds a step, per class."""
    found: dict[str, tuple[float, float]] = {}
    steps = cell["steps"]
    for name, count, us in cell["kernels"]:
        label = kernel_class(name)
        kernels, ms = found.get(label, (0.0, 0.0))
        found[label] = (kernels + count / steps, ms + us / 1000 / steps)
    return found


def summary(matrix_name: str, paths: list[Path], gpu_kind: str) -> None:
    for path in paths:
        _summary(matrix_name, path, gpu_kind)


def _summary(matrix_name: str, path: Path, gpu_kind: str) -> None:
    try:
        with gzip.open(path, "rt") as handle:
            recorded = json.load(handle)
    except (OSError, ValueError) as err:
        refuse(f"{path}: not a profile `record` wrote ({err})")
    print(f"{path.name}: {recorded['gpu']}, torch {recorded['torch']} (CUDA {recorded['cuda']})")
    for cell in recorded["cells"]:
        steps = cell["steps"]
        print(f"\n{cell['cell_id']}: {cell['status']}, step {cell['step_ms_p50']} ms under the profiler (median; "
              f"its kernels span {cell['span_us'] / 1000 / steps:.1f} ms a step, the device busy "
              f"{cell['busy_us'] / 1000 / steps:.1f})")
        for label, (kernels, ms) in sorted(by_class(cell).items(), key=lambda item: -item[1][1]):
            print(f"  {label:18s} {kernels:8.0f} kernels {ms:8.1f} ms a step")
        for name, count, us in cell["kernels"][:5]:
            print(f"    {us / 1000 / steps:7.2f} ms  {count / steps:6.0f} x  {name[:110]}")
        print("  " + _modelled(matrix_name, cell["cell_id"], gpu_kind))


def _modelled(matrix_name: str, cell_id: str, gpu_kind: str) -> str:
    """The step time model's sums for the cell, from a fake run on this CPU at the GPU kind's rates."""
    from cell_trace import find_cell

    from bench.predict import fake, gpus, steptime

    cell = find_cell(matrix_name, cell_id)
    row = fake.predict_cell(cell, gpus.get(gpu_kind))
    rates, work = steptime.RATES.get(gpu_kind), steptime.cell_work(row, cell.stack)
    if rates is None or work is None:
        return f"model: no step time ({row.get('unsupported_reason') or 'no rates or no work counted'})"
    compute = work.compute_flops / rates.matmul_tflops / 1e9
    memory = work.memory_bytes / rates.memory_gbps / 1e6
    gaps = work.kernels * rates.kernel_us / 1000
    return (f"model ({gpu_kind}): {work.kernels:,} kernels; compute {compute:.1f} ms + bytes {memory:.1f} + gaps "
            f"{gaps:.1f} = device {steptime.device_ms(work, rates):.1f}; host {steptime.host_ms(work, rates):.1f} "
            f"({work.ops:,} ops); step {steptime.step_ms(work, rates):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("matrix")
    rec.add_argument("cell_id")
    rec.add_argument("out", type=Path)
    show = sub.add_parser("summary")
    show.add_argument("matrix")
    show.add_argument("profiles", type=Path, nargs="+")
    show.add_argument("--gpu", default="h100")
    args = parser.parse_args()
    if args.command == "record":
        record(args.matrix, args.cell_id, args.out)
        return
    from bench.predict import gpus

    if args.gpu not in gpus.GPUS:
        refuse(f"unknown GPU kind {args.gpu!r}; known: {', '.join(gpus.GPUS)}")
    summary(args.matrix, args.profiles, args.gpu)


if __name__ == "__main__":
    from bench import hashseed

    hashseed.pin()
    main()
