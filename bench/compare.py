"""Baseline run vs candidate run (e.g. a new torch or transformers): per-cell deltas and a verdict.

Cells are joined on `cell_id`, which hashes every setting of a cell but no library version, so the
same cell run under two version sets pairs up.

- Memory is close to deterministic: a cell regresses when a peak grows by more than
  max(mem_rel x baseline peak, mem_abs_gib) (default: 2% or 0.25 GiB = 256 MiB, whichever is larger).
  A measured run is gated on its table's peak (reserved on a GPU); two predictions on both predicted
  peaks, allocated and reserved, because a release can move when a buffer is allocated without
  changing any tensor's size, and only reserved shows that (transformers 5.23 moved a 32 MiB
  workspace and changed gc's predicted reserved by 3% at the same allocated).
- Throughput is noisy: the band is derived from the measured spread, not a bare percentage. Each
  side's relative standard error is cv / sqrt(n): across its repeats when the cell was repeated
  (`--repeats`), else of its step times within the run (n = measured steps); a drop regresses
  when it exceeds z (default 3) x their root-sum-square, and never less than tps_floor (default 3%),
  because run-to-run drift (clocks, other tenants) exceeds what one run's step spread shows.
- A prediction's step time is deterministic: two predictions are gated on the step time their counted work
  comes to at today's rates for the GPU kind (bench/predict/steptime.py), both sides at the same rates, so
  what moves it is the work a release dispatches (more ops, kernels, bytes, FLOPs), not a refit; it regresses
  when it grows by more than step_rel (default 2%). Cells the model does not time, or whose work either side
  did not count as now, are not gated on it.
- Status: ok -> anything else is a regression; anything else -> ok is an improvement. With `status_only`, that
  is all that is gated (every stack of the `coverage` matrix predicted under new releases: does each still run?);
  peaks and step times are shown, with their moves, and not gated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from .views import by_cell, peak_column


@dataclass(frozen=True)
class Gate:
    mem_rel: float = 0.02
    mem_abs_gib: float = 0.25
    tps_z: float = 3.0
    tps_floor: float = 0.03
    step_rel: float = 0.02
    status_only: bool = False  # gate statuses alone; report the rest


@dataclass(frozen=True)
class PeakDiff:
    """One gated peak of a cell on both sides."""
    column: str  # e.g. peak_reserved_gib
    base_gib: float | None
    cand_gib: float | None


@dataclass(frozen=True)
class CellDiff:
    cell_id: str
    base_status: str
    cand_status: str
    peaks: tuple[PeakDiff, ...]  # one per gated memory column, in gated_peak_columns' order
    base_tokens_per_s: float | None
    cand_tokens_per_s: float | None
    tps_band: float | None  # relative drop allowed for this cell
    base_step_ms: float | None  # predictions: the step time predicted from the counted work, at today's rates
    cand_step_ms: float | None
    verdict: str  # regression | improvement | same | missing
    why: str


def resolve(ref: str, results_dir: Path) -> Path:
    """A parquet path, or a run id found under results_dir/*/runs/ (measured) or */predicted/."""
    path = Path(ref)
    if path.suffix == ".parquet":
        if not path.exists():
            raise FileNotFoundError(f"no such parquet file: {path}")
        return path
    found = sorted([*results_dir.glob(f"*/runs/{ref}.parquet"), *results_dir.glob(f"*/predicted/{ref}.parquet")])
    if not found:
        raise FileNotFoundError(f"run {ref!r}: no {results_dir}/*/runs/{ref}.parquet nor */predicted/{ref}.parquet")
    return found[0]


def gated_peak_columns(base: pd.DataFrame) -> tuple[str, ...]:
    """The memory columns the gate judges: the table's peak (reserved on a GPU, host RSS on a CPU),
    and for predictions peak reserved too wherever the baseline predicted it (fake-run/3 on)."""
    first = peak_column(base)
    if "prediction_method" in base.columns and "peak_reserved_gib" in base and base["peak_reserved_gib"].notna().any():
        return (first, "peak_reserved_gib")
    return (first,)


def compare(base: pd.DataFrame, cand: pd.DataFrame, gate: Gate = Gate()) -> list[CellDiff]:
    columns = gated_peak_columns(base)
    cand_by_id = {r["cell_id"]: r for r in by_cell(cand).to_dict("records")}
    return [_diff(b, cand_by_id.get(b["cell_id"]), columns, gate) for b in by_cell(base).to_dict("records")]


def _diff(b: dict[str, Any], c: dict[str, Any] | None, columns: tuple[str, ...], gate: Gate) -> CellDiff:
    peaks = tuple(PeakDiff(col, _val(b, col), None if c is None else _val(c, col)) for col in columns)
    if c is None:
        return CellDiff(b["cell_id"], b["status"], "", peaks, _val(b, "tokens_per_s"), None, None,
                        predicted_step_ms(b), None, "missing", "not in the candidate run")
    diff = CellDiff(b["cell_id"], b["status"], c["status"], peaks, _val(b, "tokens_per_s"), _val(c, "tokens_per_s"),
                    _tps_band(b, c, gate), predicted_step_ms(b), predicted_step_ms(c), "same", "")
    if b["status"] == "ok" and c["status"] != "ok":
        return _with(diff, "regression", f"was ok, now {c['status']}{_phase(c)}")
    if b["status"] != "ok" and c["status"] == "ok":
        return _with(diff, "improvement", f"was {b['status']}, now ok")
    if b["status"] != "ok":
        return diff
    reasons = [r for peak in diff.peaks for r in _memory_reasons(peak, len(diff.peaks) > 1, gate)]
    reasons += _speed_reasons(diff) + _step_time_reasons(diff, gate)
    if gate.status_only:  # the moves beyond the gate's bands, said, not judged
        return _with(diff, "same", "; ".join(f"not gated: {why}" for _, why in reasons))
    bad = [why for kind, why in reasons if kind == "regression"]
    good = [why for kind, why in reasons if kind == "improvement"]
    if bad:
        return _with(diff, "regression", "; ".join(bad))
    return _with(diff, "improvement", "; ".join(good)) if good else diff


def _memory_reasons(p: PeakDiff, named: bool, gate: Gate) -> list[tuple[str, str]]:
    if p.base_gib is None or p.cand_gib is None:
        return []
    delta = p.cand_gib - p.base_gib
    allowed = max(gate.mem_rel * p.base_gib, gate.mem_abs_gib)
    what = _name(p.column) if named else "peak"
    text = f"{what} {delta:+.2f} GiB ({delta / p.base_gib:+.1%}; allowed ±{allowed:.2f})"
    if delta > allowed:
        return [("regression", text)]
    return [("improvement", text)] if -delta > allowed else []


def _speed_reasons(d: CellDiff) -> list[tuple[str, str]]:
    if not d.base_tokens_per_s or not d.cand_tokens_per_s or d.tps_band is None:
        return []
    change = d.cand_tokens_per_s / d.base_tokens_per_s - 1
    text = f"tokens/s {change:+.1%} (noise band ±{d.tps_band:.1%})"
    if change < -d.tps_band:
        return [("regression", text)]
    return [("improvement", text)] if change > d.tps_band else []


def predicted_step_ms(row: dict[str, Any]) -> float | None:
    """A prediction row's step time at today's rates for its GPU kind (None: a measured row, a stack or kind the
    model does not time, work not counted as now)."""
    from .predict import steptime
    from .stacks import parse_stack

    if _val(row, "prediction_method") is None or row.get("status") != "ok":
        return None
    return steptime.predicted_ms(row, str(row.get("gpu_kind", "")), parse_stack(str(row["stack"])),
                                 int(_val(row, "gpus") or 1))


def _step_time_reasons(d: CellDiff, gate: Gate) -> list[tuple[str, str]]:
    if d.base_step_ms is None or d.cand_step_ms is None:
        return []
    change = d.cand_step_ms / d.base_step_ms - 1
    text = f"predicted step time {change:+.1%} (allowed +{gate.step_rel:.0%})"
    if change > gate.step_rel:
        return [("regression", text)]
    return [("improvement", text)] if -change > gate.step_rel else []


def _tps_band(b: dict[str, Any], c: dict[str, Any], gate: Gate) -> float | None:
    """Relative standard error of each side's tokens/s, from its repeats when it has them (the
    run-to-run spread), else from its step-time spread within one run."""
    errors = []
    for r in (b, c):
        if (_val(r, "repeats") or 0) > 1 and _val(r, "tokens_per_s_cv") is not None:
            cv, n = r["tokens_per_s_cv"], r["repeats"]
        else:
            cv, n = _val(r, "step_time_cv"), _val(r, "measure_steps")
        if cv is None or not n:
            return None
        errors.append(cv / math.sqrt(n))
    return max(gate.tps_floor, gate.tps_z * math.hypot(*errors))


def _with(d: CellDiff, verdict: str, why: str) -> CellDiff:
    return CellDiff(**{**d.__dict__, "verdict": verdict, "why": why})


def _val(row: dict[str, Any], col: str) -> Any:
    v = row.get(col)
    return None if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA else v


def _phase(row: dict[str, Any]) -> str:
    return f" ({row['oom_phase']})" if _val(row, "oom_phase") else ""


def markdown(diffs: list[CellDiff], base: pd.DataFrame, cand: pd.DataFrame, gate: Gate) -> str:
    """A report readable in a pull request: verdict, what changed between the runs, then per cell."""
    counts = {v: sum(d.verdict == v for d in diffs) for v in ("regression", "improvement", "same", "missing")}
    verdict = "FAIL" if counts["regression"] else "PASS"
    predicted = "prediction_method" in base.columns
    kind = " (predictions: no GPU ran)" if predicted else ""
    speed = (f"predicted step time +{gate.step_rel:.0%} (the counted work at today's rates, both sides)" if predicted
             else f"tokens/s -max({gate.tps_floor:.0%}, {gate.tps_z:g}σ of the step-time spread)")
    gated = (f"{_gated(diffs)} +max({gate.mem_rel:.0%}, {gate.mem_abs_gib} GiB); {speed}" if not gate.status_only else
             "status alone (ok, then anything else); moves beyond "
             f"+-max({gate.mem_rel:.0%}, {gate.mem_abs_gib} GiB) of a peak and {speed} are shown, not gated")
    lines = [f"# Regression check{kind}: {verdict}", "",
             f"{counts['regression']} regressed, {counts['improvement']} improved, {counts['same']} unchanged, "
             f"{counts['missing']} missing of {len(diffs)} baseline cells. Gate: {gated}.",
             "", *_versions(base, cand), "", *_table([d for d in diffs if not _skipped_on_both(d)], predicted),
             *_skipped_lines([d for d in diffs if _skipped_on_both(d)], base)]
    return "\n".join(lines) + "\n"


def _skipped_on_both(d: CellDiff) -> bool:
    return d.base_status == d.cand_status == "skipped"


def _skipped_lines(skipped: list[CellDiff], base: pd.DataFrame) -> list[str]:
    """Cells the plan skipped on both sides, counted under the table by the baseline's reason rather than listed:
    neither side ran them, so there is nothing to compare (the coverage matrix's one-GPU stacks at 2 ranks)."""
    if not skipped:
        return []
    ids = {d.cell_id for d in skipped}
    rows = by_cell(base)
    reasons = rows[rows["cell_id"].isin(ids)].get("skip_reason", pd.Series(dtype=object)).fillna("no reason recorded")
    counts = reasons.value_counts() if len(reasons) else pd.Series({"no reason recorded": len(ids)})
    return ["", f"Not listed: {len(ids)} cells skipped on both sides (nothing ran to compare), by reason:",
            *(f"- {n}: {why}" for why, n in counts.items())]


def _gated(diffs: list[CellDiff]) -> str:
    columns = [p.column for p in diffs[0].peaks] if diffs else []
    return "peak" if len(columns) <= 1 else "peak " + " and ".join(_name(col) for col in columns) + " each"


def _table(diffs: list[CellDiff], predicted: bool) -> list[str]:
    columns = [p.column for p in diffs[0].peaks] if diffs else []
    peaks = ["peak GiB"] if len(columns) == 1 else [f"{_name(col)} GiB" for col in columns]
    lines = [f"| cell | verdict | status | {' | '.join(peaks)} | {'step ms (predicted)' if predicted else 'tokens/s'} "
             "| why |",
             "|" + "---|" * (5 + len(peaks))]
    order = {"regression": 0, "improvement": 1, "missing": 2, "same": 3}
    for d in sorted(diffs, key=lambda d: (order[d.verdict], d.cell_id)):
        status = d.base_status if d.base_status == d.cand_status else f"{d.base_status} → {d.cand_status or '—'}"
        cells = [_pair(p.base_gib, p.cand_gib, ".2f") for p in d.peaks]
        speed = _pair(d.base_step_ms, d.cand_step_ms, ".1f") if predicted else \
            _pair(d.base_tokens_per_s, d.cand_tokens_per_s, ".0f")
        lines.append(f"| `{d.cell_id}` | {d.verdict} | {status} | {' | '.join(cells)} | {speed} | {d.why} |")
    return lines


def _name(column: str) -> str:
    """peak_reserved_gib -> reserved"""
    return column.removeprefix("peak_").removesuffix("_gib")


def _versions(base: pd.DataFrame, cand: pd.DataFrame) -> list[str]:
    cols = ["run_id", "gpu_name", "gpu_kind", "prediction_method",
            "torch_version", "transformers_version", "peft_version", "deepspeed_version",
            "liger_kernel_version", "bitsandbytes_version", "git_sha"]
    rows = ["| | baseline | candidate |", "|---|---|---|"]
    for col in cols:
        b, c = _first(base, col), _first(cand, col)
        if b or c:
            rows.append(f"| {col} | {b}{' **≠**' if b != c else ''} | {c} |")
    return rows


def _first(frame: pd.DataFrame, col: str) -> str:
    values = frame[col].dropna().unique() if col in frame else []
    return ", ".join(map(str, values[:2])) if len(values) else ""


def _pair(b: float | None, c: float | None, fmt: str) -> str:
    if b is None and c is None:
        return ""
    return f"{'—' if b is None else format(b, fmt)} → {'—' if c is None else format(c, fmt)}"
