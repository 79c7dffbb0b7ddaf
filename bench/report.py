"""Parquet -> markdown leaderboard. Generated, never edited by hand.

Per model, sequence length and GPU count, one row per stack: peak memory and tokens/s for each
batch size, the largest batch that ran, and the change against the baseline at the largest batch
both ran.
OOM and skipped cells stay visible in the grid and are listed with their reasons below it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .plots import write_plots
from .predict.report import beside_measured, predictions
from .results import STATUSES, read_parquet
from .spec import MatrixSpec
from .stacks import BASELINE
from .views import PEAK_DEFINITIONS, by_cell, code_cell, gib, in_cell, pct, peak_column, rate, stable_peak_column


@dataclass(frozen=True)
class Plan:
    """What the matrix plans, so a board can say how much of it the run covers."""

    cells: int
    stacks: tuple[str, ...]

    @classmethod
    def of(cls, matrix: MatrixSpec) -> Plan:
        per_stack = len(matrix.models) * len(matrix.gpus) * len(matrix.seq_lens) * len(matrix.batch_sizes)
        return cls(per_stack * len(matrix.stacks), tuple(s.label for s in matrix.stacks))


def leaderboard(frame: pd.DataFrame, command: str, ladder: tuple[str, ...] = (), plots: tuple[str, ...] = (),
                predicted: pd.DataFrame | None = None, plan: Plan | None = None) -> str:
    """The board of a run; `predicted` (bench predict's rows of these cells; a cell's under several releases:
    the measured run's are shown) adds, per model and sequence length, the predicted peak allocated beside the
    measured one; `plan` states coverage."""
    runs = frame
    frame = by_cell(frame).sort_values(["model", "seq_len", "stack", "batch_size"])
    mem_col = peak_column(frame)
    mem_def = PEAK_DEFINITIONS[mem_col]
    first = frame.iloc[0]
    lines = [f"# Leaderboard: `{first['matrix']}`", "", *_caption(frame, command, len(runs)), *_coverage(frame, plan), "",
             f"Each cell: **peak GiB · tokens/s**. Peak = {mem_def}. Tokens/s = tokens in the "
             f"{first['measure_steps']} measured steps / their summed step time, after "
             f"{first['warmup_steps']} warm-up steps. GiB = 2^30 bytes. `OOM (phase)`: out of GPU memory; "
             "`skip`: not run (reasons below); empty: not part of this run. `(NVML x)`: the device-level peak, "
             f"shown where it exceeds the allocator's by more than {UNSEEN_BY_TORCH_GIB:g} GiB (memory torch does not see, "
             "e.g. paged optimizer state). *vs baseline*: change against the baseline stack at the "
             "largest batch size both ran; *within noise (±x)*: the tokens/s change is inside 3 standard errors of "
             "the two cells' mean step times. `(CV x)`: the cell's step times spread by x (stdev / mean), shown from "
             f"{NOISY_CV:.0%}. `(useful x)`: non-padding tokens/s, shown where padding makes it "
             "differ. Several GPUs: batch and peak are per GPU (peak = max over ranks), tokens/s is all GPUs "
             "together.", ""]
    if plots:
        lines += ["Plots: " + " · ".join(f"[{Path(p).stem}]({p})" for p in plots), ""]
    for (model, seq, gpus), group in frame.groupby(["model", "seq_len", "gpus"], sort=True):
        ranks = f"{gpus} GPUs" if group["device"].iloc[0] == "cuda" else f"{gpus} ranks (CPU processes, gloo)"
        title = f"## {model} · seq {seq}" + (f" · {ranks}" if gpus > 1 else "")
        lines += [title, "", *_grid(group, mem_col), "", *_ladder(group, ladder, mem_col)]
        if predicted is not None:
            lines += beside_measured(group[(group["status"] == "ok") & (group["device"] == "cuda")], predicted)
    lines += _repeatability(frame)
    lines += _checkpoints(frame, mem_col)
    lines += _time_spent(runs)
    lines += _not_ok(runs.sort_values(["model", "seq_len", "stack", "batch_size"], kind="stable"))
    return "\n".join(lines).rstrip() + "\n"


def _caption(frame: pd.DataFrame, command: str, n_runs: int) -> list[str]:
    r = frame.iloc[0]
    if r["device"] == "cuda":
        machine = f"{r['gpu_name']} ({gib(r['gpu_memory_gib'])} GiB) ×{r['gpu_count']}, driver {r['driver']}, CUDA {r['cuda']}"
    else:
        machine = f"CPU only: {r['cpu_name']}"
    libs = ", ".join(f"{name} {'/'.join(_distinct(frame[f'{name}_version']))}" for name in (
        "torch", "transformers", "peft", "deepspeed", "liger_kernel", "bitsandbytes") if frame[f"{name}_version"].notna().any())
    dirty = " (uncommitted changes)" if (frame["git_dirty"] == True).any() else ""  # noqa: E712 (nullable)
    shas = sorted({str(s)[:7] for s in frame["git_sha"].dropna()}) or ["unknown"]
    sha = "`, `".join(shas)  # a resumed run can span commits; each row keeps its own
    counts = frame["status"].value_counts()
    status = ", ".join(f"{counts[s]} {s}" for s in STATUSES if s in counts)
    return [
        f"- Machine: {machine}",
        f"- Libraries: {libs}; Python {r['python']}",
        f"- Run `{r['run_id']}`, suite commit{'s' if len(shas) > 1 else ''} `{sha}`{dirty}, started {frame['started_at'].min()}",
        f"- Cells: {len(frame)} ({status})" + (f"; {n_runs} runs with repeats" if n_runs > len(frame) else ""),
        f"- Reproduce: `{command}",
    ]


def _coverage(frame: pd.DataFrame, plan: Plan | None) -> list[str]:
    if plan is None:
        return []
    missing = [s for s in plan.stacks if s not in set(frame["stack"])]
    lines = [f"- Coverage: {frame['cell_id'].nunique()} of the {plan.cells} cells the matrix plans"]
    if missing:
        lines.append(f"- Stacks not measured yet: {', '.join(f'`{s}`' for s in missing)}")
    return lines


def _grid(group: pd.DataFrame, mem_col: str) -> list[str]:
    batches = sorted(group["batch_size"].unique())
    stacks = sorted(group["stack"].unique(), key=lambda s: (s != BASELINE, s))
    head = ["stack", *(f"b={b}" for b in batches), "largest batch", "vs baseline"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = group[group["stack"] == BASELINE]
    for stack in stacks:
        sub = group[group["stack"] == stack].set_index("batch_size")
        cells = [_cell(sub.loc[b], mem_col) if b in sub.index else "" for b in batches]
        ok = sub[sub["status"] == "ok"]
        largest = str(max(ok.index)) if len(ok) else "none"
        rows.append("| " + " | ".join([code_cell(stack), *cells, largest, _vs_baseline(ok, base, mem_col, stack)]) + " |")
    return rows


NOISY_CV = 0.10  # step times spread this much (stdev / mean) or more: the cell shows its CV

# Above this, device memory held outside torch's allocator matters (CUDA context is ~0.5-1 GiB):
# e.g. bitsandbytes' paged optimizer state in CUDA managed memory. The cell then shows NVML's peak too.
UNSEEN_BY_TORCH_GIB = 2.0


def _ladder(group: pd.DataFrame, rungs: tuple[str, ...], mem_col: str) -> list[str]:
    """Cumulative ladder: each rung adds techniques to the one before, at the largest batch where
    every rung ran; the change is against the previous rung, so each step's cost is one glance."""
    ok = group[(group["status"] == "ok") & group["stack"].isin(rungs)]
    batches = [b for b, g in ok.groupby("batch_size") if set(rungs) <= set(g["stack"])]
    if len(rungs) < 2 or not batches:
        return []
    b = max(batches)
    at = ok[ok["batch_size"] == b].set_index("stack")
    lines = [f"Cumulative ladder at batch {b}:", "", "| rung | stack | peak GiB | tokens/s | vs previous rung |",
             "|---|---|---|---|---|"]
    for i, stack in enumerate(rungs):
        row, change = at.loc[stack], ""
        if i:
            prev = at.loc[rungs[i - 1]]
            change = (f"mem {pct(row[mem_col] / prev[mem_col] - 1)}, "
                      f"tok/s {pct(row['tokens_per_s'] / prev['tokens_per_s'] - 1)}")
        lines.append(f"| {i} | {code_cell(stack)} | {gib(row[mem_col])} | {rate(row['tokens_per_s'])} | {change} |")
    return [*lines, ""]


def _cell(row: pd.Series, mem_col: str) -> str:
    if row["status"] == "ok":
        nvml = row.get("nvml_peak_gib")
        unseen = mem_col == "peak_reserved_gib" and pd.notna(nvml) and nvml - row[mem_col] > UNSEEN_BY_TORCH_GIB
        device = f" (NVML {gib(nvml)})" if unseen else ""
        useful = row.get("useful_tokens_per_s")
        padded = f" (useful {rate(useful)})" if pd.notna(useful) and useful < 0.999 * row["tokens_per_s"] else ""
        cv = row.get("step_time_cv")
        noisy = f" (CV {cv:.0%})" if pd.notna(cv) and cv >= NOISY_CV else ""
        return f"{gib(row[mem_col])} GiB{device} · {rate(row['tokens_per_s'])}{noisy}{padded}"
    if row["status"] == "oom":
        return f"OOM ({row['oom_phase']})"
    if row["status"] == "skipped":
        return "skip (pruned)" if str(row["skip_reason"]).startswith("pruned") else "skip"
    return row["status"]


def _vs_baseline(ok: pd.DataFrame, base: pd.DataFrame, mem_col: str, stack: str) -> str:
    if stack == BASELINE:
        return ""
    base_ok = base[base["status"] == "ok"].set_index("batch_size")
    shared = sorted(set(ok.index) & set(base_ok.index))
    if not shared:
        return "n/a"
    b = shared[-1]
    mem = ok.loc[b, mem_col] / base_ok.loc[b, mem_col] - 1
    rate = ok.loc[b, "tokens_per_s"] / base_ok.loc[b, "tokens_per_s"] - 1
    band = _noise_band(ok.loc[b], base_ok.loc[b])
    speed = f"tok/s within noise (±{band:.0%})" if abs(rate) <= band else f"tok/s {pct(rate)}"
    return f"mem {pct(mem)}, {speed} (b={b})"


def _noise_band(a: pd.Series, b: pd.Series) -> float:
    """3 standard errors of the difference of two cells' mean step times (each CV / sqrt(steps)):
    a tokens/s change inside it is not a finding."""
    errors = [r["step_time_cv"] / r["measure_steps"] ** 0.5 for r in (a, b) if pd.notna(r.get("step_time_cv"))]
    return 3 * sum(e * e for e in errors) ** 0.5


def _distinct(values: pd.Series) -> list[str]:
    return sorted({str(v) for v in values.dropna()})


def _checkpoints(frame: pd.DataFrame, mem_col: str) -> list[str]:
    """Cells that measured a checkpoint save after their last step."""
    saved = frame[(frame["checkpoint"].fillna("none") != "none") & (frame["status"] == "ok")]
    if saved.empty:
        return []
    save_col = "checkpoint_peak_reserved_gib" if mem_col == "peak_reserved_gib" else None
    lines = ["## Checkpoint save", "",
             "Saved after the last step (`model`: the exported weights, adapters only for LoRA; `full`: model + "
             "optimizer state). On the GPU the save's own peak is shown beside training's; on the CPU only the "
             "process's overall RSS peak exists.", "",
             "| cell | saved | training peak GiB | save peak GiB | save s | on disk GiB |", "|---|---|---|---|---|---|"]
    for _, r in saved.iterrows():
        save_peak = gib(r[save_col]) if save_col and pd.notna(r[save_col]) else ""
        lines.append(f"| `{r['cell_id']}` | {r['checkpoint']} | {gib(r[mem_col])} | {save_peak} | "
                     f"{r['checkpoint_s']:.2f} | {r['checkpoint_disk_gib']:.4f} |")
    return [*lines, ""]


def _repeatability(frame: pd.DataFrame) -> list[str]:
    """Cells run more than once: how far apart their repeats landed."""
    rep = frame[frame["repeats"] > 1]
    if rep.empty:
        return []
    peak_col = stable_peak_column(rep)
    lines = ["## Repeatability", "",
             f"Cells run several times, each in a fresh process. Spread of `{peak_col}` = (max − min) / min; "
             "tokens/s CV = stdev / mean across repeats.", "",
             f"| cell | repeats | {peak_col} (max) | spread | tokens/s (median) | CV |", "|---|---|---|---|---|---|"]
    for _, r in rep.iterrows():
        lines.append(f"| `{r['cell_id']}` | {r['repeats']} | {gib(r[peak_col])} | "
                     f"{r['peak_spread']:.2%} | {rate(r['tokens_per_s'])} | {r['tokens_per_s_cv']:.2%} |")
    return [*lines, ""]


def _time_spent(runs: pd.DataFrame) -> list[str]:
    """Where the run's wall time went, summed over the cells that ran (every repeat, OOMs included):
    the measured steps are the product, the rest is the harness's cost per cell."""
    ran = runs[runs["wall_s"].notna() & runs["build_s"].notna()]
    if ran.empty:
        return []
    wall, measured = float(ran["wall_s"].sum()), float(ran["measured_s"].fillna(0).sum())
    stages = {"process start and imports (waited for)": ran["imports_wait_s"],
              "build (model, stack, engine, batches)": ran["build_s"], "first step": ran["first_step_s"],
              "other warm-up steps": ran["warmup_s"], "measured steps": ran["measured_s"],
              "checkpoint save": ran["checkpoint_s"], "teardown (result written to exit)": ran["teardown_s"]}
    spent = {name: float(col.fillna(0).sum()) for name, col in stages.items()}
    spent["other (memory readings, OOM unwinding, the runner)"] = wall - sum(spent.values())
    ratio = f"{wall / measured:.2f}" if measured else "n/a"
    lines = ["## Where the time went", "",
             f"{len(ran)} cells ran in {wall / 60:.1f} min of wall time ({wall / len(ran):.1f} s per cell); "
             f"wall / measured = {ratio}.", "", "| stage | total s | share of wall |", "|---|---|---|"]
    lines += [f"| {name} | {seconds:.1f} | {seconds / wall:.0%} |" for name, seconds in spent.items()]
    return [*lines, "", *_warmup_convergence(ran), *_contexts_before_cells(ran)]


def _warmup_convergence(ran: pd.DataFrame) -> list[str]:
    """Whether the warm-up steps were enough, from each step's trace (`ms`, from schema 9 on): how long the last
    warm-up step took against the measured median, and the step after which reserved memory stopped growing."""
    if "step_trace_json" not in ran:
        return []
    speeds, settled = [], []
    for _, r in ran[ran["step_trace_json"].notna()].iterrows():
        trace = json.loads(r["step_trace_json"])
        warm = [t for t in trace if t["stage"] != "measure"]
        if len(warm) > 1 and warm[-1].get("ms") and r.get("step_ms_p50"):
            speeds.append(warm[-1]["ms"] / r["step_ms_p50"])
        reserved = [t.get("reserved_gib") for t in trace]
        if None not in reserved:  # steps (1-based) after which the allocator held more than before
            settled.append(max((i + 1 for i in range(1, len(reserved)) if reserved[i] > reserved[i - 1]), default=1))
    lines = []
    if speeds:
        lines.append(f"Warm-up: the last warm-up step took {statistics.median(speeds):.2f}× the measured median step "
                     f"(median over {len(speeds)} cells; {min(speeds):.2f}-{max(speeds):.2f}).")
    if settled:
        lines.append(f"Reserved memory grew for the last time in step {max(settled)} at the latest (of "
                     f"{len(settled)} cells; median step {statistics.median(settled):g}).")
    return [*lines, ""] if lines else []


def _contexts_before_cells(ran: pd.DataFrame) -> list[str]:
    """Workers started ahead must not hold a CUDA context while they wait: it would be in the running cell's
    NVML figures (bench/worker.py). Said where one did, naming the cells whose worker held one."""
    held = ran[ran["context_before_cell"].fillna(False).astype(bool)] if "context_before_cell" in ran else ran[:0]
    if held.empty:
        return []
    return [f"**{len(held)} worker(s) held a CUDA context before their cell** (`context_before_cell`): the NVML "
            f"figures of the cells run while they waited include it. Cells: "
            + ", ".join(f"`{c}`" for c in held["cell_id"]), ""]


def _not_ok(frame: pd.DataFrame) -> list[str]:
    bad = frame[frame["status"] != "ok"]
    if bad.empty:
        return []
    lines = ["## Cells that did not run to the end", "", "| cell | status | where / why |", "|---|---|---|"]
    for _, r in bad.iterrows():
        why = r["oom_phase"] if r["status"] == "oom" else r["skip_reason"] if r["status"] == "skipped" else r["error"]
        first_line = str(why).strip().splitlines()[-1] if pd.notna(why) and str(why).strip() else ""
        lines.append(f"| `{r['cell_id']}` | {r['status']} | {in_cell(first_line)} |")
    return [*lines, ""]


def published_runs(matrix_dir: Path) -> set[Path] | None:
    """The run tables the project publishes: those git tracks. None outside a git work tree (then
    every run there counts). Publishing a run is committing its parquet."""
    import subprocess

    try:
        found = subprocess.run(["git", "ls-files", "--", "runs/*.parquet"], cwd=matrix_dir, capture_output=True,
                               text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {matrix_dir / name for name in found}


def headline_run(matrix_dir: Path) -> Path:
    """The run a matrix's LEADERBOARD.md shows: the published run with the most cells, the newest
    among equals (a small side run, e.g. repeats of three cells, gets its own runs/<run_id>.md
    instead). A user's own, unpublished run never replaces it: it gets its own board."""
    runs = sorted((matrix_dir / "runs").glob("*.parquet"))
    if not runs:
        raise FileNotFoundError(f"no runs under {matrix_dir / 'runs'}: run `python -m bench run {matrix_dir.name}` first")
    published = published_runs(matrix_dir) if (matrix_dir / "runs").is_dir() else None
    if published:
        runs = [r for r in runs if r in published] or runs

    def size_then_time(path: Path) -> tuple[int, str]:
        frame = pd.read_parquet(path, columns=["cell_id", "started_at"])
        return frame["cell_id"].nunique(), str(frame["started_at"].max())

    return max(runs, key=size_then_time)


def publish(parquet: Path, ladder: tuple[str, ...] = (), plan: Plan | None = None) -> tuple[Path, Path]:
    """Writes the run's own board (runs/<run_id>.md) and regenerates the matrix's LEADERBOARD.md
    (with plots/) from its headline run. Returns (run board, leaderboard)."""
    run_board = parquet.with_suffix(".md")
    matrix_dir = parquet.parent.parent
    predicted = predictions(matrix_dir.parent, matrix_dir.name, every_software=True)  # beside measured: pairs picks
    run_frame = read_parquet(parquet)
    run_board.write_text(leaderboard(run_frame, reproduce_command(run_frame, plan), ladder, predicted=predicted, plan=plan))
    headline = headline_run(matrix_dir)
    frame = read_parquet(headline)
    newest = predicted.drop_duplicates("cell_id", keep="last")  # the plots: one prediction per cell
    plots = write_plots(frame, matrix_dir / "plots", newest)
    board = matrix_dir / "LEADERBOARD.md"
    board.write_text(leaderboard(frame, reproduce_command(frame, plan), ladder,
                                 tuple(str(p.relative_to(matrix_dir)) for p in plots), predicted, plan))
    return run_board, board


def reproduce_command(frame: pd.DataFrame, plan: Plan | None = None) -> str:
    """`make bench` for the matrix, and the command of exactly this run: with its repeats, and with
    its cells named when it covered a few of the plan's (a side run, e.g. repeats of three cells)."""
    matrix, run_id = frame["matrix"].iloc[0], frame["run_id"].iloc[0]
    extra = ""
    repeats = int(frame["repeat"].fillna(0).max()) + 1
    if repeats > 1:
        extra += f" --repeats {repeats}"
    ids = sorted(set(frame["cell_id"]))
    if plan is not None and len(ids) < plan.cells and len(ids) <= 10:
        extra += f" --only '{','.join(ids)}'"
    return f"make bench MATRIX={matrix}` (this run: `python -m bench run {matrix} --run-id {run_id}{extra}`)"
