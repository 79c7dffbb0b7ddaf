"""Predicted step time beside measured: PREDICTION.md's section, and the cells the rates are fitted to.

The cells: published GPU cells (`report.pairs`: measured, `ok`, beside their prediction) whose prediction
counted the step's work as now (fake-run/22 on, a Liger stack's 24 on: steptime.cell_work) and whose stack and rank count
the model times (bench/predict/steptime.py), a bitsandbytes 8-bit optimizer's cells among them (their own rate
is fitted to them). The measured step time is the median of the measured steps (step_ms_p50).
"""

from __future__ import annotations

import pandas as pd

from ..stacks import parse_stack
from ..views import code_cell
from . import steptime
from .gpus import GPUS


def timed(both: pd.DataFrame, gpu_key: str, rates: steptime.StepRates | None = None) -> pd.DataFrame:
    """The pairs measured on this GPU kind whose step time can be set beside a prediction (with `rates`: one these
    rates predict), with their work (`work`, a StepWork)."""
    if both.empty or "step_ops" not in both:
        return both.iloc[0:0].assign(work=[])
    rows = both[(both["gpu_name"] == GPUS[gpu_key].name) & both["step_ms_p50"].notna()]
    works = [_work(r, rates) for _, r in rows.iterrows()]
    rows = rows.assign(work=works)
    return rows[rows["work"].notna()]


def _work(r: pd.Series, rates: steptime.StepRates | None) -> steptime.StepWork | None:
    stack, gpus = parse_stack(r["stack"]), int(r["gpus"])
    # without rates, only what no GPU kind times; with them, also what they cannot (an 8-bit optimizer's rate missing)
    if steptime.untimed_reason(stack, gpus) if rates is None else steptime.unsupported_reason(stack, gpus, rates):
        return None
    # the predicted row's parameters: a prediction's work is its own
    return steptime.cell_work({**r, "trainable_params": r.get("trainable_params_predicted")}, stack)


def fitted(both: pd.DataFrame, gpu_key: str, fitted_on: str,
           start: steptime.StepRates | None = None) -> steptime.StepRates | None:
    """The rates fitted to this GPU kind's timed cells (tools/fit_step_time.py), None with fewer than 8 to fit the
    four rates to."""
    rows = timed(both, gpu_key)
    if sum(not w.optimizer_8bit_params for w in rows["work"]) < 8:
        return None
    return steptime.fit(list(rows["work"]), list(rows["step_ms_p50"]), fitted_on, start)


