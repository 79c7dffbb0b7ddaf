"""The page's data: every published cell, measured and predicted, one record each, with every column.

A record is one cell of one published run (repeats folded as the boards fold them: memory the max,
tokens/s the median). Besides the row itself, a record carries what the page filters and plots on,
computed here once so the page's script stays small:

- `gpu`: the card the figure is for (NVML's name; a prediction's GPU kind is mapped to the same name,
  so a filter on "H100" shows both; CPU runs are "CPU").
- `peak_gib`: the peak the boards show (reserved on a GPU, host RSS on a CPU, predicted reserved —
  else allocated — for a prediction).
- `device_gib`: the device's peak: NVML's for a measured GPU cell (peak reserved where NVML is
  missing), `device_peak_gib` for a prediction (reserved + what lives outside torch).
- `need_gib`: the card the cell needs, what the "fits in N GiB" control compares: a measured cell's
  device peak; a prediction's smallest card (`least_card_gib`: the allocator releasing its cache and
  retrying where it must), else its device peak.
- `tokens_per_s`: a measured cell's (the median of its repeats); a prediction's from its step time predicted
  at its GPU kind's rates fitted today (bench/predict/steptime.py), None where the model does not time its
  stack or rank count or the row counted no work (an older method's).
- `error`: for a prediction of a cell also measured on its GPU, (predicted − measured) / measured
  peak reserved: this prediction's own, so an older one replaced by a newer shows what it predicted.
- `primary`: the record that stands for its cell among the runs of the same source and GPU (ok before
  not ok; of predictions, one made under the GPU runs' releases before one made under others, as the
  boards choose; then the newest), so a cell measured by three runs is plotted once. The primary
  prediction of a measured cell is the one PREDICTION.md pairs with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .. import results
from ..predict import gpus, steptime
from ..predict import report as predict_report
from ..stacks import Stack
from ..views import by_cell

# Columns added by views.by_cell, defined here as the schema defines the others.
FOLDED_COLUMNS = (
    ("repeats", "int", "ok runs of the cell folded into this row (memory: their max; tokens/s: their median)"),
    ("tokens_per_s_cv", "float", "stdev / mean of tokens_per_s across repeats"),
    ("peak_spread", "float", "(max - min) / min of the stable peak across repeats (allocated on a GPU)"),
)
UNITS = (("_gib", "GiB"), ("_ms_p10", "ms"), ("_ms_p50", "ms"), ("_ms_p90", "ms"), ("tokens_per_s", "tokens/s"),
         ("tokens_per_s_per_gpu", "tokens/s per GPU"), ("_s", "s"), ("mfu", "fraction 0..1"), ("_frac", "fraction"),
         ("_params", "parameters"), ("_per_token", "FLOPs/token"))


@dataclass(frozen=True)
class SiteData:
    cells: list[dict[str, Any]]
    columns: dict[str, dict[str, str]]  # name -> unit, definition (measured and predicted definitions)
    predictor: dict[str, Any]  # the one-rank fake run's measured error (peak reserved) over the cells measured too,
    # and the stacks those cells have (a prediction of another stack is checked only through its techniques)
    sources: list[str] = field(default_factory=list)  # parquet files read, relative to the results dir
    step_time: dict[str, dict[str, Any]] = field(default_factory=dict)  # GPU name -> the step time model's fit:
    # how many measured cells, and their errors each left out of it (a predicted tokens/s's accuracy)


def unit_of(column: str) -> str:
    """A column's unit, read off its name (the suite names columns with their units)."""
    for suffix, unit in UNITS:
        if column.endswith(suffix):
            return unit
    return ""


def column_definitions() -> dict[str, dict[str, str]]:
    columns: dict[str, dict[str, str]] = {}
    for table in (results.MEASURED, results.PREDICTED):
        for name, _, definition in table.schema:
            entry = columns.setdefault(name, {"unit": unit_of(name), "measured": "", "predicted": ""})
            entry[table.name] = definition
    for name, _, definition in FOLDED_COLUMNS:
        columns[name] = {"unit": unit_of(name), "measured": definition, "predicted": ""}
    return columns


def published_tables(results_dir: Path) -> list[Path]:
    """Every run's table: <matrix>/runs/*.parquet and <matrix>/predicted/*.parquet (the fit frontier's
    tables are of another shape; its board is linked instead)."""
    return sorted([*results_dir.glob("*/runs/*.parquet"), *results_dir.glob("*/predicted/*.parquet")])


def collect(results_dir: Path) -> SiteData:
    tables = published_tables(results_dir)
    cells: list[dict[str, Any]] = []
    for path in tables:
        frame = results.read_any(path)
        predicted = "prediction_method" in frame.columns
        for row in (frame if predicted else by_cell(frame)).to_dict("records"):
            cells.append(_record(_clean(row), "predicted" if predicted else "measured"))
    measured = predict_report.measured_gpu_cells(results_dir)
    reserved = {(cell_id, str(gpu)): float(gib) for cell_id, gpu, gib
                in zip(measured["cell_id"], measured["gpu_name"], measured["peak_reserved_gib"], strict=True)
                if pd.notna(gib)}
    for cell in cells:
        if cell["source"] == "predicted":
            cell["error"] = _error(cell, reserved.get((cell["cell_id"], cell["gpu"])))
    _mark_primary(cells, predict_report.measured_software(measured))
    summary = _predictor_summary(predict_report.pairs(measured, predict_report.predictions(results_dir,
                                                                                           every_software=True)))
    return SiteData(cells, column_definitions(), summary,
                    [str(p.relative_to(results_dir)) for p in tables], _step_time_fits())


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    """Non-empty values only, as JSON-able Python (NaN and NA dropped, numpy scalars unwrapped)."""
    out = {}
    for key, value in row.items():
        if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
            continue
        out[key] = value.item() if hasattr(value, "item") else value
    return out


