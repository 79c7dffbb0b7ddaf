"""How the step time model's two sides combine: the p of their p-norm (bench/predict/steptime.py OVERLAP_P), chosen
by the published cells each left out of the fit.

    python tools/choose_overlap.py [--results results] [--p 3,4,5,6,8,16,inf]

For each p: the H100's rates fitted to its cells, the H200's from the H100's (as tools/fit_step_time.py h200
--start h100 does), and each cell without an 8-bit optimizer predicted by rates fitted to the others; prints per
GPU kind the root mean square of those left-out errors, their median, range and how many are over 10%, and the
rates. Writes nothing. p = inf is the plain larger of the two sides. Minutes: each p refits every cell left out.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from bench.predict import report, steptime, steptime_report  # noqa: E402

KINDS = (("h100", None), ("h200", "h100"))  # each kind and the kind whose rates (at the same p) its fit starts from


def left_out(works: list[steptime.StepWork], measured: list[float],
             start: steptime.StepRates | None) -> tuple[steptime.StepRates, list[float]]:
    """The rates fitted to all the cells, and the left-out errors of those without an 8-bit optimizer."""
    rates = steptime.fit(works, measured, "", start)
    plain = [i for i, w in enumerate(works) if not w.optimizer_8bit_params]
    return rates, steptime.left_out_errors([works[i] for i in plain], [measured[i] for i in plain], rates)


def line(kind: str, rates: steptime.StepRates, errors: list[float]) -> str:
    rms = math.sqrt(statistics.fmean(e * e for e in errors))
    return (f"  {kind}: left out rms {rms:.2%}, {steptime.error_summary(errors)}, {sum(abs(e) > 0.1 for e in errors)} "
            f"over 10%; rates {rates.matmul_tflops:.0f} TFLOP/s, {rates.memory_gbps:.0f} GB/s, {rates.kernel_us:.2f} µs "
            f"a kernel, {rates.op_us:.2f} µs an op, {dict(rates.host_factors)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=REPO / "results")
    parser.add_argument("--p", default="3,4,5,6,8,16,inf", help="the p values tried, comma list (inf: the larger)")
    args = parser.parse_args()
    try:
        values = [float(v) for v in args.p.split(",")]
    except ValueError:
        values = []
    if not values or any(not v > 1 for v in values):
        print(f"choose_overlap: --p {args.p!r}: numbers above 1, comma separated (inf: the larger)", file=sys.stderr)
        return 2
    both = report.checked(args.results)
    cells = {kind: steptime_report.timed(both, kind) for kind, _ in KINDS}
    for p in values:
        print(f"p = {p:g}")
        fitted: dict[str, steptime.StepRates] = {}
        with mock.patch.object(steptime, "OVERLAP_P", p):
            for kind, start in KINDS:
                rows = cells[kind]
                rates, errors = left_out(list(rows["work"]), list(rows["step_ms_p50"]), fitted.get(start or ""))
                fitted[kind] = rates
                print(line(kind, rates, errors), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
