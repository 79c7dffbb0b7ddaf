"""Predicted step time beside measured: PREDICTION.md's section, and the cells the rates are fitted to.

The cells: published GPU cells (`report.pairs`: measured, `ok`, beside their prediction) whose prediction
counted the step's work (fake-run/14 on) and whose stack and rank count the model times
(bench/predict/steptime.py). The measured step time is the median of the measured steps (step_ms_p50).
"""

from __future__ import annotations

import pandas as pd

from ..stacks import parse_stack
from ..views import code_cell
from . import steptime
from .gpus import GPUS


def timed(both: pd.DataFrame, gpu_key: str) -> pd.DataFrame:
    """The pairs measured on this GPU kind whose step time can be set beside a prediction, with their work
    (`work`, a StepWork)."""
    if both.empty or "step_ops" not in both:
        return both.iloc[0:0].assign(work=[])
    rows = both[(both["gpu_name"] == GPUS[gpu_key].name) & both["step_ms_p50"].notna()]
    works = [steptime.work_of(r) if steptime.unsupported_reason(parse_stack(r["stack"]).names, int(r["gpus"])) is None
             else None for _, r in rows.iterrows()]
    rows = rows.assign(work=works)
    return rows[rows["work"].notna()]


def fitted(both: pd.DataFrame, gpu_key: str, fitted_on: str,
           start: steptime.StepRates | None = None) -> steptime.StepRates | None:
    """The rates fitted to this GPU kind's timed cells (tools/fit_step_time.py), None with fewer than 8."""
    rows = timed(both, gpu_key)
    if len(rows) < 8:
        return None
    return steptime.fit(list(rows["work"]), list(rows["step_ms_p50"]), fitted_on, start)


def section(both: pd.DataFrame) -> list[str]:
    """## Step time: per GPU kind with rates, each timed cell's measured and predicted step time, in-sample
    and with the cell left out of the fit."""
    lines: list[str] = []
    for key, rates in steptime.RATES.items():
        rows = timed(both, key)
        if rows.empty:
            continue
        works, measured = list(rows["work"]), list(rows["step_ms_p50"])
        predicted = [steptime.step_ms(w, rates) for w in works]
        left_out = steptime.left_out_errors(works, measured, start=rates)  # a side no cell fits: as RATES has it
        errors = pd.Series([p / m - 1 for p, m in zip(predicted, measured, strict=True)])
        lines += _head(key, rates, errors, pd.Series(left_out))
        for (_, r), p, lo in zip(rows.iterrows(), predicted, left_out, strict=True):
            lines.append(f"| `{r['cell_id']}` | {code_cell(r['stack'])} | {r['seq_len']} | {r['batch_size']} | "
                         f"{r['step_ms_p50']:.1f} | {p:.1f} | {p / r['step_ms_p50'] - 1:+.1%} | {lo:+.1%} | "
                         f"{_as_predicted_then(r)} | {steptime.bound(r['work'], rates)} |")
        lines.append("")
    if lines:
        lines = ["## Step time (predicted)", "",
                 "How long a step takes, predicted from the work the fake run dispatched (bench/predict/steptime.py): "
                 "the larger of the device's time (compute-bound FLOPs at a matmul rate, memory-bound bytes at a "
                 "bandwidth, a gap per kernel) and the host's (a time per op dispatched), four rates a GPU kind "
                 "fitted to these cells' measured median step times. *Left out*: the cell predicted by rates fitted "
                 "to the others, the error to expect of a cell no GPU has run. *As predicted then*: the step time "
                 "the prediction kept when it was made (fake-run/14 on), at the rates of its day. Offload, ZeRO, QLoRA, "
                 "8-bit optimizers and several-rank cells are not timed.", "", *lines]
    return lines


def _as_predicted_then(r: pd.Series) -> str:
    """The error of the step time the prediction kept when it was made (`step_ms`, at the rates of its day):
    where it was made before the GPU ran the cell, no fit had seen the measurement. Empty where none was kept."""
    then = pd.to_numeric(pd.Series([r.get("step_ms")]), errors="coerce").iloc[0]
    return "" if pd.isna(then) else f"{then / r['step_ms_p50'] - 1:+.1%}"


def _head(key: str, rates: steptime.StepRates, errors: pd.Series, left_out: pd.Series) -> list[str]:
    return [f"### {GPUS[key].name}", "",
            f"Rates: {rates.matmul_tflops:.0f} TFLOP/s, {rates.memory_gbps:.0f} GB/s, {rates.kernel_us:.2f} µs a "
            f"kernel, {rates.op_us:.2f} µs of host time an op; fitted on {rates.fitted_on}.", "",
            f"{len(errors)} cells: abs error median {errors.abs().median():.1%}, max {errors.abs().max():.1%}; "
            f"left out: median {left_out.abs().median():.1%}, max {left_out.abs().max():.1%}, "
            f"{(left_out.abs() > 0.1).sum()} over 10%.", "",
            "| cell | stack | seq | batch | measured ms | predicted ms | error | left out | as predicted then | bound |",
            "|---|---|---|---|---|---|---|---|---|---|"]