def _gpu(row: dict[str, Any], source: str) -> str:
    if source == "predicted":
        kind = gpus.GPUS.get(row.get("gpu_kind", ""))
        return kind.name if kind else str(row.get("gpu_kind", "?"))
    return str(row.get("gpu_name") or "GPU") if row.get("device") == "cuda" else "CPU"


def _techniques(stack_json: str | None) -> list[str]:
    return [name for name, _ in json.loads(stack_json or "[]")]


def _record(row: dict[str, Any], source: str) -> dict[str, Any]:
    on_gpu = row.get("device") == "cuda"
    if source == "predicted":
        peak = row.get("peak_reserved_gib", row.get("peak_allocated_gib"))
        device = row.get("device_peak_gib", peak)
        need = device if row.get("least_card_gib") is None else row["least_card_gib"]
        capacity = row.get("gpu_memory_gib")
        tokens_per_s = _predicted_tokens_per_s(row)
    else:
        peak = row.get("peak_reserved_gib") if on_gpu else row.get("host_rss_peak_gib")
        device = need = row.get("nvml_peak_gib", peak) if on_gpu else None
        capacity = row.get("gpu_memory_gib") if on_gpu else None
        tokens_per_s = row.get("tokens_per_s")
    return {
        "key": f"{row['run_id']}/{row['cell_id']}", "cell_id": row["cell_id"], "source": source,
        "run_id": row["run_id"], "matrix": row.get("matrix"), "model": row["model"], "seq_len": row["seq_len"],
        "batch_size": row["batch_size"], "gpus": row.get("gpus", 1), "stack": row["stack"],
        "techniques": _techniques(row.get("stack_json")), "status": row["status"], "gpu": _gpu(row, source),
        "capacity_gib": capacity, "peak_gib": peak, "device_gib": device, "need_gib": need,
        "tokens_per_s": tokens_per_s, "started_at": row.get("started_at", ""), "error": None,
        "row": row,
    }


def _predicted_tokens_per_s(row: dict[str, Any]) -> float | None:
    """A prediction's tokens/s at its GPU kind's rates of today (not the `step_ms` it kept when made, so every
    prediction on the page is timed by the same fit), None where not predicted."""
    step_ms = steptime.predicted_ms(row, str(row.get("gpu_kind", "")), Stack.from_row(row.get("stack_json")),
                                    int(row.get("gpus", 1)))
    return None if step_ms is None else steptime.tokens_per_s(int(row["batch_size"]), int(row["seq_len"]), step_ms)


def _error(cell: dict[str, Any], measured_reserved_gib: float | None) -> float | None:
    """A prediction's (predicted − measured) / measured peak reserved, where its cell was measured on its GPU."""
    predicted_gib = cell["row"].get("peak_reserved_gib")
    if cell["status"] != "ok" or predicted_gib is None or not measured_reserved_gib:
        return None
    return (predicted_gib - measured_reserved_gib) / measured_reserved_gib


def _mark_primary(cells: list[dict[str, Any]], gpu_software: str | None) -> None:
    def rank(cell: dict[str, Any]) -> tuple[bool, bool, str]:
        row = cell["row"]
        label = predict_report.software_label(row)
        return cell["status"] == "ok", cell["source"] == "predicted" and label == gpu_software, cell["started_at"]

    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for cell in cells:
        cell["primary"] = False
        key = (cell["source"], cell["gpu"], cell["cell_id"])
        held = best.get(key)
        if held is None or rank(cell) > rank(held):
            best[key] = cell
    for cell in best.values():
        cell["primary"] = True


def _step_time_fits() -> dict[str, dict[str, Any]]:
    return {gpus.GPUS[key].name: {"cells": rates.cells, "left_out": rates.left_out}
            for key, rates in steptime.RATES.items() if key in gpus.GPUS}


def _predictor_summary(both: pd.DataFrame) -> dict[str, Any]:
    """The one-rank fake run's errors over the cells PREDICTION.md pairs (`predict_report.pairs`), and their
    stacks (the other methods say on each cell that they are unchecked until a measurement checks them)."""
    one_rank, stacks = [], set()
    for row in both.to_dict("records"):
        if row.get("reserved_error_frac") is None or pd.isna(row["reserved_error_frac"]):
            continue
        if str(row["prediction_method"]).startswith("fake-run") and row["gpus"] == 1:
            one_rank.append(abs(float(row["reserved_error_frac"])))
            stacks.add(str(row["stack"]))
    if not one_rank:
        return {"cells": 0, "stacks": []}
    return {"cells": len(one_rank), "median_abs_error": float(pd.Series(one_rank).median()),
            "max_abs_error": max(one_rank), "peak": "reserved", "stacks": sorted(stacks)}
