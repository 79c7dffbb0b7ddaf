"""How long a measured run's cells would have waited for their workers' imports with N workers ahead.

    python tools/prefork_replay.py results/llama3b/runs/llama3b-h200-20261127.parquet --ahead 1 2 3

A replay of the run's own rows, not a measurement: each cell keeps its measured imports (`imports_s`) and
its time after its handover (`wall_s - imports_wait_s`); a worker started `ahead` cells early (right after
the handover of the cell that many places before it, as bench/runner.py's Spares does) is ready at its
start plus its imports, and its cell waits for whatever is left of them. With the ahead the run was made
with, the replay should give back the waits the run measured (it prints them beside it to check).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]


@dataclass(frozen=True)
class Replayed:
    ahead: int
    waits_s: list[float]  # each cell's wait for its worker's imports, in run order
    wall_s: float  # the run's wall time: every cell's wait and time after its handover


def replay(imports_s: list[float], after_handover_s: list[float], ahead: int) -> Replayed:
    """The run's cells in order, each worker started `ahead` cells early (the first cell's at its handover)."""
    started: dict[int, float] = {}
    waits: list[float] = []
    now = 0.0
    for k, (imports, after) in enumerate(zip(imports_s, after_handover_s, strict=True)):
        wait = max(0.0, started.setdefault(k, now) + imports - now)  # handover at `now`
        for j in range(k + 1, min(len(imports_s), k + 1 + ahead)):
            started.setdefault(j, now)  # the next cells' workers start right after this handover
        waits.append(wait)
        now += wait + after
    return Replayed(ahead, waits, now)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run's parquet (results/MATRIX/runs/RUN.parquet)")
    parser.add_argument("--ahead", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    rows = pd.read_parquet(args.run)
    ran = rows[rows["imports_s"].notna() & rows["wall_s"].notna()].sort_values("started_at", kind="stable")
    if ran.empty:
        raise SystemExit(f"{args.run}: no row with imports_s and wall_s (runs before schema 6 lack them)")
    imports, waited = ran["imports_s"].tolist(), ran["imports_wait_s"].fillna(0).tolist()
    after = (ran["wall_s"] - ran["imports_wait_s"].fillna(0)).tolist()
    measured_s = float(ran["measured_s"].fillna(0).sum())
    print(f"{args.run.name}: {len(ran)} cells; measured: waited {sum(waited):.1f} s for imports, wall "
          f"{float(ran['wall_s'].sum()):.1f} s, wall / measured {float(ran['wall_s'].sum()) / measured_s:.2f}")
    print("replayed (not measured): ahead, waits for imports (s, run order), their sum, wall s, wall / measured")
    for ahead in args.ahead:
        r = replay(imports, after, ahead)
        print(f"  {ahead}: [{', '.join(f'{w:.1f}' for w in r.waits_s)}]  {sum(r.waits_s):.1f}  {r.wall_s:.1f}  "
              f"{r.wall_s / measured_s:.2f}")
    print(f"  measured waits: [{', '.join(f'{w:.1f}' for w in waited)}]")


if __name__ == "__main__":
    main()
