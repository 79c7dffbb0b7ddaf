"""Fit frontier -> "fits on my GPU" markdown and a plot. Generated, never edited by hand."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from . import fit, peers, results
from .predict import gpus, steptime
from .stacks import parse_stack
from .views import code_cell, gib, rate


def publish(summary: list[dict], probe_rows: list[dict], out_dir: Path, run_id: str) -> Path:
    """results/MATRIX/fit/: RUN_ID.parquet (one row per search), RUN_ID-probes.parquet (every probe
    cell, the suite's row schema), FIT.md and plots/RUN_ID_max_batch.png. Returns FIT.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(summary)
    frame.to_parquet(out_dir / f"{run_id}.parquet")
    results.write_parquet(probe_rows, out_dir / f"{run_id}-probes.parquet")
    probes = results.to_frame(probe_rows)
    board = out_dir / "FIT.md"
    board.write_text(markdown(frame, probes, predicted_before(out_dir, pd.to_datetime(probes["started_at"], utc=True).min())))
    plot(frame, out_dir / "plots" / f"{run_id}_max_batch.png")
    return board


@dataclass(frozen=True)
class Foretold:
    """A predicted frontier made before a measured one: its run id, when its last fake run started, and
    each search's answer (`_answer`) by search (`_search`)."""

    run_id: str
    made_at: pd.Timestamp
    answers: dict[tuple[str, str, str, int, float], str]


def predicted_before(fit_dir: Path, started: pd.Timestamp) -> Foretold | None:
    """The newest predicted frontier in fit_dir whose fake runs all started before `started` (the
    measured fit's first probe): what `bench fit --predict` said before the GPU searched."""
    found = []
    for cells in fit_dir.glob("*-predictions.parquet"):  # what only a predicted frontier writes beside its searches
        made = pd.to_datetime(pd.read_parquet(cells, columns=["started_at"])["started_at"], utc=True).max()
        searches = cells.with_name(cells.name.removesuffix("-predictions.parquet") + ".parquet")
        if made < started and searches.exists():
            found.append((made, searches))
    if not found:
        return None
    made, searches = max(found)
    return Foretold(searches.stem, made, {_search(r): _answer(r) for _, r in pd.read_parquet(searches).iterrows()})


def _search(r: pd.Series) -> tuple[str, str, str, int, float]:
    """A search's identity, the same in a predicted and a measured frontier (and fit.Hints' key)."""
    at = r["seq_len"] if r["axis"] == "batch" else r["batch_size"]
    return r["model"], r["stack"], r["axis"], int(at), float(r["budget_gib"])


def _answer(r: pd.Series) -> str:
    """A search's answer: the largest size that fits, "none" where none does, or why it has none."""
    if pd.notna(r["largest_ok"]):
        return str(int(r["largest_ok"]))
    status = str(r.get("stopped") or "").split(" at ")[0]  # e.g. "unsupported at 1024": the search could not go on
    return {"": "none", "unsupported": "not predicted"}.get(status, status)


def foretold_lines(summary: pd.DataFrame, foretold: Foretold | None) -> list[str]:
    """The measured searches against the frontier predicted before them: how many the same, smaller (a
    prediction on the safe side) or larger."""
    if foretold is None:
        return ["- Predicted before this run: no predicted frontier of this matrix was made before it "
                "(`bench fit --predict`)."]
    both = [(_size(_answer(r)), _size(foretold.answers.get(_search(r), ""))) for _, r in summary.iterrows()]
    sizes = [(m, p) for m, p in both if m is not None and p is not None]
    same, smaller = sum(m == p for m, p in sizes), sum(p < m for m, p in sizes)
    return [f"- Predicted before this run: `{foretold.run_id}` (its last fake run {foretold.made_at:%Y-%m-%d %H:%M} "
            f"UTC), column *predicted before*: of the {len(sizes)} searches both answered, {same} the same, {smaller} "
            f"smaller (the safe side), {len(sizes) - same - smaller} larger."]


def _size(answer: str) -> int | None:
    """An answer as a size: 0 where none fits; None where there is no answer to compare."""
    return int(answer) if answer.isdigit() else 0 if answer == "none" else None


def markdown(summary: pd.DataFrame, probes: pd.DataFrame, foretold: Foretold | None = None) -> str:
    first = probes.iloc[0]
    where = (f"{first['gpu_name']}, torch {first['torch_version']}" if first["device"] == "cuda"
             else "CPU only: budgets are recorded but not enforced (no allocator to cap)")
    lines = [f"# Fits on my GPU: `{first['matrix']}`", "",
             f"- Run `{first['run_id']}` on {where}; {len(probes)} probe cells, "
             f"{probes['wall_s'].sum() / 60:.1f} min of probe time",
             "- A budget is emulated by capping torch's caching allocator at the budget minus the memory used "
             "outside torch at start (the CUDA context). Not covered: memory allocated outside torch later "
             "(NCCL, bitsandbytes paged optimizer state).",
             "- Headroom = budget − device-level peak (NVML). Each search bisects the candidate sizes; "
             "*probes* counts the sizes it needed, both sides of the boundary are probe rows in the parquet.",
             *foretold_lines(summary, foretold), ""]

    def before(r: pd.Series) -> str:  # the predicted frontier's answer to the same search
        return foretold.answers.get(_search(r), "") if foretold is not None else ""

    batch = summary[summary["axis"] == "batch"]
    for (budget, seq), group in batch.groupby(["budget_gib", "seq_len"], sort=True):
        lines += [f"## {budget:g} GiB · seq {int(seq)}: largest batch", "",
                  "| rank | model | stack | largest batch | predicted before | tokens/s there | device peak GiB | "
                  "headroom GiB | smallest OOM | probes |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        fits = group[group["largest_ok"].notna()].sort_values("tokens_per_s", ascending=False)
        for rank, (_, r) in enumerate(fits.iterrows(), 1):
            lines.append(f"| {rank} | {r['model']} | {code_cell(r['stack'])} | {int(r['largest_ok'])} | {before(r)} | "
                         f"{rate(r['tokens_per_s'])} | {_gib(r['nvml_peak_gib'])} | {_headroom(budget, r['nvml_peak_gib'])} | "
                         f"{_int(r['smallest_oom'])} | {r['probes']} |")
        for _, r in group[group["largest_ok"].isna()].iterrows():
            lines.append(f"| — | {r['model']} | {code_cell(r['stack'])} | does not fit | {before(r)} | | | | "
                         f"{_int(r['smallest_oom'])} | {r['probes']} |" + (f" {r['stopped']}" if r["stopped"] else ""))
        lines.append("")
    seq = summary[summary["axis"] == "seq"]
    if len(seq):
        lines += ["## Longest sequence at batch 1", "",
                  "| budget GiB | model | stack | longest seq | predicted before | smallest OOM seq | tokens/s | probes |",
                  "|---|---|---|---|---|---|---|---|"]
        for _, r in seq.sort_values(["budget_gib", "model", "stack"]).iterrows():
            lines.append(f"| {r['budget_gib']:g} | {r['model']} | {code_cell(r['stack'])} | {_int(r['largest_ok'])} | "
                         f"{before(r)} | {_int(r['smallest_oom'])} | "
                         f"{rate(r['tokens_per_s']) if pd.notna(r['tokens_per_s']) else ''} | {r['probes']} |")
    flagged = not_monotone(summary)
    lines += ["", *flagged] if flagged else []
    lines += beside_published(summary, str(first["matrix"]), "measured")
    return "\n".join(lines) + "\n"


def not_monotone(summary: pd.DataFrame) -> list[str]:
    """The searches where a size was seen not to fit below one that fits: the search assumes what fits at
    a size fits below it, so there its boundary is one of several (the allocator's fragmentation can make
    a larger cell reserve less)."""
    flagged = summary[summary["not_monotone"].fillna("") != ""] if "not_monotone" in summary else summary.iloc[:0]
    if not len(flagged):
        return []
    lines = ["## Not monotone", "",
             "Where a size did not fit below one that did, under the same budget (needs in GiB where predicted): "
             "the search assumes the opposite, so its boundary above is one of several, and a size below the "
             "smallest seen not to fit is the safer choice.", "",
             "| budget GiB | model | stack | search | seen |", "|---|---|---|---|---|"]
    for _, r in flagged.sort_values(["budget_gib", "model", "stack", "axis"]).iterrows():
        search = f"batch at seq {int(r['seq_len'])}" if r["axis"] == "batch" else f"seq at batch {int(r['batch_size'])}"
        lines.append(f"| {r['budget_gib']:g} | {r['model']} | {code_cell(r['stack'])} | {search} | {r['not_monotone']} |")
    return [*lines, ""]


def publish_predicted(summary: list[dict], predictions: list[dict], out_dir: Path, run_id: str, gpu_name: str) -> Path:
    """The predicted frontier: RUN_ID.parquet (one row per search), RUN_ID-predictions.parquet (every
    cell predicted, the predicted schema), FIT-predicted.md and its plot. Returns FIT-predicted.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(summary)
    frame.to_parquet(out_dir / f"{run_id}.parquet")
    results.write_parquet(predictions, out_dir / f"{run_id}-predictions.parquet", results.PREDICTED)
    board = out_dir / "FIT-predicted.md"
    board.write_text(markdown_predicted(frame, results.to_frame(predictions, results.PREDICTED), gpu_name))
    plot(frame, out_dir / "plots" / f"{run_id}_max_batch.png")
    return board


def refresh_predicted(results_dir: Path) -> list[Path]:
    """Every published predicted frontier's board (results/*/fit/FIT-predicted.md) rendered again from the tables of
    the run it shows, nothing searched and the tables untouched: its tokens/s are at the step time rates fitted now
    (`step_ms_now`), so a refit of the rates reaches the boards. Returns the boards rendered."""
    rendered = []
    for board in predicted_boards(results_dir):
        frame = results.read_parquet(board.predictions, results.PREDICTED)
        gpu = gpus.GPUS.get(str(frame["gpu_kind"].iloc[0])) if len(frame) else None
        if gpu is None:
            continue
        board.path.write_text(markdown_predicted(pd.read_parquet(board.summary), frame, gpu.name))
        rendered.append(board.path)
    return rendered


@dataclass(frozen=True)
class PredictedBoard:
    """A published predicted frontier: its board and the tables of the run it shows."""

    path: Path  # results/MATRIX/fit/FIT-predicted.md
    run_id: str
    summary: Path  # RUN_ID.parquet: one row per search
    predictions: Path  # RUN_ID-predictions.parquet: every cell predicted


def predicted_boards(results_dir: Path) -> list[PredictedBoard]:
    """Every predicted frontier's board whose run's tables are there (the run a board shows is named in it)."""
    found = []
    for path in sorted(results_dir.glob("*/fit/FIT-predicted.md")):
        shown = re.search(r"run `([^`]+)`", path.read_text())
        if shown is None:
            continue
        board = PredictedBoard(path, shown[1], *(path.parent / f"{shown[1]}{tail}.parquet" for tail in ("", "-predictions")))
        if board.summary.exists() and board.predictions.exists():
            found.append(board)
    return found


def _context_unmeasured(predictions: pd.DataFrame, gpu_name: str) -> list[str]:
    """A bullet where the GPU kind's CUDA context is not measured (no prediction has a device peak): the
    budgets are then what torch alone may use, not the card."""
    ok = predictions[predictions["status"] == "ok"]
    if len(ok) == 0 or ok["device_peak_gib"].notna().any():
        return []
    return [f"- **{gpu_name}'s CUDA context is not measured**: each cell's need is torch's alone (`least_torch_gib`, "
            "else peak allocated), so a budget here is what torch may use, not the card: the card must also hold its "
            f"context ({gpus.GPUS['h100'].outside_torch_gib:.2f} GiB on an H100)."]


def step_ms_now(predictions: pd.DataFrame) -> dict[tuple[str, str, int, int], float]:
    """Each prediction's step time at its GPU kind's rates fitted now (bench/predict/steptime.py), by (model,
    stack, seq, batch); a prediction the model does not time is absent. Not the `step_ms` a prediction kept,
    at the rates of its day: a board shows the same figure as `bench ask` and the results page."""
    out = {}
    for row in predictions.to_dict("records"):
        ms = steptime.predicted_ms(row, str(row.get("gpu_kind", "")), parse_stack(str(row["stack"])),
                                   int(row.get("gpus") or 1))
        if ms is not None and row.get("status") == "ok":
            out[(str(row["model"]), str(row["stack"]), int(row["seq_len"]), int(row["batch_size"]))] = ms
    return out


def _step_time_bullet(predictions: pd.DataFrame, now: dict[tuple[str, str, int, int], float]) -> list[str]:
    """What *tokens/s there* is, where some prediction has a step time (`now`: step_ms_now's)."""
    if not now:
        return []
    rates = steptime.RATES.get(str(predictions.iloc[0]["gpu_kind"]))
    record = f", fitted on {rates.cells} measured cells: each left out of the fit was predicted {rates.left_out}" \
        if rates else ""
    eight_bit = any(set(parse_stack(stack).names) & steptime.SLOWER_THAN_COUNTED for _, stack, _, _ in now)
    if rates and rates.optimizer_8bit_ps is not None and eight_bit:
        record += (f"; bitsandbytes' 8-bit optimizer step at {rates.optimizer_8bit_ps:.1f} ps a trainable parameter, "
                   f"fitted on {rates.optimizer_8bit_cells} cells: each left out predicted {rates.optimizer_8bit_left_out}")
    return ["- *tokens/s there*: the positions of a step at the answer over its predicted time: the step's ops, "
            "kernels, FLOPs and bytes at the GPU kind's rates fitted now (bench/predict/steptime.py" + record + "); "
            "empty for a stack the model does not time (README, How long a step takes, says which). The step time "
            "each prediction kept when made, at the rates of its day, is its `step_ms`."]


def markdown_predicted(summary: pd.DataFrame, predictions: pd.DataFrame, gpu_name: str) -> str:
    first = predictions.iloc[0]
    methods = ", ".join(sorted(set(predictions["prediction_method"].dropna())))
    now = step_ms_now(predictions)
    lines = [f"# PREDICTED: fits on my GPU, `{first['matrix']}`", "",
             f"- **Predictions, not measurements**: run `{first['run_id']}`, each probe a fake run of the training step "
             f"(`bench predict`, method {methods}) for {gpu_name}, on {first['cpu_name']} with torch "
             f"{first['torch_version']}, transformers {first['transformers_version']}; {len(predictions)} cells predicted "
             f"in {predictions['predict_s'].sum() / 60:.1f} min.",
             "- A cell fits a budget when its step runs within it, as a measured probe meets its budget (the "
             "allocator capped there, releasing its cache and retrying before it fails): the fake run's allocations "
             "replayed through a model of the caching allocator within the budget less what the GPU kind keeps "
             "outside torch (the CUDA context, measured; `fits_budgets_json`); a ZeRO cell's allocations are the "
             "hybrid's (DeepSpeed's, in its order, beside the fake run's own; its method the hybrid/ one above). The "
             "*smallest card* shown is the boundary a bisection over capacities found, searched below the smallest "
             "budget the step runs within: an allocator can run within a budget and not within a larger one (rows "
             "predicted before that search can show a smallest card above a budget they fit). Where a row has no "
             "replay at the budget (an older one), the smallest card decides; where it has no smallest card, the "
             "device peak (reserved with no cap + the context).",
             "- The search: a fake run's need holds for every budget, so each search interpolates where the needs "
             "already predicted cross its budget (bisecting where they do not rise in a line): where the needs rise "
             "with the size, the boundary bisection would find, in fewer fake runs (where they do not: Not monotone).",
             "- *unsupported*: a stack the fake run does not cover yet (its reason below); no guess is made.",
             *_step_time_bullet(predictions, now), *_context_unmeasured(predictions, gpu_name), ""]
    for (budget, seq), group in summary[summary["axis"] == "batch"].groupby(["budget_gib", "seq_len"], sort=True):
        lines += [f"## {budget:g} GiB · seq {int(seq)}: largest batch (predicted)", "",
                  "| model | stack | largest batch | predicted smallest card GiB there | headroom GiB "
                  "| smallest that does not fit | tokens/s there (predicted) |",
                  "|---|---|---|---|---|---|---|"]
        for _, r in group.sort_values(["model", "largest_ok"], ascending=[True, False], na_position="last").iterrows():
            largest = _int(r["largest_ok"]) or ("unsupported" if str(r["stopped"]).startswith("unsupported") else "none")
            needed = fit.predicted_need_gib(r) if pd.notna(r.get("peak_allocated_gib")) else None
            peak = gib(needed) if needed is not None else ""
            lines.append(f"| {r['model']} | {code_cell(r['stack'])} | {largest} | {peak} | {_headroom(budget, needed)} | "
                         f"{_too_big(r)} | {_predicted_rate(r, now)} |")
        lines.append("")
    seq_axis = summary[summary["axis"] == "seq"]
    if len(seq_axis):
        lines += ["## Longest sequence at batch 1 (predicted)", "",
                  "| budget GiB | model | stack | longest seq | smallest seq that does not fit | tokens/s there (predicted) |",
                  "|---|---|---|---|---|---|"]
        for _, r in seq_axis.sort_values(["budget_gib", "model", "stack"]).iterrows():
            lines.append(f"| {r['budget_gib']:g} | {r['model']} | {code_cell(r['stack'])} | {_int(r['largest_ok'])} | "
                         f"{_too_big(r)} | {_predicted_rate(r, now)} |")
        lines.append("")
    lines += not_monotone(summary)
    lines += beside_published(summary, str(first["matrix"]), "predicted")
    unsupported = predictions[predictions["status"] == "unsupported"].drop_duplicates("stack")
    if len(unsupported):
        lines += ["## Not predicted", "", "| stack | why |", "|---|---|"]
        lines += [f"| {code_cell(r['stack'])} | {r['unsupported_reason']} |" for _, r in unsupported.iterrows()]
    return "\n".join(lines).rstrip() + "\n"


def beside_published(summary: pd.DataFrame, matrix: str, kind: str) -> list[str]:
    """Where another project publishes the same frontier (bench/peers.py): their table as they give it,
    with our longest sequence per stack at the budget of the same number of GB, `kind` (measured or
    predicted). Empty for other matrices."""
    published = peers.FRONTIERS.get(matrix)
    seq = summary[summary["axis"] == "seq"] if len(summary) else summary
    if published is None or not len(seq):
        return []
    longest = {(float(r["budget_gib"]), r["stack"]): _longest(r) for _, r in seq.iterrows()}
    stacks = sorted(seq["stack"].unique())
    lines = [f"## Beside {published.source}'s published figures (theirs, quoted; ours {kind})", "",
             f"- Theirs: <{published.url}>, read on {published.read_on}. Setup: {published.setup}. Their memory "
             "column is the card's size in GB as they write it; ours is a budget in GiB of device memory, taken at "
             "the same number (an \"80 GB\" H100 holds 79.2 GiB).",
             f"- Ours: the longest sequence at batch 1 per stack ({kind}), searched in steps of the fit's seq_step; "
             "empty: not searched at that budget, or not covered (the sections above say why).", "",
             "| card GB | " + " | ".join(f"{c} (theirs)" for c in published.columns) + " | "
             + " | ".join(f"`{st}` ({kind})" for st in stacks) + " |",
             "|---" * (1 + len(published.columns) + len(stacks)) + "|"]
    for card_gb, theirs in published.rows:
        quoted = " | ".join(f"{x:,}" if x is not None else "OOM" for x in theirs)
        ours = " | ".join(longest.get((float(card_gb), st), "") for st in stacks)
        lines.append(f"| {card_gb} | {quoted} | {ours} |")
    return [*lines, ""]


def _longest(search: pd.Series) -> str:
    """A seq search's answer as a cell: the longest that fit, OOM (not even the shortest), or why not."""
    answer = _answer(search)
    return f"{int(answer):,}" if answer.isdigit() else {"none": "OOM"}.get(answer, answer)


def plot(summary: pd.DataFrame, path: Path) -> Path | None:
    """Largest batch per stack across budgets, one panel per sequence length."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    batch = summary[summary["axis"] == "batch"]
    seqs = sorted(batch["seq_len"].unique())
    fig, axes = plt.subplots(1, len(seqs), figsize=(5 * len(seqs), 4), squeeze=False)
    for ax, seq in zip(axes[0], seqs, strict=True):
        for stack, s in batch[batch["seq_len"] == seq].groupby("stack"):
            s = s.sort_values("budget_gib")
            ax.plot(s["budget_gib"], s["largest_ok"].fillna(0), marker="o", label=stack)
        ax.set(title=f"seq {int(seq)}", xlabel="memory budget (GiB)", ylabel="largest batch that trains")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _predicted_rate(search: pd.Series, now: dict[tuple[str, str, int, int], float]) -> str:
    """Tokens a second at a search's answer, from its prediction's step time now (`step_ms_now`): empty where
    it has none (no answer, a stack or GPU kind not timed, a row predicted before step times)."""
    if pd.isna(search.get("largest_ok")) or not search.get("largest_ok"):
        return ""
    key = (str(search["model"]), str(search["stack"]), int(search["seq_len"]), int(search["batch_size"]))
    return f"{steptime.tokens_per_s(key[3], key[2], now[key]):,.0f}" if key in now else ""


def _gib(x: float | None) -> str:
    return "" if x is None or pd.isna(x) else f"{x:.1f}"


def _headroom(budget: float, device_peak: float | None) -> str:
    return "" if device_peak is None or pd.isna(device_peak) else f"{budget - device_peak:.1f}"


def _too_big(search: Any) -> str:
    """The smallest size that does not fit, and "(host RAM)" where the host ran out, not the GPU."""
    where = " (host RAM)" if search.get("smallest_oom_status") == "host_oom" else ""
    return _int(search["smallest_oom"]) + where if pd.notna(search["smallest_oom"]) else ""


def _int(x: float | None) -> str:
    return "" if x is None or pd.isna(x) else str(int(x))
