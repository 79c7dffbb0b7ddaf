"""Fit a GPU kind's step time rates (bench/predict/steptime.py RATES) to its published measured cells.

    python tools/fit_step_time.py h100 [--results results] [--start h100]

The cells: every published GPU cell of that kind whose newest prediction counted the step's work
(fake-run/22 on; a Liger stack's, 24 on) and whose stack the model times (bench/predict/steptime_report.py `timed`). Prints the
rates as a line of RATES (with bitsandbytes' 8-bit optimizer's rate where its cells exist), the in-sample and
left-out errors, and each cell's; writes nothing. Exit 2 on
bad input, 1 with fewer than 8 cells to fit. Where no cell is host-bound, the host's rate is not fitted: it
is the start's (`--start KIND`: another kind's fitted rates; else steptime.START), and the line says so.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from bench.predict import gpus, report, steptime, steptime_report  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gpu", help=f"GPU kind: {', '.join(gpus.GPUS)}")
    parser.add_argument("--results", type=Path, default=REPO / "results")
    parser.add_argument("--start", help="start from this GPU kind's fitted rates (a side no cell fits keeps them)")
    parser.add_argument("--keep-host", action="store_true",
                        help="with --start: keep its host rate and factors, fit the device's side alone (a kind whose "
                             "cells are too few or too large to show the host's pace)")
    args = parser.parse_args()
    for kind in (args.gpu, args.start):
        if kind is not None and kind not in gpus.GPUS:
            print(f"fit_step_time: unknown GPU kind {kind!r}; known: {', '.join(gpus.GPUS)}", file=sys.stderr)
            return 2
    if args.start is not None and args.start not in steptime.RATES:
        print(f"fit_step_time: no fitted rates for {args.start!r} to start from", file=sys.stderr)
        return 2
    if args.keep_host and args.start is None:
        print("fit_step_time: --keep-host needs --start KIND (whose host rate to keep)", file=sys.stderr)
        return 2
    start = steptime.RATES[args.start] if args.start else None
    if start is not None and args.keep_host:
        start = replace(start, host_fitted=False)
    both = report.checked(args.results)
    rows = steptime_report.timed(both, args.gpu)
    runs = ", ".join(sorted({part for v in rows["run_id"] for part in str(v).split(", ")}))
    fitted_on = f"{len(rows)} cells of {runs} (predictions {', '.join(sorted(set(rows['run_id_predicted'])))})"
    rates = steptime_report.fitted(both, args.gpu, fitted_on, start)
    if rates is None:
        print(f"fit_step_time: {len(rows)} timed cells on {args.gpu}: too few to fit four rates", file=sys.stderr)
        return 1
    works, measured = list(rows["work"]), list(rows["step_ms_p50"])
    if args.keep_host:
        fitted_on += f"; host time an op and its factors are {args.start}'s, kept"
    elif not steptime.host_bound_cells(works, rates):
        fitted_on += f"; no cell host-bound: host time an op is {args.start or 'the start'}'s, not fitted"
    left_out = steptime.left_out_errors(works, measured, rates)  # each refit from the fit to all
    for (_, r), lo in zip(rows.iterrows(), left_out, strict=True):
        predicted = steptime.step_ms(r["work"], rates)
        print(f"{r['cell_id']:60s} {r['step_ms_p50']:8.1f} {predicted:8.1f} {predicted / r['step_ms_p50'] - 1:+7.1%} "
              f"left out {lo:+7.1%} {steptime.bound(r['work'], rates)}")
    print("in sample: " + steptime.error_summary([steptime.step_ms(w, rates) / m - 1
                                                   for w, m in zip(works, measured, strict=True)]))
    plain = steptime.error_summary([e for w, e in zip(works, left_out, strict=True) if not w.optimizer_8bit_params])
    print(f'    "{args.gpu}": StepRates({rates.matmul_tflops:.1f}, {rates.memory_gbps:.1f}, {rates.kernel_us:.3f}, '
          f'{rates.op_us:.3f},\n               "{fitted_on}",\n               "{plain}", cells={rates.cells}', end="")
    if rates.host_factors:
        print(f",\n               host_factors={rates.host_factors!r}", end="")
    if not rates.host_fitted:
        print(",\n               host_fitted=False", end="")
    print(f",\n               overlap_p={rates.overlap_p!r}", end="")
    if rates.optimizer_8bit_ps is not None:
        eight_bit = steptime.error_summary([e for w, e in zip(works, left_out, strict=True) if w.optimizer_8bit_params])
        print(f",\n               optimizer_8bit_ps={rates.optimizer_8bit_ps:.2f}, "
              f'optimizer_8bit_cells={rates.optimizer_8bit_cells}, optimizer_8bit_left_out="{eight_bit}"', end="")
    print("),")
    return 0


if __name__ == "__main__":
    sys.exit(main())
