"""The published predictions whose step time the model can no longer read, and the runs that predict them again.

    python tools/repredict_stale.py RUN_SUFFIX [--results results] [--run] [--jobs N]

When what the fake run counts of a step changes (bench/predict/runner.py METHOD; steptime.WORK_COUNTED_SINCE), a
prediction made before it keeps its memory figures but loses its step time: the rates are fitted to the new counts,
and an older row's work is not read. The results page (bench/site/data.py) then shows such a cell without a
tokens/s. This lists the predictions the page shows (each cell's primary record per GPU kind) whose stack the model
times on that kind but whose row's work it cannot read, by matrix and GPU kind, as the `bench predict` commands that
predict them again into `<matrix>-predicted-<kind>-RUN_SUFFIX` (e.g. torch211-20261201, the releases and the day);
`--run` runs them, one after the other, under this interpreter (the releases the GPUs ran, for predictions the page
prefers).

The predicted fit frontiers (results/MATRIX/fit/FIT-predicted.md) are listed too: a board whose run has a timed
stack's prediction the model cannot read shows those answers without a tokens/s, and its frontier is searched again
(`bench fit MATRIX --predict`, the board's budgets and candidates, into `fit-MATRIX-predicted-KIND-RUN_SUFFIX`, with
`--jobs N` stacks at once; the memory answers come out the same unless the method changed a peak, and the board
then shows the new run). A search that judged host RAM (a `host_oom` answer) needs its `--host-memory-gib` added by
hand: a board does not record it. Exit 0 when nothing is stale, 1 when something is (after `--run`: when
something still is), 2 on bad input.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

import pandas as pd  # noqa: E402

from bench import fitreport, results  # noqa: E402
from bench.predict import steptime  # noqa: E402
from bench.site import data  # noqa: E402
from bench.stacks import Stack, parse_stack  # noqa: E402

SEQ_STEP_DEFAULT = 1024  # bench fit's --seq-step; a board searched before its summary kept `candidates_step` used it


def stale(results_dir: Path) -> dict[tuple[str, str], list[str]]:
    """(matrix, GPU kind) -> the cell ids of the shown predictions whose timed stack's work is not read."""
    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for cell in data.collect(results_dir).cells:
        row = cell["row"]
        kind = str(row.get("gpu_kind", ""))
        if not cell["primary"] or cell["source"] != "predicted" or cell["status"] != "ok" or kind not in steptime.RATES:
            continue
        if untimed(row, Stack.from_row(row.get("stack_json"))):
            found[(str(cell["matrix"]), kind)].add(cell["cell_id"])
    return {key: sorted(ids) for key, ids in sorted(found.items())}


def commands(found: dict[tuple[str, str], list[str]], run_suffix: str, results_dir: Path) -> list[list[str]]:
    return [[sys.executable, "-m", "bench", "--results-dir", str(results_dir), "predict", matrix, "--gpu", kind,
             "--run-id", f"{matrix}-predicted-{kind}-{run_suffix}", "--only", ",".join(ids)]
            for (matrix, kind), ids in found.items()]


def untimed(row: dict, stack: Stack) -> bool:
    """The model times the row's stack on its GPU kind, but cannot read the row's work (counted by an older method);
    not a step the fake run saw run CUDA's grouped-matmul fallback (its evidence), which is never timed."""
    rates = steptime.RATES.get(str(row.get("gpu_kind", "")))
    gpus = int(row.get("gpus") or 1)
    return (rates is not None and steptime.row_unsupported_reason(row, stack, gpus, rates) is None
            and steptime.cell_work(row, stack) is None)


@dataclass(frozen=True)
class StaleBoard:
    """A predicted fit frontier whose shown run has timed predictions without a readable work."""

    board: Path
    matrix: str
    kind: str
    run_id: str
    untimed_cells: int
    search: pd.DataFrame  # the run's summary: one row per search

    def command(self, run_suffix: str, results_dir: Path, jobs: int) -> list[str]:
        """`bench fit --predict` over the board's budgets and candidates."""
        by_axis = self.search.groupby("axis")["candidates_max"].max()
        steps = self.search.get("candidates_step", pd.Series(dtype=float))
        seq_step = steps[self.search["axis"] == "seq"].dropna()
        args = ["--budgets", ",".join(f"{b:g}" for b in sorted(self.search["budget_gib"].unique())),
                "--max-batch", str(int(by_axis.get("batch", 64))), "--max-seq", str(int(by_axis.get("seq", 32768))),
                "--seq-step", str(int(seq_step.iloc[0]) if len(seq_step) else SEQ_STEP_DEFAULT)]
        return [sys.executable, "-m", "bench", "--results-dir", str(results_dir), "fit", self.matrix, "--predict",
                "--gpu", self.kind, *args, "--run-id", f"fit-{self.matrix}-predicted-{self.kind}-{run_suffix}",
                "--jobs", str(jobs)]

    def judged_host_ram(self) -> bool:
        return bool((self.search["smallest_oom_status"] == "host_oom").any())


def stale_boards(results_dir: Path) -> list[StaleBoard]:
    """The predicted fit boards (results/*/fit/FIT-predicted.md) whose shown run has an untimed prediction."""
    found = []
    for board in fitreport.predicted_boards(results_dir):
        predictions = results.read_parquet(board.predictions, results.PREDICTED)
        ok = [row for row in predictions.to_dict("records") if row.get("status") == "ok"]
        untimed_cells = sum(untimed(row, parse_stack(str(row["stack"]))) for row in ok)
        if untimed_cells:
            found.append(StaleBoard(board.path, str(ok[0]["matrix"]), str(ok[0]["gpu_kind"]), board.run_id,
                                    untimed_cells, pd.read_parquet(board.summary)))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_suffix", help="the new runs' ids end so: <matrix>-predicted-<kind>-RUN_SUFFIX")
    parser.add_argument("--results", type=Path, default=REPO / "results")
    parser.add_argument("--run", action="store_true", help="run the commands, one after the other")
    parser.add_argument("--jobs", type=int, default=1, help="bench fit's --jobs: stacks searched at once")
    args = parser.parse_args()
    if not args.results.is_dir() or args.jobs < 1:
        print(f"repredict_stale: no results folder at {args.results}" if args.jobs >= 1 else
              f"repredict_stale: --jobs {args.jobs} is not a count >= 1", file=sys.stderr)
        return 2
    found, boards = stale(args.results), stale_boards(args.results)
    for (matrix, kind), ids in found.items():
        print(f"{matrix} on {kind}: {len(ids)} shown predictions without a step time the model reads")
    for board in boards:
        print(f"{board.board.relative_to(args.results)}: run {board.run_id} has {board.untimed_cells} timed "
              "predictions without a step time the model reads" +
              ("; its search judged host RAM: add --host-memory-gib N" if board.judged_host_ram() else ""))
    todo = commands(found, args.run_suffix, args.results) + [
        board.command(args.run_suffix, args.results, args.jobs) for board in boards]
    for command in todo:
        print(shlex.join(command), flush=True)
        if args.run:
            subprocess.run(command, cwd=REPO, check=False)
    still = bool(stale(args.results) or stale_boards(args.results)) if args.run else bool(todo)
    return 1 if still else 0


if __name__ == "__main__":
    sys.exit(main())