def section(both: pd.DataFrame, before: pd.DataFrame) -> list[str]:
    """## Step time: per GPU kind with rates, each timed cell's measured and predicted step time, in-sample
    and with the cell left out of the fit; and as predicted before the GPU ran it (`before`: report.pairs'
    made_before_run pairs, whose `step_ms` a prediction kept at the rates of its day)."""
    kept = {} if before.empty or "step_ms" not in before else \
        {(c, g): ms for c, g, ms in zip(before["cell_id"], before["gpu_name"],
                                       pd.to_numeric(before["step_ms"], errors="coerce"), strict=True) if pd.notna(ms)}
    lines: list[str] = []
    for key, rates in steptime.RATES.items():
        rows = timed(both, key, rates)
        if rows.empty:
            continue
        works, measured = list(rows["work"]), list(rows["step_ms_p50"])
        predicted = [steptime.step_ms(w, rates) for w in works]
        # each refit from these rates (as tools/fit_step_time.py does; a kind that keeps another's host side keeps it)
        left_out = steptime.left_out_errors(works, measured, start=rates)
        errors = pd.Series([p / m - 1 for p, m in zip(predicted, measured, strict=True)])
        lines += _head(key, rates, errors, pd.Series(left_out))
        for (_, r), p, lo in zip(rows.iterrows(), predicted, left_out, strict=True):
            lines.append(f"| `{r['cell_id']}` | {code_cell(r['stack'])} | {r['seq_len']} | {r['batch_size']} | "
                         f"{r['step_ms_p50']:.1f} | {p:.1f} | {p / r['step_ms_p50'] - 1:+.1%} | {lo:+.1%} | "
                         f"{_as_predicted_then(r, kept.get((r['cell_id'], r['gpu_name'])))} | "
                         f"{steptime.device_ms(r['work'], rates):.0f} / {steptime.host_ms(r['work'], rates):.0f} | "
                         f"{steptime.bound(r['work'], rates)} |")
        lines.append("")
    if lines:
        lines = ["## Step time (predicted)", "",
                 "How long a step takes, predicted from the work the fake run dispatched (bench/predict/steptime.py): "
                 "the device's time (compute-bound FLOPs at a matmul rate, memory-bound bytes at a bandwidth, a gap "
                 "per kernel) and the host's (a time per op dispatched, times a factor under gc, LoRA and DoRA), "
                 "combined as their p-norm (the larger where one dominates, more where they are close: each waits on "
                 "the other), four rates and the factors a GPU kind "
                 "fitted to these cells' measured median step times. *Left out*: the cell predicted by rates fitted "
                 "to the others, the error to expect of a cell no GPU has run. *Device / host*: the two sums the step "
                 "combines, at these rates (where they are close, the step is longer than either). *As predicted "
                 "then*: the step time "
                 "kept by the newest prediction made before the GPU ran the cell (fake-run/14 on), at the rates of its "
                 "day: no fit had seen the measurement. Offload, ZeRO, QLoRA and LLM.int8 bases, cut cross-entropy, "
                 "torch.compile with Liger and torchao's compiled step, selective checkpointing's op policy (a Python "
                 "dispatch mode on every op), a mixture of experts' fp32 grouped matmuls (mixed precision: CUDA's "
                 "fallback synchronises the device each call) and several-rank cells are not timed; torch.compile's "
                 "cells are, from "
                 "the kernels of the code inductor generates for the CPU, each reading or writing its tensors once. "
                 "bitsandbytes' 8-bit optimizer step, slower than its bytes say, adds a fifth rate: device time a "
                 "trainable parameter, fitted to its cells alone.",
                 "", *lines]
    return lines


def _as_predicted_then(r: pd.Series, then_ms: float | None) -> str:
    """The error of the step time kept by the newest prediction made before the GPU ran the cell (at the rates of
    its day: no fit had seen the measurement). Empty where no such prediction kept one."""
    return "" if then_ms is None else f"{then_ms / r['step_ms_p50'] - 1:+.1%}"


def _overlap(rates: steptime.StepRates) -> str:
    return "; the larger side" if rates.overlap_p == float("inf") else f"; the sides' p-norm, p = {rates.overlap_p:g}"


def _head(key: str, rates: steptime.StepRates, errors: pd.Series, left_out: pd.Series) -> list[str]:
    return [f"### {GPUS[key].name}", "",
            f"Rates: {rates.matmul_tflops:.0f} TFLOP/s, {rates.memory_gbps:.0f} GB/s, {rates.kernel_us:.2f} µs a "
            f"kernel, {rates.op_us:.2f} µs of host time an op{_factors(rates)}{_overlap(rates)}; fitted on "
            f"{rates.fitted_on}.{_8bit(rates)}",
            "",
            f"{len(errors)} cells: abs error median {errors.abs().median():.1%}, max {errors.abs().max():.1%}; "
            f"left out: median {left_out.abs().median():.1%}, max {left_out.abs().max():.1%}, "
            f"{(left_out.abs() > 0.1).sum()} over 10%.", "",
            "| cell | stack | seq | batch | measured ms | predicted ms | error | left out | as predicted then "
            "| device / host ms | bound |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]


def _8bit(rates: steptime.StepRates) -> str:
    if rates.optimizer_8bit_ps is None:
        return ""
    return (f" bitsandbytes' 8-bit optimizer step: {rates.optimizer_8bit_ps:.1f} ps a trainable parameter, fitted on "
            f"{rates.optimizer_8bit_cells} cells (each left out: {rates.optimizer_8bit_left_out}).")


def _factors(rates: steptime.StepRates) -> str:
    return "".join(f", x {value:g} under {technique}" for technique, value in rates.host_factors)
