"""Predictions against measurements: results/PREDICTION.md, and the pairs the leaderboards show.

A pair is one GPU cell that was measured (a published run's `ok` row, repeats folded: the max) and
predicted: the newest `ok` prediction of the same cell id made with the measured run's software (torch
and transformers releases), else the newest made with any. The fake run is the training step itself,
so it follows the software it runs on: a prediction made under other releases than the GPU's is a
prediction of other software. The error is predicted − measured peak allocated, in GiB and as a
fraction of measured. Generated, never edited by hand.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from .. import results, segments
from ..stacks import parse_stack
from ..views import by_cell, code_cell
from . import steptime_report
from .gpus import GPUS

GPU_NAMES = {key: kind.name for key, kind in GPUS.items()}  # --gpu's key -> the name NVML gives measured rows

# Measured rows whose figure the suite's own code, as it then was, moved, in a way since fixed: compared as
# they are (a figure is never dropped) and said beside the errors. (run id, cell id) -> why.
MEASURED_UNDER_OLD_CODE = {
    ("llama3b-h200-20261127", "llama-3.2-3b_s2048_b2_compile+gc+liger_c362f9c8"):
        "measured (git 83e6f30) under the compile technique's evidence hook as it was, which made Python objects of "
        "saved tensors' storages: autograd then summed the tied lm_head's saved gradient (Liger's) out of place, "
        "0.66 GiB more at the peak than the step makes (bench/techniques/compile.py; tests/test_techniques.py shows "
        "it on a CPU). Predicted as the step runs now; the GPU backlog measures it again (its compile-liger step).",
}


def predictions(results_dir: Path, matrix: str | None = None, every_software: bool = False,
                prefer: str | None = None, gpu_kind: str | None = None) -> pd.DataFrame:
    """Every predicted row under results_dir (of one matrix, if given), the newest per cell id: `newest`."""
    return newest(every_prediction(results_dir, matrix), every_software, prefer, gpu_kind)


def newest(frame: pd.DataFrame, every_software: bool = False, prefer: str | None = None,
           gpu_kind: str | None = None) -> pd.DataFrame:
    """Of predicted rows, oldest first (`every_prediction`; made for one GPU kind, if given), the newest per
    cell id (with `prefer`, a software label: the newest made under it where the cell has one); with
    every_software, the newest per cell id, software (see `software`) and GPU kind, for `pairs` to choose from."""
    if gpu_kind is not None:  # a row that names no kind is not known to be another card's: kept
        frame = frame[(frame["gpu_kind"] == gpu_kind).fillna(True).astype(bool)]
    if prefer is not None:  # the preferred software's rows last, so the newest of them is kept
        frame = frame.iloc[(software(frame) == prefer).to_numpy().argsort(kind="stable")]
    keys = frame.assign(software=software(frame))[["cell_id", "software", "gpu_kind"] if every_software else ["cell_id"]]
    return frame[~keys.duplicated(keep="last")].reset_index(drop=True)


def every_prediction(results_dir: Path, matrix: str | None = None,
                     cell_ids: Collection[str] | None = None) -> pd.DataFrame:
    """Every predicted row under results_dir (of one matrix, if given; of these cells, if given: converting
    thousands of rows to the schema takes seconds, a few dozen none), the old ones too, oldest first."""
    pattern = f"{matrix}/predicted/*.parquet" if matrix else "*/predicted/*.parquet"
    paths = sorted(results_dir.glob(pattern))
    if cell_ids is not None:
        paths = [p for p in paths if results.holds_cells(p, cell_ids)]
    frames = [results.read_parquet(p, results.PREDICTED, cell_ids) for p in paths]
    if not frames:
        return results.to_frame([], results.PREDICTED)
    return pd.concat(frames, ignore_index=True).sort_values("started_at", kind="stable").reset_index(drop=True)


# the libraries whose release changes what a training step holds, as a row records them: the label a prediction is
# grouped by (By software) and matched to its measurement with (peft too: its LoRA layers are the step's code)
SOFTWARE = ("torch", "transformers", "peft")


def software_label(row: Mapping[str, Any], suffix: str = "") -> str:
    """The releases a row ran under, as one label: 'torch 2.11.0, transformers 5.17.0, peft 0.21.0' (columns
    `<library>_version<suffix>`; a build's local tag, +cpu or +cu130, dropped: the same release runs the same Python
    code on either; '?' where the row does not record one)."""
    def text(v: object) -> str:
        return "?" if v is None or pd.isna(v) else str(v).split("+")[0]  # type: ignore[arg-type]

    return ", ".join(f"{library} {text(row.get(f'{library}_version{suffix}'))}" for library in SOFTWARE)


def software(frame: pd.DataFrame, suffix: str = "") -> pd.Series:
    """Each row's `software_label` (its SOFTWARE versions' columns, with the suffix)."""
    columns = [c for c in (f"{library}_version{suffix}" for library in SOFTWARE) if c in frame.columns]
    labels = [software_label(row, suffix) for row in frame[columns].to_dict("records")]
    return pd.Series(labels, index=frame.index, dtype=object)


def measured_software(measured: pd.DataFrame) -> str | None:
    """The releases the measured GPU cells (`measured_gpu_cells`) ran under, the most common: where a cell has
    a prediction made under them, that one is shown, so its figure and the measurement come from the same code."""
    return str(software(measured).mode().iloc[0]) if len(measured) else None


def measured_gpu_cells(results_dir: Path, matrix: str | None = None) -> pd.DataFrame:
    """Every published GPU cell that ran to the end, one row per cell and GPU kind: repeats on one kind
    folded; a cell measured on an H100 and on an H200 is two measurements, each its own row. Added:
    `first_run_at`, when the cell first ran on that kind (any run, any status: from then on its figure,
    or that it ran out of memory, was known)."""
    runs = _gpu_rows(results_dir, matrix)
    if runs.empty:
        return results.to_frame([]).assign(first_run_at=pd.Series(dtype="datetime64[ns, UTC]"))
    kind = runs["gpu_name"].fillna("?")  # a row that did not record its GPU: one kind of its own
    run_ids = runs.groupby([runs["cell_id"], kind])["run_id"].agg(lambda ids: ", ".join(sorted(set(ids))))
    first_run_at = pd.to_datetime(runs["started_at"], utc=True).groupby([runs["cell_id"], kind]).min()
    frame = pd.concat([by_cell(rows) for _, rows in runs.groupby(kind, sort=True)], ignore_index=True)
    frame = frame[frame["status"] == "ok"].drop_duplicates(["cell_id", "gpu_name"], keep="last")
    keys = list(zip(frame["cell_id"], frame["gpu_name"].fillna("?"), strict=True))
    return frame.assign(run_id=[run_ids[key] for key in keys], first_run_at=[first_run_at[key] for key in keys])


def _gpu_rows(results_dir: Path, matrix: str | None = None) -> pd.DataFrame:
    """Every published row a GPU ran (of one matrix, if given), whatever its status."""
    pattern = f"{matrix}/runs/*.parquet" if matrix else "*/runs/*.parquet"
    frames = [results.read_parquet(p) for p in sorted(results_dir.glob(pattern))]
    runs = pd.concat(frames, ignore_index=True) if frames else results.to_frame([])
    return runs[runs["device"] == "cuda"]


def first_runs(results_dir: Path, matrix: str | None = None) -> pd.Series:
    """When each cell first ran on a GPU, any kind (cell id -> UTC time)."""
    runs = _gpu_rows(results_dir, matrix)
    return pd.to_datetime(runs["started_at"], utc=True).groupby(runs["cell_id"]).min()


def pairs(measured: pd.DataFrame, predicted: pd.DataFrame, *, any_software: bool = False,
          made_before_run: bool = False) -> pd.DataFrame:
    """Measured cells with an `ok` prediction: both peaks and the error. Where a measurement has several
    predictions, the newest made for its GPU kind with the measured run's software, else for another kind
    where the card's size shaped neither (`_size_free`), else the newest; with any_software, one pair for
    each software's. With made_before_run, only predictions made before the cell first ran on that GPU
    kind (`first_run_at`, see measured_gpu_cells) are chosen from."""
    ok = predicted[predicted["status"] == "ok"]
    both = measured.merge(ok, on="cell_id", suffixes=("", "_predicted"))
    if made_before_run:
        both = both[pd.to_datetime(both["started_at_predicted"], utc=True) < both["first_run_at"]]
    both["same_gpu"] = both["gpu_kind"].map(GPU_NAMES) == both["gpu_name"]
    both = both[both["same_gpu"].fillna(False).astype(bool) | _size_free(both)]
    both["same_software"] = software(both) == software(both, "_predicted")
    both["software_predicted"] = software(both, "_predicted")
    both = both.sort_values(["same_software", "same_gpu", "started_at_predicted"], kind="stable")
    both = both.drop_duplicates(["cell_id", "gpu_name", *(["software_predicted"] if any_software else [])], keep="last")
    both["error_gib"] = both["peak_allocated_gib_predicted"] - both["peak_allocated_gib"]
    both["error_frac"] = both["error_gib"] / both["peak_allocated_gib"]
    both["reserved_error_frac"] = (both["peak_reserved_gib_predicted"] - both["peak_reserved_gib"]) / both["peak_reserved_gib"]
    return both.sort_values(["model", "seq_len", "stack", "batch_size", "gpu_name"]).reset_index(drop=True)


def _size_free(both: pd.DataFrame) -> pd.Series:
    """Whether a prediction made for another GPU kind holds for the measured card: neither freed its cache
    to retry an allocation, and the predicted reserved fits the measured card (`stands_in`). A measured
    row older than the retries column counts as calm."""
    calm = _number(both, "alloc_retries").fillna(0) == 0
    return calm & stands_in(both, _number(both, "gpu_memory_gib"), suffix="_predicted")


def stands_in(predicted: pd.DataFrame, card_gib: pd.Series | float, suffix: str = "") -> pd.Series:
    """Whether predictions made for one GPU kind hold for a card of card_gib (NaN: a size unknown, not
    tested): the predicted allocator never freed its cache to retry an allocation, and its peak reserved
    fits the card. Else the card's size shaped the figures: an allocator near its card's end frees cached
    blocks and reserves less (ZeRO-2 on Llama-3.2-3B: 77.9 GiB predicted under an H100's 79.6 with one
    retry, 89.8 measured on an H200). A prediction older than the retries column counts as calm."""
    card = card_gib if isinstance(card_gib, pd.Series) else pd.Series(card_gib, index=predicted.index, dtype=float)
    calm = _number(predicted, f"alloc_retries{suffix}").fillna(0) == 0
    return calm & (card.isna() | (_number(predicted, f"peak_reserved_gib{suffix}") < card))


def _number(frame: pd.DataFrame, column: str) -> pd.Series:
    """A column as floats; an absent figure or column (an older table's): NaN."""
    if column not in frame:
        return pd.Series(float("nan"), index=frame.index)
    return pd.to_numeric(frame[column], errors="coerce").astype(float)


def checked(results_dir: Path) -> pd.DataFrame:
    """Every published GPU cell beside its prediction (`pairs`), chosen from every software's."""
    return pairs(measured_gpu_cells(results_dir), predictions(results_dir, every_software=True))


def markdown(measured: pd.DataFrame, predicted: pd.DataFrame, every: pd.DataFrame | None = None) -> str:
    """PREDICTION.md; `predicted` may hold several predictions of a cell, one per software; `every`, every
    prediction ever published (`every_prediction`), for what was predicted before the GPU ran a cell."""
    both = pairs(measured, predicted)
    known = predicted.drop_duplicates("cell_id", keep="last").set_index("cell_id")  # each cell's newest word
    unsupported = measured[measured["cell_id"].map(lambda c: c in known.index and known.loc[c, "status"] == "unsupported")]
    missing = measured[~measured["cell_id"].isin(known.index)]
    lines = ["# Predicted vs measured peak memory", "",
             "Every published GPU cell (measured, `ok`) beside `bench predict`'s prediction of the same cell id: the "
             "training step run on fake tensors on a CPU, live storage bytes rounded to 512 B as the caching allocator "
             "rounds them, plus the cuBLAS workspaces of the GPU kind. Peak allocated = bytes held by live tensors. "
             "Peak reserved = what the caching allocator holds (cached blocks and fragmentation included): the fake "
             "run's allocations and frees replayed through a model of the allocator (bench/predict/allocator.py). "
             "Error = predicted − measured. Generated by `python -m bench predict`; never edited by hand.", ""]
    lines += _sources(both)
    lines += _summary(both, len(unsupported), len(missing))
    lines += _under_old_code(both)
    lines += _by_software(measured, predicted)
    lines += _made_before_run(measured, every, both) if every is not None else []
    lines += _by_method(both, predicted, every if every is not None else predicted)
    lines += _evidence(both)
    if len(both):
        lines += ["| cell | GPU | stack | seq | batch | allocated GiB: measured | predicted | error | "
                  "reserved GiB: measured | predicted | error | peak (measured / predicted) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for _, r in both.iterrows():
            lines.append(f"| `{r['cell_id']}` | {r['gpu_name']} | {code_cell(r['stack'])} | {r['seq_len']} | {r['batch_size']} | "
                         f"{r['peak_allocated_gib']:.3f} | {r['peak_allocated_gib_predicted']:.3f} | {r['error_frac']:+.2%} | "
                         f"{_num(r['peak_reserved_gib'])} | {_num(r['peak_reserved_gib_predicted'])} | "
                         f"{_signed(r['reserved_error_frac'])} | "
                         f"{r['peak_phase']} / {r['peak_phase_predicted']} ({r['peak_op']}) |")
        lines.append("")
    before = pairs(measured, every, made_before_run=True) if every is not None else both.iloc[0:0]
    lines += steptime_report.section(both, before)
    if len(unsupported):
        lines += ["## Measured cells the fake run does not cover yet", "", "| cell | why |", "|---|---|"]
        for _, r in unsupported.iterrows():
            lines.append(f"| `{r['cell_id']}` | {known.loc[r['cell_id'], 'unsupported_reason']} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _sources(both: pd.DataFrame) -> list[str]:
    if both.empty:
        return []

    def distinct(col: str) -> str:
        return ", ".join(sorted({part for v in both[col].dropna() for part in str(v).split(", ")}))

    commits = ", ".join(sorted({str(s)[:7] for s in both["git_sha_predicted"].dropna()}))
    return [f"- Measured: {distinct('gpu_name')}; torch {distinct('torch_version')}, transformers "
            f"{distinct('transformers_version')}, peft {distinct('peft_version')}; runs {distinct('run_id')}",
            f"- Predicted: for {distinct('gpu_kind')} on {distinct('cpu_name_predicted')}; torch "
            f"{distinct('torch_version_predicted')}, transformers {distinct('transformers_version_predicted')}, peft "
            f"{distinct('peft_version_predicted')}; method {distinct('prediction_method')}; runs "
            f"{distinct('run_id_predicted')}, suite commit(s) {commits}",
            ""]


def _summary(both: pd.DataFrame, n_unsupported: int, n_missing: int) -> list[str]:
    kinds = "" if both["cell_id"].is_unique else (f" ({both['cell_id'].nunique()} cell ids: a cell measured on "
                                                    "several GPU kinds is compared once for each)")
    lines = [f"**{len(both)} cells compared**{kinds}; {n_unsupported} measured cells have a stack the fake run does "
             f"not cover yet (listed below); {n_missing} were not predicted."]
    if len(both):
        seconds = both["predict_s"].dropna()
        lines += ["", "| peak | cells | median abs error | max abs error | cells over 1% | cells over 3% |",
                  "|---|---|---|---|---|---|"]
        for name, column in (("allocated", "error_frac"), ("reserved", "reserved_error_frac")):
            err = both[column].dropna().abs()
            if len(err):
                lines.append(f"| {name} | {len(err)} | {err.median():.3%} | {err.max():.3%} | {(err > 0.01).sum()} | "
                             f"{(err > 0.03).sum()} |")
        lines += ["", f"Mean allocated error {both['error_gib'].mean():+.4f} GiB; seconds per cell (median / max): "
                      f"{seconds.median():.1f} / {seconds.max():.1f}.", "", _segments(both)]
    return [*lines, ""]


def _under_old_code(both: pd.DataFrame) -> list[str]:
    """The compared cells measured under code since fixed (MEASURED_UNDER_OLD_CODE), with their errors."""
    noted = both[[(run, cell) in MEASURED_UNDER_OLD_CODE for run, cell in zip(both["run_id"], both["cell_id"], strict=True)]]
    if noted.empty:
        return []
    lines = ["Measured under the suite's code as it was, since fixed where it moved the figure (counted in the "
             "errors above):", "", "| cell | run | allocated error | reserved error | why |", "|---|---|---|---|---|"]
    for _, r in noted.iterrows():
        lines.append(f"| `{r['cell_id']}` | {r['run_id']} | {r['error_frac']:+.2%} | {_signed(r['reserved_error_frac'])} | "
                     f"{MEASURED_UNDER_OLD_CODE[(r['run_id'], r['cell_id'])]} |")
    return [*lines, ""]


# Evidence a technique reports that the fake run predicts (a prediction's evidence_json, schema 12 on): compared
# with the GPU's where both have it. torch.compile's: the graphs dynamo compiled and what the partitioner saved.
EVIDENCE_COMPARED = ("compile_graphs", "saved_for_backward_gib")


def _evidence(both: pd.DataFrame) -> list[str]:
    """The techniques' evidence beside the GPU's (EVIDENCE_COMPARED), for the pairs where both rows have it."""
    if "evidence_json_predicted" not in both:
        return []
    rows = []
    for _, r in both.iterrows():
        measured, predicted = (json.loads(v) if isinstance(v, str) and v else {}
                               for v in (r.get("evidence_json"), r.get("evidence_json_predicted")))
        for key in EVIDENCE_COMPARED:
            if key in measured and key in predicted:
                rows.append(f"| `{r['cell_id']}` | {r['gpu_name']} | {key} | {measured[key]:.6g} | {predicted[key]:.6g} |")
    if not rows:
        return []
    return ["A technique's own evidence (its `evidence_json`), predicted beside measured where both have it:", "",
            "| cell | GPU | evidence | measured | predicted |", "|---|---|---|---|---|", *rows, ""]


def _segments(both: pd.DataFrame) -> str:
    """Segment by segment: how much of reserved memory sits in segments both sides hold (bench/segments.py)."""
    have = both[both["segments_json"].notna() & both["segments_json_predicted"].notna()]
    if have.empty:
        return ("Segment by segment (`segments_json`: the allocator's segments once the steps have run, bench/segments.py): "
                "no measured cell records its segments yet; cells measured from now on do.")
    shares = pd.Series([segments.matched_share(m, p) for m, p in
                        zip(have["segments_json"], have["segments_json_predicted"], strict=True)])
    return (f"Segment by segment (`segments_json`, bench/segments.py): in {len(have)} cells, the share of reserved bytes "
            f"in segments both the GPU and the prediction hold (same pool, same size): median {shares.median():.1%}, "
            f"lowest {shares.min():.1%}.")


# How a prediction was made, as PREDICTION.md groups them: (label, rows of that kind)
METHODS = (
    ("one rank, fake run", lambda f: f["prediction_method"].str.startswith("fake-run") & (f["gpus"] == 1)),
    ("several ranks, fake process group (FSDP2, DDP)",
     lambda f: f["prediction_method"].str.startswith("fake-run") & (f["gpus"] > 1)),
    ("ZeRO, hybrid (DeepSpeed's accounting + fake run)", lambda f: f["prediction_method"].str.startswith("hybrid")),
)


@dataclass(frozen=True)
class Record:
    """How the predictions made as one cell's was have fared on the published GPU cells: the way they are
    made (`kind`: the method, with or without offload) and each such cell's peak reserved error, predicted
    - measured over measured; and the errors of that kind's predictions made before a GPU ran their cells
    (by the methods of the time: a new cell's prediction is one too). Offload sets a kind apart: with it,
    host-device copies and the frees that wait on them are where the hybrid's peak reserved misses most
    (PREDICTION.md). `models`, `gpus` and `techniques`: the models, rank counts and techniques of the cells
    behind `reserved_errors` (a record is of them: a cell of another architecture runs ops none of them ran, one
    on more ranks other collectives and buffers, one with another technique that technique's own ops)."""

    kind: str
    reserved_errors: tuple[float, ...]
    reserved_errors_before_run: tuple[float, ...] = ()
    models: tuple[str, ...] = ()
    gpus: tuple[int, ...] = ()
    techniques: tuple[str, ...] = ()


def record(results_dir: Path, method: str, gpus: int, offload: bool) -> Record:
    """The record of predictions made by `method` on `gpus` ranks, with or without `offload`."""
    one = pd.DataFrame({"prediction_method": [method], "gpus": [gpus]})
    label, of = next(((label, of) for label, of in METHODS if of(one).iloc[0]), (method, None))
    kind = f"{label}, {'with' if offload else 'without'} offload"
    if of is None:
        return Record(kind, ())
    now, before = _measured_pairs(results_dir, _tables_state(results_dir))

    def alike(both: pd.DataFrame) -> pd.DataFrame:
        """The pairs predicted as this one is, with a reserved error."""
        if both.empty:
            return both
        same = both[of(both) & (both["host_peak_gib"].notna() == offload)]
        return same[same["reserved_error_frac"].notna()]

    checked, checked_before = alike(now), alike(before)
    techniques = {name for label in set(checked.get("stack", ())) for name in parse_stack(label).names}
    return Record(kind, tuple(map(float, checked.get("reserved_error_frac", ()))),
                  tuple(map(float, checked_before.get("reserved_error_frac", ()))),
                  tuple(sorted(set(checked.get("model", ())))), tuple(sorted({int(g) for g in checked.get("gpus", ())})),
                  tuple(sorted(techniques)))


@functools.lru_cache(maxsize=4)
def _measured_pairs(results_dir: Path, tables_state: tuple[tuple[str, int, int], ...]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each measured GPU cell beside its newest predictions, and beside those made before it ran: what every
    `record` filters. Read once per state of the published tables (`_tables_state`): `bench ask` with several
    stacks asks for a record per stack, and reading every table takes seconds. The frames are shared: not
    changed by their readers."""
    measured = measured_gpu_cells(results_dir)
    every = every_prediction(results_dir, cell_ids=set(measured["cell_id"]))  # pairs need no other cell's
    return pairs(measured, newest(every, every_software=True)), pairs(measured, every, made_before_run=True)


def _tables_state(results_dir: Path) -> tuple[tuple[str, int, int], ...]:
    """Every published table under results_dir, with its size and modification time: a table written, added or
    removed changes it."""
    paths = sorted(results_dir.glob("*/runs/*.parquet")) + sorted(results_dir.glob("*/predicted/*.parquet"))
    return tuple((str(p), st.st_size, st.st_mtime_ns) for p in paths for st in (p.stat(),))


def _by_method(both: pd.DataFrame, predicted: pd.DataFrame, every: pd.DataFrame) -> list[str]:
    """Per way of predicting: cells predicted, cells measured to check them, and the errors; and host RAM
    (from `every` prediction, oldest first: see `_host_judged`)."""
    ok = predicted[predicted["status"] == "ok"].drop_duplicates("cell_id", keep="last")
    lines = ["### By method", "", "| method | cells predicted | measured GPU cells to check them | allocated: median / "
             "max abs error | reserved: median / max abs error |", "|---|---|---|---|---|"]
    for label, of in METHODS:
        mine = both[of(both)] if len(both) else both
        lines.append(f"| {label} | {int(of(ok).sum()) if len(ok) else 0} | {len(mine)} | "
                     f"{_median_max(mine.get('error_frac'))} | {_median_max(mine.get('reserved_error_frac'))} |")
    lines += ["", "The fake process group is checked on a CPU against two real gloo ranks running the same steps under "
              "the same counter: equal, phase for phase, on every rank, and with FSDP2's CPU offload on the host too "
              "(tests/test_predict.py). The ZeRO hybrid is checked on a CPU against DeepSpeed's own engine on one and "
              "two gloo ranks under the same counter: peak allocated, with and without offload, and peak reserved, its "
              "trace against DeepSpeed's own allocations replayed through the same model of the allocator "
              "(tools/hybrid_check.py; its figures in bench/predict/hybrid.py). A method gets its GPU errors here as its "
              "cells are measured (the GPU backlog); `bench ask` gives each answer the record of the cells predicted "
              "as it is, with or without offload."]
    host = _host_judged(every)
    measured_host = both[both["host_peak_gib"].notna()] if "host_peak_gib" in both else both.iloc[0:0]
    lines += ["", f"Host RAM (`host_peak_gib`, offload stacks): {len(host)} cells predicted, {len(measured_host)} "
              "measured on a GPU host to check them"
              + (f" (median / max abs error {_median_max((measured_host['host_peak_gib'] - measured_host['host_rss_peak_gib']) / measured_host['host_rss_peak_gib'])})"  # noqa: E501
                 if len(measured_host) else "; the field case (Llama-3.1-8B, ZeRO-2 + Adam offload) is tested to "
                 "say `host_oom` on a 128 GiB host") + ".", ""]
    lines += _saves(both, ok)
    if len(host):
        lines += ["| cell | host GiB (predicted) | during its save | fits the host |", "|---|---|---|---|"]
        lines += [f"| `{r['cell_id']}` | {r['host_peak_gib']:.1f} | {_one_decimal(r.get('checkpoint_host_peak_gib'))} | "
                  f"{_host_verdict(r.get('host_fits'), r.get('host_memory_gib'))} |"
                  for _, r in host.sort_values("cell_id").iterrows()]
        lines.append("")
    return lines


def _by_software(measured: pd.DataFrame, predicted: pd.DataFrame) -> list[str]:
    """The measured cells predicted under several software releases: each release's errors beside those of
    the measured run's releases on the cells both predicted (the fake run runs the step itself, so it follows
    the code it runs on). Pairs, not one set of cells for all: a release that predicted only a few cells
    must not shrink every other comparison to those few."""
    every = pairs(measured, predicted, any_software=True)
    every = every.assign(measurement=every["cell_id"] + " on " + every["gpu_name"].fillna("?"))  # per GPU kind
    releases = every.groupby("software_predicted")["measurement"].agg(set)
    if len(releases) < 2:
        return []
    measured_under = software(every).mode().iloc[0]
    reference = measured_under if measured_under in releases.index else max(releases.index, key=lambda r: len(releases[r]))
    lines = ["### By software", "",
             f"The measured cells (measured under {', '.join(sorted(set(software(every))))}) predicted under each "
             f"other release: its errors, and in brackets those of the predictions under {reference} of the same "
             f"cells ({_methods(every, reference, releases[reference])}). The tables above use the prediction made with "
             "the measured run's releases where there is one. A release's predictions made by an older method differ "
             "by the method as well as by the release: the last column names them.",
             "", "| predicted under | cells | allocated: median / max abs error | reserved: median / max abs error | "
             "reserved over 1% | over 3% | methods |", "|---|---|---|---|---|---|---|"]
    for other in sorted(set(releases.index) - {reference}):
        shared = releases[other] & releases[reference]
        this, then = (_release_errors(every, label, shared) for label in (other, reference))
        lines.append(f"| {other} | {len(shared)} | " + " | ".join(f"{a} ({b})" for a, b in zip(this, then, strict=True))
                     + f" | {_methods(every, other, shared)} |")
    return [*lines, ""]


def _methods(every: pd.DataFrame, release: str, measurements: set[str]) -> str:
    """The prediction methods of a release's predictions of those measurements, e.g. 'fake-run/9, hybrid/16'."""
    group = every[(every["software_predicted"] == release) & every["measurement"].isin(measurements)]
    return ", ".join(sorted(group["prediction_method"].dropna().astype(str).unique()))


def _release_errors(every: pd.DataFrame, release: str, measurements: set[str]) -> list[str]:
    """A release's predictions of those measurements: see `_errors`."""
    return _errors(every[(every["software_predicted"] == release) & every["measurement"].isin(measurements)])


def _errors(group: pd.DataFrame) -> list[str]:
    """Pairs' allocated and reserved median / max abs error, and how many cells' reserved errs by more
    than 1% and by more than 3%."""
    reserved = group["reserved_error_frac"].dropna().abs()
    return [_median_max(group["error_frac"]), _median_max(group["reserved_error_frac"]), str((reserved > 0.01).sum()),
            str((reserved > 0.03).sum())]


def _made_before_run(measured: pd.DataFrame, every: pd.DataFrame, now: pd.DataFrame) -> list[str]:
    """What the predictor said before the GPU ran a cell: each measured cell's newest prediction made
    before the cell first ran on that GPU kind (chosen as `pairs` chooses), its errors beside those of the
    prediction the tables above use. Those are made by methods that have seen the measurements; these could
    not have been fitted to them."""
    before = pairs(measured, every, made_before_run=True)
    lines = ["### Predicted before the GPU ran it", "",
             "Each measured cell that had a prediction (`started_at`) before it first ran on that GPU kind: the newest "
             "such prediction, and its errors — what the predictor said without having seen the figure. The tables "
             "above use each cell's newest prediction, by methods made since with these measurements in view: their "
             "errors are in brackets, on the same cells.", ""]
    if before.empty:
        return [*lines, "No measured cell had a prediction before it ran yet.", ""]
    keys = ["cell_id", "gpu_name"]
    now = before[keys].merge(now, on=keys, how="left")
    methods = ", ".join(sorted(before["prediction_method"].dropna().astype(str).unique()))
    lines += [f"{len(before)} of the {len(measured)} measurements had one; the others ran before any prediction of "
              "them.", "",
              "| cells | allocated: median / max abs error | reserved: median / max abs error | reserved over 1% | "
              "over 3% | methods |", "|---|---|---|---|---|---|",
              f"| {len(before)} | " + " | ".join(f"{a} ({b})" for a, b in zip(_errors(before), _errors(now), strict=True))
              + f" | {methods} |", "",
              "| cell | GPU | first ran | predicted | method, under | allocated error | reserved error (now) |",
              "|---|---|---|---|---|---|---|"]
    reserved_now = now.set_index(keys)["reserved_error_frac"]
    for _, r in before.sort_values("first_run_at", kind="stable").iterrows():
        lines.append(f"| `{r['cell_id']}` | {r['gpu_name']} | {r['first_run_at']:%Y-%m-%d %H:%M} | "
                     f"{str(r['started_at_predicted'])[:16].replace('T', ' ')} | {r['prediction_method']}, "
                     f"{r['software_predicted']} | {r['error_frac']:+.2%} | {_signed(r['reserved_error_frac'])} "
                     f"({_signed(reserved_now.get((r['cell_id'], r['gpu_name'])))}) |")
    return [*lines, ""]


def _saves(both: pd.DataFrame, ok: pd.DataFrame) -> list[str]:
    """Checkpoint saves: cells predicted, cells measured to check them, and the errors of the save's peak
    reserved and of host RAM (measured: the worker's RSS peak during the save, where the save set it)."""
    predicted = ok[ok["checkpoint_host_peak_gib"].notna()] if "checkpoint_host_peak_gib" in ok else ok.iloc[0:0]
    column = "checkpoint_peak_reserved_gib_predicted"
    measured = both[both[column].notna() & both["checkpoint_peak_reserved_gib"].notna()] if column in both \
        else both.iloc[0:0]
    line = (f"Checkpoint saves (`checkpoint_*` columns, bench/predict/save.py): {len(predicted)} cells predicted, "
            f"{len(measured)} measured on a GPU to check them")
    if len(measured):
        reserved = (measured[column] - measured["checkpoint_peak_reserved_gib"]) / measured["checkpoint_peak_reserved_gib"]
        rss = measured["checkpoint_host_rss_peak_gib"]  # where the save set the process's peak
        host = (measured["checkpoint_host_peak_gib"] - rss) / rss
        line += f" (save peak reserved, median / max abs error {_median_max(reserved)}; host RAM {_median_max(host)})"
    else:
        line += "; what each save copies is checked against real saves on a CPU (tests/test_predict.py)"
    return [line + ".", ""]


def _host_judged(every: pd.DataFrame) -> pd.DataFrame:
    """Of predictions oldest first, each offload cell's newest of its host RAM, a judged one (run with
    --host-memory-gib) before any other: a later run that did not name the host does not unsay a verdict."""
    host = every[(every["status"] == "ok") & every["host_peak_gib"].notna()]
    judged_last = host.iloc[host["host_fits"].notna().to_numpy().argsort(kind="stable")]  # as `newest`'s prefer
    return judged_last.drop_duplicates("cell_id", keep="last")


def _host_verdict(fits: object, host_memory_gib: object) -> str:
    if fits is None or pd.isna(fits):  # type: ignore[arg-type]
        return "not judged (no --host-memory-gib)"
    return f"yes, of {host_memory_gib:g} GiB" if fits else f"**no: host_oom** on {host_memory_gib:g} GiB"


def _median_max(errors: pd.Series | None) -> str:
    if errors is None:
        return "–"
    errors = errors.dropna().abs()
    return f"{errors.median():.2%} / {errors.max():.2%}" if len(errors) else "no measured cell yet"


def _one_decimal(x: object) -> str:
    return f"{float(x):.1f}" if x is not None and not pd.isna(x) else ""  # type: ignore[arg-type]


def _num(x: object) -> str:
    return f"{float(x):.3f}" if x is not None and not pd.isna(x) else ""  # type: ignore[arg-type]


def _signed(x: object) -> str:
    return f"{float(x):+.2%}" if x is not None and not pd.isna(x) else ""  # type: ignore[arg-type]


def publish(results_dir: Path) -> Path:
    """PREDICTION.md from every published prediction and measurement, and the predicted frontiers' boards again:
    both set step times at today's rates (bench/predict/steptime.py). Returns PREDICTION.md."""
    from ..fitreport import refresh_predicted

    path = results_dir / "PREDICTION.md"
    every = every_prediction(results_dir)
    path.write_text(markdown(measured_gpu_cells(results_dir), newest(every, every_software=True), every))
    refresh_predicted(results_dir)
    return path


def beside_measured(group: pd.DataFrame, predicted: pd.DataFrame) -> list[str]:
    """A leaderboard section: per stack and batch, measured / predicted peak allocated and peak reserved,
    each with its error."""
    both = pairs(group, predicted)
    if both.empty:
        return []
    batches = sorted(both["batch_size"].unique())
    lines = ["Predicted beside measured (`bench predict`; GiB, measured / predicted (error): peak allocated · peak "
             "reserved):", "",
             "| stack | " + " | ".join(f"b={b}" for b in batches) + " |", "|---|" + "---|" * len(batches)]
    for stack, s in both.groupby("stack", sort=True):
        by_batch = s.set_index("batch_size")
        cells = [_beside(by_batch.loc[b]) if b in by_batch.index else "" for b in batches]
        lines.append(f"| {code_cell(stack)} | " + " | ".join(cells) + " |")
    if _under_old_code(both):
        lines += ["", "† measured under the suite's code as it was, since fixed where it moved the figure: "
                      "results/PREDICTION.md says how."]
    return [*lines, ""]


def _beside(r: pd.Series) -> str:
    noted = " †" if (r["run_id"], r["cell_id"]) in MEASURED_UNDER_OLD_CODE else ""
    allocated = f"{r['peak_allocated_gib']:.2f}{noted} / {r['peak_allocated_gib_predicted']:.2f} ({r['error_frac']:+.2%})"
    if pd.isna(r["reserved_error_frac"]):
        return allocated
    return f"{allocated} · {r['peak_reserved_gib']:.2f} / {r['peak_reserved_gib_predicted']:.2f} " \
           f"({r['reserved_error_frac']:+.2%})"
