"""The published predictions whose step time the model can no longer read, and the runs that predict them again.

    python tools/repredict_stale.py RUN_SUFFIX [--results results] [--run]

When what the fake run counts of a step changes (bench/predict/runner.py METHOD; steptime.WORK_COUNTED_SINCE), a
prediction made before it keeps its memory figures but loses its step time: the rates are fitted to the new counts,
and an older row's work is not read. The results page (bench/site/data.py) then shows such a cell without a
tokens/s. This lists the predictions the page shows (each cell's primary record per GPU kind) whose stack the model
times on that kind but whose row's work it cannot read, by matrix and GPU kind, as the `bench predict` commands that
predict them again into `<matrix>-predicted-<kind>-RUN_SUFFIX` (e.g. torch211-20261201, the releases and the day);
`--run` runs them, one after the other, under this interpreter (the releases the GPUs ran, for predictions the page
prefers). Exit 0 when none is stale, 1 when some are (after `--run`: when some still are), 2 on bad input.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from bench.predict import steptime  # noqa: E402
from bench.site import data  # noqa: E402
from bench.stacks import Stack  # noqa: E402


def stale(results_dir: Path) -> dict[tuple[str, str], list[str]]:
    """(matrix, GPU kind) -> the cell ids of the shown predictions whose timed stack's work is not read."""
    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for cell in data.collect(results_dir).cells:
        row = cell["row"]
        kind = str(row.get("gpu_kind", ""))
        if not cell["primary"] or cell["source"] != "predicted" or cell["status"] != "ok" or kind not in steptime.RATES:
            continue
        stack = Stack.from_row(row.get("stack_json"))
        gpus = int(row.get("gpus", 1))
        if steptime.unsupported_reason(stack, gpus, steptime.RATES[kind]) is None and steptime.cell_work(row, stack) is None:
            found[(str(cell["matrix"]), kind)].add(cell["cell_id"])
    return {key: sorted(ids) for key, ids in sorted(found.items())}


def commands(found: dict[tuple[str, str], list[str]], run_suffix: str, results_dir: Path) -> list[list[str]]:
    return [[sys.executable, "-m", "bench", "--results-dir", str(results_dir), "predict", matrix, "--gpu", kind,
             "--run-id", f"{matrix}-predicted-{kind}-{run_suffix}", "--only", ",".join(ids)]
            for (matrix, kind), ids in found.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_suffix", help="the new runs' ids end so: <matrix>-predicted-<kind>-RUN_SUFFIX")
    parser.add_argument("--results", type=Path, default=REPO / "results")
    parser.add_argument("--run", action="store_true", help="run the commands, one after the other")
    args = parser.parse_args()
    if not args.results.is_dir():
        print(f"repredict_stale: no results folder at {args.results}", file=sys.stderr)
        return 2
    found = stale(args.results)
    for (matrix, kind), ids in found.items():
        print(f"{matrix} on {kind}: {len(ids)} shown predictions without a step time the model reads")
    for command in commands(found, args.run_suffix, args.results):
        print(shlex.join(command), flush=True)
        if args.run:
            subprocess.run(command, cwd=REPO, check=False)
    return 1 if found and (not args.run or stale(args.results)) else 0


if __name__ == "__main__":
    sys.exit(main())
