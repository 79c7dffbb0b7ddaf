"""Views of result tables that every report shares: one row per cell, which figure is "the peak",
and how numbers are written. Read by report (boards), plots, compare (the gate), fitreport and
progress, so a rule changed here changes everywhere at once.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from .results import MEMORY_COLUMNS

# "The peak" of a cell: on a GPU what the caching allocator reserved (what must fit on the card);
# on a CPU, the worker's resident memory (no allocator counters there).
PEAK_COLUMNS = {"cuda": "peak_reserved_gib", "cpu": "host_rss_peak_gib"}
# The repeatable peak, for the spread between repeats: allocated bytes do not depend on the
# allocator's caching decisions.
STABLE_PEAK_COLUMNS = {"cuda": "peak_allocated_gib", "cpu": "host_rss_peak_gib"}
PEAK_DEFINITIONS = {
    "peak_reserved_gib": "overall peak reserved by the caching allocator, from model build through the first "
                         "(optimizer-state) step to the last: what must fit on the card, CUDA context not included "
                         "(see nvml_peak_gib in the parquet for that)",
    "peak_allocated_gib": "PREDICTED overall peak of allocated bytes (bench predict): live tensors only, no "
                          "allocator caching, no CUDA context",
    "host_rss_peak_gib": "peak resident memory of the worker process (CPU run: weights, activations and optimizer "
                         "state live in host RAM, with the Python runtime and libraries)",
}


def _device(frame: pd.DataFrame) -> str:
    return "cuda" if (frame["device"] == "cuda").any() else "cpu"


def peak_column(frame: pd.DataFrame) -> str:
    """The column a table shows as a cell's peak memory (definition: PEAK_DEFINITIONS). A table of
    predictions has one peak: allocated (what bench predict predicts)."""
    if "prediction_method" in frame.columns:
        return "peak_allocated_gib"
    return PEAK_COLUMNS[_device(frame)]


def stable_peak_column(frame: pd.DataFrame) -> str:
    return STABLE_PEAK_COLUMNS[_device(frame)]


def row_peak_gib(row: dict[str, Any]) -> float | None:
    """One row's peak, by the same rule."""
    return row.get(PEAK_COLUMNS["cuda" if row.get("device") == "cuda" else "cpu"])


def by_cell(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: repeats folded into the first repeat's row.

    Memory columns: the max over ok repeats (what must fit). tokens_per_s: the median. Added:
    `repeats` (ok runs), `tokens_per_s_cv` (stdev / mean across repeats) and `peak_spread`
    ((max - min) / min across repeats of the stable peak: allocated on a GPU, host RSS on a CPU).
    """
    frame = frame.assign(repeat=frame["repeat"].fillna(0)) if "repeat" in frame else frame.assign(repeat=0)
    rows = []
    for _, group in frame.sort_values("repeat").groupby("cell_id", sort=False):
        row = group.iloc[0].copy()
        ok = group[group["status"] == "ok"]
        row["repeats"] = len(ok)
        if len(ok) > 1:
            for col in MEMORY_COLUMNS:
                row[col] = ok[col].max()
            tps = ok["tokens_per_s"].astype(float)
            row["tokens_per_s"] = tps.median()
            row["tokens_per_s_cv"] = tps.std(ddof=0) / tps.mean()
            peak = ok[stable_peak_column(ok)].astype(float)
            row["peak_spread"] = (peak.max() - peak.min()) / peak.min()
        rows.append(row)
    return pd.DataFrame(rows).reset_index(drop=True)


def in_cell(text: str) -> str:
    """Text kept whole in a markdown table's cell: a `|` in it (lora's targets, q_proj|v_proj) escaped, which
    GitHub's tables read as one pipe, else the row splits there. Not changed to another character: a user
    copies peft's hint of targets as it is written."""
    return str(text).replace("|", "\\|")


def code_cell(text: str) -> str:
    """Text as code in a markdown table's cell: its pipes escaped as in `in_cell` (needed inside a code span
    too)."""
    return "`" + in_cell(text) + "`"


def gib(x: float) -> str:
    """Memory in GiB: two decimals below 10, one above."""
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def rate(x: float) -> str:
    """Throughput: `18.2k tok/s`, or `950 tok/s`."""
    return f"{x / 1000:.1f}k tok/s" if x >= 1000 else f"{x:.0f} tok/s"


def pct(x: float) -> str:
    """A relative change: `+12%`, `-3%`, `±0%`."""
    return "±0%" if round(x * 100) == 0 else f"{x:+.0%}"
