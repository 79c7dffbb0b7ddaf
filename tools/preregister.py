"""The cells a GPU would run next that no published prediction speaks for yet, and the commands that predict them.

    python tools/preregister.py h200 llama3b llama8b staircase [--software "torch 2.11.0, transformers 5.17.0, peft 0.21.0"]

PREDICTION.md's "Predicted before the GPU ran it" can only hold cells predicted before the GPU ran them. So
before a GPU window, every cell it may run should have a prediction that stands for that GPU kind: one made for
that kind, or for another where the card's size shaped nothing (bench/predict/report.py `stands_in`), made
under the releases the GPU runs (`--software`; default: those of the newest published run on that kind).

For each matrix: the cells of one GPU (the lent machines have one) that a GPU host would run and that have not
run on that kind yet; of those, the ones without such a prediction; and a `bench predict` command for them, to
run under those releases (a `make versions-env` venv). Prints the commands; runs nothing. Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from bench import spec  # noqa: E402
from bench.predict import gpus, report  # noqa: E402
from bench.predict import runner as predict_runner  # noqa: E402


def refuse(why: str) -> NoReturn:
    print(f"preregister: {why}", file=sys.stderr)
    sys.exit(2)


def ran_on(results_dir: Path, kind: gpus.GpuKind) -> pd.DataFrame:
    """Every published row measured on that GPU kind, whatever its status."""
    frames = [pd.read_parquet(p) for p in sorted(results_dir.glob("*/runs/*.parquet"))]
    runs = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["cell_id", "gpu_name"])
    return runs[runs["gpu_name"] == kind.name]


def unspoken_for(matrix: spec.MatrixSpec, kind: gpus.GpuKind, software: str, results_dir: Path) -> list[str]:
    """The ids of the matrix's one-GPU cells a GPU host would run, not yet run on that kind, that no
    published prediction under `software` speaks for: one made for that kind, or for another that
    `report.stands_in` for it, or one that did not predict the cell (`unsupported`: a stack the fake run
    does not cover, on any card)."""
    to_run = [pc.cell.cell_id for pc in predict_runner.plan(matrix, None)
              if pc.skip_reason is None and pc.cell.gpus == 1]
    done = set(ran_on(results_dir, kind)["cell_id"])
    every = report.every_prediction(results_dir, matrix.name)
    every = every[report.software(every) == software]
    own = every["gpu_kind"] == kind.key
    card_gib = float("nan") if kind.memory_gib is None else kind.memory_gib
    other = (every["status"] != "ok") | report.stands_in(every, card_gib)
    spoken_for = set(every.loc[own | other, "cell_id"])
    return [c for c in to_run if c not in done and c not in spoken_for]


def default_software(results_dir: Path, kind: gpus.GpuKind) -> str:
    """The releases of the newest published run on that kind."""
    rows = ran_on(results_dir, kind)
    if rows.empty:
        refuse(f"no published run on {kind.name}: name the releases with --software")
    newest = rows.sort_values("started_at").iloc[-1]
    return report.software_label(newest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gpu", help=f"GPU kind: {', '.join(gpus.GPUS)}")
    parser.add_argument("matrices", nargs="+", help="matrices of matrix.yaml")
    parser.add_argument("--software", help="'torch X, transformers Y, peft Z' (default: the newest run's on that GPU kind)")
    parser.add_argument("--results-dir", type=Path, default=REPO / "results")
    args = parser.parse_args()
    try:
        kind = gpus.get(args.gpu)
        matrices = [spec.get(REPO / "matrix.yaml", name) for name in args.matrices]
    except (KeyError, spec.SpecError) as err:
        refuse(str(err.args[0]) if isinstance(err, KeyError) else str(err))
    if args.software is not None and not all(f"{library} " in args.software for library in report.SOFTWARE):
        # a label naming fewer libraries (the form before peft was one) would match no prediction: every cell unspoken for
        refuse(f"--software {args.software!r}: name each of {', '.join(report.SOFTWARE)} with its release, as "
               "PREDICTION.md's By software does ('torch 2.11.0, transformers 5.17.0, peft 0.21.0')")
    software = args.software or default_software(args.results_dir, kind)
    print(f"# cells a {kind.name} would run that no prediction under {software} speaks for")
    for matrix in matrices:
        ids = unspoken_for(matrix, kind, software, args.results_dir)
        print(f"# {matrix.name}: {len(ids)}")
        if ids:
            print(f"python -m bench predict {matrix.name} --gpu {kind.key} --only '{','.join(ids)}'")


if __name__ == "__main__":
    main()
