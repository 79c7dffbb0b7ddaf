"""The allocator model's segment placement against the published GPU cells, on this CPU.

    python tools/placement_check.py llama3b [--only GLOB[,GLOB]] [--gpu h100]

Where CUDA puts a new segment decides which of two equal free blocks a request takes (best fit, the
lowest address among equals), and so, now and then, whether a later request finds a cached block or
needs a segment of its own: a reserved figure can turn by a whole block on it. bench/predict/allocator.py
places segments as the H200's own snapshots showed (the lowest gap that holds one, else below them all).
This predicts each measured `ok` cell of the matrix twice, under that placement and with every new
segment above the earlier ones (ascending addresses, the model's rule before the H200's snapshots),
and prints peak reserved beside the GPU's, each cell and the median and largest errors. Run it under
the measured run's releases (a `make versions-env` venv) to compare like with like.
"""

from __future__ import annotations

import argparse
import bisect
import fnmatch
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]


def ascending(self: Any, size: int) -> int:
    """Replay._place with every new segment above the earlier ones."""
    start = self._ranges[-1][1] if self._ranges else 0
    bisect.insort(self._ranges, (start, start + size))
    return start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("matrix")
    parser.add_argument("--only", default="*", help="comma list of cell id globs (default every measured cell)")
    parser.add_argument("--gpu", default="h100")
    args = parser.parse_args()

    from bench import spec
    from bench.cells import make_cell
    from bench.predict import allocator, fake, gpus, report
    from bench.stacks import parse_stack

    matrix, gpu, placed = spec.get(REPO / "matrix.yaml", args.matrix), gpus.get(args.gpu), allocator.Replay._place
    measured = report.measured_gpu_cells(REPO / "results", args.matrix)
    measured = measured[measured["gpu_name"] == gpu.name]  # the GPU kind's own measurements
    globs = args.only.split(",")
    measured = measured[[any(fnmatch.fnmatch(c, g) for g in globs) for c in measured["cell_id"]]]
    errors: dict[str, list[float]] = {"the model's": [], "ascending": []}
    print(f"{args.matrix}: {len(measured)} measured cells; peak reserved GiB, measured / predicted (error)")
    print("| cell | measured | the model's placement | ascending addresses |\n|---|---|---|---|")
    for _, m in measured.iterrows():
        cell = make_cell(matrix, "cuda", m["model"], int(m["seq_len"]), int(m["batch_size"]), parse_stack(m["stack"]))
        figures = []
        for label, place in (("the model's", placed), ("ascending", ascending)):
            allocator.Replay._place = place  # type: ignore[method-assign]
            out = fake.predict_cell(cell, gpu)
            if out["status"] != "ok":
                figures.append(out["status"])
                continue
            error = out["peak_reserved_gib"] / m["peak_reserved_gib"] - 1
            errors[label].append(error)
            figures.append(f"{out['peak_reserved_gib']:.3f} ({error:+.2%})")
        print(f"| `{m['cell_id']}` | {m['peak_reserved_gib']:.3f} | {' | '.join(figures)} |", flush=True)
    for label, found in errors.items():
        if found:
            size = sorted(abs(e) for e in found)
            print(f"{label}: median abs error {statistics.median(size):.3%}, max {size[-1]:.2%}, "
                  f"over 1% {sum(e > 0.01 for e in size)}, over 3% {sum(e > 0.03 for e in size)}")


if __name__ == "__main__":
    main()
