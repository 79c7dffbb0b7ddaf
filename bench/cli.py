"""Command line: wiring only.

    python -m bench list MATRIX       the plan: every cell, and why a cell will be skipped
    python -m bench run MATRIX        run it (resumes a run with the same id), write parquet + leaderboard
    python -m bench report MATRIX     regenerate the leaderboard from the newest run's parquet
    python -m bench compare BASE CAND  per-cell deltas of two runs, measured or predicted; exit 1 on a regression
    python -m bench predict MATRIX    each cell's peak allocated GPU memory, predicted on a CPU (fake tensors)
    python -m bench ask MODEL --seq N --batch N --stack S   will one cell fit? predicted, beside any measurement
    python -m bench fit MATRIX --budgets 24,40,80   largest batch / sequence that trains per budget
    python -m bench overhead MATRIX --run-id ID   baseline cells beside a bare PyTorch loop (GPU)
    python -m bench env               what this machine has (GPU, libraries) as the suite sees it

Exit codes: 0 done; 1 some cell ended in error (compare: a regression; ask: it does not fit); 2 bad input
(matrix.yaml, a stack) or nothing runnable; 3 (ask) the cell could not be predicted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import math
import os
import re
import sys
import warnings
from collections import Counter
from pathlib import Path

import pandas as pd

from . import (
    ask,
    ask_stacks,
    cells,
    compare,
    envinfo,
    fit,
    fitreport,
    models,
    overhead,
    prebuild,
    report,
    results,
    runner,
    scenarios,
    spec,
)
from .predict import gpus
from .predict import report as predict_report
from .predict import runner as predict_runner
from .progress import LineProgress, RichProgress
from .stacks import StackError

DEFAULT_MATRIX_FILE = envinfo.REPO / "matrix.yaml"
DEFAULT_RESULTS = envinfo.REPO / "results"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Workers start in the suite's folder and write where they are told: a path relative to where the
    # user stands would land somewhere else (every cell "exited without a result")
    args.results_dir = args.results_dir.resolve()
    try:
        if getattr(args, "run_id", None) is not None and not getattr(args, "into", None):  # it names files
            spec.safe_name(args.run_id, "run id")  # and folders under results/ (with --into: globs of runs that exist)
        return int(args.func(args))
    except (spec.SpecError, StackError, results.RunBusy, prebuild.BuildBlocked) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description="Memory strategies for LLM training, measured.")
    p.add_argument("--matrix-file", type=Path, default=DEFAULT_MATRIX_FILE)
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS)
    sub = p.add_subparsers(required=True, dest="command")

    ls = sub.add_parser("list", help="print the plan of a matrix; runs nothing")
    ls.add_argument("matrix", help="a matrix of matrix.yaml (--matrix-file)")
    ls.set_defaults(func=cmd_list)

    run = sub.add_parser("run", help="run a matrix")
    run.add_argument("matrix", help="a matrix of matrix.yaml (--matrix-file)")
    run.add_argument("--run-id", help="resume or name a run (default: MATRIX-DEVICE-YYYYMMDD, resumed if present)")
    run.add_argument("--fresh", action="store_true", help="start a new run id instead of resuming today's")
    run.add_argument("--only", help="only cells whose id matches one of these globs (comma list), e.g. '*_b2_*'")
    run.add_argument("--redo", default="", help="re-run recorded cells with these statuses (comma list, or 'all')")
    run.add_argument("--no-prune", action="store_true", help="run larger batches even after an OOM")
    run.add_argument("--repeats", type=int, help="run each cell N times, each in a fresh process (default: the matrix's)")
    run.add_argument("--prefork", default="auto", metavar="auto|on|off|N",
                     help=f"start the workers of the next N cells while a cell runs, hiding their imports (on: "
                          f"{runner.PREFORK_AHEAD}; auto: on for GPU runs, off on a CPU)")
    run.add_argument("--shard", metavar="I/N",
                     help="run only shard I of N (by cell group), e.g. a job array's task: --shard 3/8; the "
                          "default run id gets -shardIofN; `report --run-id 'RUN-shard*' --into RUN` merges them")
    run.add_argument("--stop-at", type=float, metavar="EPOCH_S",
                     help="start no cell that would end after this time (epoch seconds; default: $BENCH_STOP_AT), "
                          "by its stack's earlier rows in the run; exit 124 with cells left, to resume later")
    run.set_defaults(func=cmd_run)

    rep = sub.add_parser("report", help="regenerate a matrix's leaderboard from its headline run (the one with the "
                                         "most cells, the newest among equals)")
    rep.add_argument("matrix", help="a matrix of matrix.yaml (--matrix-file)")
    rep.add_argument("--run-id", help="re-collect this run's raw rows (results/raw/RUN_ID, else its parquet) into its "
                                      "parquet first; several runs (comma list or globs, e.g. shards) with --into")
    rep.add_argument("--into", help="merge the --run-id runs by cell id into this run (its parquet and board)")
    rep.set_defaults(func=cmd_report)

    cmp = sub.add_parser("compare", help="baseline run vs candidate run: deltas, exit 1 on a regression")
    cmp.add_argument("baseline", help="parquet file or run id")
    cmp.add_argument("candidate", help="parquet file or run id")
    cmp.add_argument("--out", type=Path, help="also write the markdown report here")
    gate = compare.Gate()
    cmp.add_argument("--mem-rel", type=float, default=gate.mem_rel, help="allowed peak growth, fraction")
    cmp.add_argument("--mem-abs-gib", type=float, default=gate.mem_abs_gib, help="allowed peak growth, GiB")
    cmp.add_argument("--tps-z", type=float, default=gate.tps_z, help="tokens/s band in standard errors")
    cmp.add_argument("--tps-floor", type=float, default=gate.tps_floor, help="smallest tokens/s band, fraction")
    cmp.add_argument("--step-rel", type=float, default=gate.step_rel,
                     help="two predictions: allowed growth of the predicted step time, fraction")
    cmp.add_argument("--status-only", action="store_true",
                     help="gate the cells' statuses alone (ok, then anything else); show the rest")
    cmp.set_defaults(func=cmd_compare)

    scen = sub.add_parser("scenarios", help="answer the field reports from the published tables: results/SCENARIOS.md")
    scen.set_defaults(func=cmd_scenarios)

    site_p = sub.add_parser("site", help="every published table as one static page: site/index.html")
    site_p.add_argument("--out", type=Path, default=Path("site"), help="folder for index.html (default: site)")
    site_p.add_argument("--results-url", help="where results/ is served, as the page links it (default: the "
                                              "relative path from --out to --results-dir)")
    site_p.set_defaults(func=cmd_site)

    pred = sub.add_parser("predict", help="predict each cell's peak allocated GPU memory on a CPU (fake tensors)")
    pred.add_argument("matrix", help="a matrix of matrix.yaml (--matrix-file)")
    pred.add_argument("--only", help="only cells whose id matches one of these globs (comma list)")
    pred.add_argument("--gpu", default="h100", help=f"GPU kind predicted for: {', '.join(gpus.GPUS)} (default h100)")
    pred.add_argument("--gpu-memory-gib", type=float, help="the card's memory, GiB (default: the GPU kind's measured capacity)")
    pred.add_argument("--host-memory-gib", type=float, help="the host's RAM, GiB: offload cells say whether they fit in it "
                                                            "(host_fits; default: not judged)")
    pred.add_argument("--run-id", help="resume or name a prediction run (default: MATRIX-predicted-GPU-YYYYMMDD)")
    pred.add_argument("--jobs", type=int, default=1, help="processes predicting in parallel (default 1)")
    pred.add_argument("--redo", action="store_true", help="predict again the cells the run already has")
    pred.set_defaults(func=cmd_predict)

    ask_p = sub.add_parser("ask", help="will it fit? one cell predicted on this CPU, beside any published GPU "
                                       "measurement of it (writes nothing; exit 0 fits, 1 does not, 3 not predicted)")
    ask_p.add_argument("model", help=f"a registry model ({', '.join(m for m in models.registry() if not m.startswith('tiny'))}, "
                                     "...) or a path to any model's config.json")
    ask_p.add_argument("--seq", type=int, help="sequence length, tokens (not with --largest seq)")
    ask_p.add_argument("--batch", type=int, help="batch size per GPU (default 1; not with --largest batch)")
    ask_p.add_argument("--stack", action="append", help="technique stack, as in matrix.yaml, e.g. 'gc + lora(r=16)' "
                                                        "(default baseline); again for another: which of them fit, "
                                                        "one table (exit 0 if any fits)")
    ask_p.add_argument("--gpus", type=int, default=1, help="GPUs (ranks) for an FSDP2, DDP or ZeRO stack (default 1)")
    ask_p.add_argument("--checkpoint", default="none", help="none | model | full: a save after the last step")
    ask_p.add_argument("--gpu", default="h100", help=f"GPU kind: {', '.join(gpus.GPUS)} (default h100)")
    ask_p.add_argument("--gpu-memory-gib", type=float, help="the card's memory, GiB (default: the GPU kind's measured capacity)")
    ask_p.add_argument("--outside-torch-gib", type=float,
                       help="what lives on the card outside torch's allocator (CUDA context, libraries), GiB, as you "
                            "measured it (nvidia-smi's use less torch.cuda.memory_reserved()); default: the GPU kind's "
                            "measured figure (H100, H200), else the answer says how much of it would still fit")
    ask_p.add_argument("--host-memory-gib", type=float, help="the host's RAM, GiB: an offload stack says whether it fits")
    ask_p.add_argument("--largest", choices=("batch", "seq"),
                       help="the other way round: the largest batch (at --seq) or sequence length (at --batch) that "
                            "fits the card, a few fake runs")
    ask_p.add_argument("--max-batch", type=int, default=64, help="with --largest batch: the largest searched (default 64)")
    ask_p.add_argument("--seq-step", type=int, default=1024,
                       help="with --largest seq: lengths searched are multiples of this (default 1024)")
    ask_p.add_argument("--max-seq", type=int, default=131072,
                       help="with --largest seq: the longest searched (default 131072)")
    ask_p.add_argument("--jobs", type=int, default=1, help="with several --stack: processes predicting them side by "
                                                          "side (default 1)")
    ask_p.add_argument("--json", action="store_true", help="the predicted row and the measured rows as JSON")
    ask_p.set_defaults(func=cmd_ask)

    fit_p = sub.add_parser("fit", help="per budget: the largest batch (and at batch 1 the longest sequence) that trains")
    fit_p.add_argument("matrix", help="a matrix of matrix.yaml (--matrix-file)")
    fit_p.add_argument("--budgets", required=True, help="memory budgets in GiB, comma list, e.g. 24,40,80")
    fit_p.add_argument("--max-batch", type=int, default=64, help="largest batch size searched (default 64)")
    fit_p.add_argument("--seq-step", type=int, default=1024,
                       help="sequence lengths searched at batch 1 are multiples of this (default 1024)")
    fit_p.add_argument("--max-seq", type=int, default=32768, help="longest sequence length searched (default 32768)")
    fit_p.add_argument("--run-id", help="resume or name a fit run (default: fit-MATRIX-DEVICE-YYYYMMDD)")
    fit_p.add_argument("--predict", action="store_true",
                       help="the frontier from predictions alone (bench predict's fake runs), on any machine")
    fit_p.add_argument("--gpu", default="h100", help="with --predict: the GPU kind predicted for (default h100)")
    fit_p.add_argument("--host-memory-gib", type=float,
                       help="with --predict: the host's RAM, GiB; a probe whose predicted host RAM exceeds it is "
                            "host_oom, which bounds its search as an OOM does")
    fit_p.add_argument("--jobs", type=int, default=1,
                       help="with --predict: stacks searched at once, each fake run in one of this many processes "
                            "(default 1)")
    fit_p.set_defaults(func=cmd_fit)

    ovh = sub.add_parser("overhead", help="a run's baseline cells beside a bare PyTorch loop (GPU): the harness's cost")
    ovh.add_argument("matrix", help="a matrix of matrix.yaml (--matrix-file)")
    ovh.add_argument("--run-id", required=True)
    ovh.add_argument("--only", help="cells whose id matches one of these globs (comma list)")
    ovh.set_defaults(func=cmd_overhead)

    env = sub.add_parser("env", help="what this machine has, as the suite sees it")
    env.set_defaults(func=cmd_env)
    return p


def cmd_list(args: argparse.Namespace) -> int:
    matrix = spec.get(args.matrix_file, args.matrix)
    planned = cells.plan(matrix, envinfo.host_caps())
    runnable = sum(pc.skip_reason is None for pc in planned)
    print(f"{matrix.name}: {len(planned)} cells, {runnable} runnable here, {len(planned) - runnable} skipped"
          + (f" — {matrix.description}" if matrix.description else ""))
    for pc in planned:
        if pc.skip_reason is None:
            print(f"  run   {pc.cell.cell_id}")
    skipped = Counter(pc.skip_reason for pc in planned if pc.skip_reason)
    for reason, count in skipped.items():  # one line per reason: a GPU matrix on a CPU is one reason, not 336 lines
        example = next(pc.cell.cell_id for pc in planned if pc.skip_reason == reason)
        print(f"  skip  {example}  ({reason})" if count == 1 else f"  skip  {count} cells, e.g. {example}  ({reason})")
    if matrix.prune_after_oom:
        print("Cells after an OOM at a smaller batch of the same model/seq/stack are pruned at run time.")
    return 0


STOPPED = 124  # `run` stopped before a cell that would end after --stop-at: as timeout(1) says "cut, go on later"


def _stop_at(given: float | None) -> float | None:
    """--stop-at, else $BENCH_STOP_AT (tools/gpu-window.sh sets it to its window's end), else none."""
    if given is not None:
        return given
    value = os.environ.get("BENCH_STOP_AT")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise spec.SpecError(f"BENCH_STOP_AT={value!r} is not a time in epoch seconds") from None


def cmd_run(args: argparse.Namespace) -> int:
    matrix = spec.get(args.matrix_file, args.matrix)
    host = envinfo.host_caps()
    if args.repeats is not None and args.repeats < 1:
        raise spec.SpecError(f"--repeats must be at least 1, not {args.repeats}")
    shard = cells.Shard.parse(args.shard) if args.shard else None
    prefork = _prefork(args.prefork)
    planned = cells.plan(matrix, host, args.repeats)
    cells.matching(planned, args.only, matrix.name)  # refuses globs that match nothing
    if not any(pc.skip_reason is None for pc in planned):
        return _nothing_runnable(args, matrix, planned, host)
    if shard:
        held = shard.select(planned)
        if not held:  # a job array with more tasks than the matrix has groups: not an error
            print(f"shard {args.shard} of {matrix.name!r} holds none of its {len(planned)} cells: nothing to run")
            return 0
        planned = held
    device = cells.resolve_device(matrix, host)
    provenance = envinfo.provenance(host)
    run_id = args.run_id or _default_run_id(matrix.name, device, provenance, args.fresh)
    if shard and not args.run_id:
        run_id += f"-{shard.label}"
    published = report.published_runs(args.results_dir / matrix.name) or set()
    if not args.run_id and args.results_dir / matrix.name / "runs" / f"{run_id}.parquet" in published:
        run_id += "-local"  # a user's run never writes into a published one (same matrix, same day)
    opts = runner.RunOptions(
        results_dir=args.results_dir,
        run_id=run_id,
        prune_after_oom=matrix.prune_after_oom and not args.no_prune,
        redo=frozenset(filter(None, args.redo.split(","))),
        only=args.only,
        prefork=(runner.PREFORK_AHEAD if device == "cuda" else 0) if prefork is None else prefork,
        stop_at=_stop_at(args.stop_at),
    )
    print(f"run {run_id}: {len(planned)} cells of {matrix.name!r} on {device}; raw rows in "
          f"{args.results_dir / 'raw' / run_id}")
    with RichProgress() as progress:
        rows = runner.run(planned, opts, provenance, progress)
    ids = {pc.cell.row_key for pc in planned}
    parquet = args.results_dir / matrix.name / "runs" / f"{run_id}.parquet"
    results.write_parquet([r for cid, r in rows.items() if cid in ids], parquet)
    run_board, board = report.publish(parquet, matrix.ladder, report.Plan.of(matrix))
    counts = runner.summarize(rows, planned)
    print(f"done: {', '.join(f'{n} {s}' for s, n in counts.most_common())}")
    print(f"table: {parquet}\nthis run: {run_board}\nleaderboard: {board}")
    left = [pc for pc in cells.matching(planned, args.only, matrix.name) if pc.cell.row_key not in rows]
    if opts.stop_at is not None and left:
        print(f"stopped at --stop-at: {len(left)} cells left; run the same command again to go on")
        return STOPPED
    return 1 if counts.get("error") else 0


def cmd_report(args: argparse.Namespace) -> int:
    if args.into is not None:
        spec.safe_name(args.into, "run id")
    if args.into and not args.run_id:
        raise spec.SpecError("--into merges the runs given by --run-id: name them")
    try:
        if args.into:
            parquet = _merge(args.results_dir, args.matrix, args.run_id, args.into)
        elif args.run_id:
            parquet = _collect(args.results_dir, args.matrix, args.run_id)
        else:
            parquet = report.headline_run(args.results_dir / args.matrix)
    except FileNotFoundError as err:
        raise spec.SpecError(str(err)) from err
    matrix = spec.load(args.matrix_file).get(args.matrix)  # a matrix since removed from matrix.yaml: no plan
    run_board, board = report.publish(parquet, matrix.ladder if matrix else (), report.Plan.of(matrix) if matrix else None)
    print(f"this run: {run_board}\nleaderboard: {board} (from {report.headline_run(args.results_dir / args.matrix)})")
    return 0


def _collect(results_dir: Path, matrix: str, run_id: str) -> Path:
    parquet = results.collect_run(results_dir, matrix, run_id)
    if parquet is None:
        raise spec.SpecError(f"no rows of matrix {matrix!r} in run {run_id!r} (under {results_dir / 'raw' / run_id} "
                             f"or {results_dir / matrix / 'runs'})")
    return parquet


def _merge(results_dir: Path, matrix: str, run_ids: str, into: str) -> Path:
    """Several runs of one matrix (shards, or a run and its re-runs) -> one run's parquet, by cell id."""
    names = [name for name in results.run_ids(results_dir, matrix, run_ids.split(",")) if name != into]
    if not names:  # a glob may match the merged run itself, made by this command before: it is remade
        raise spec.SpecError(f"--run-id {run_ids!r} names no run but {into!r} itself")
    runs = [results.run_rows(results_dir, matrix, name) for name in names]
    print(f"merging {len(names)} runs: {', '.join(names)}")
    parquet = results_dir / matrix / "runs" / f"{into}.parquet"
    results.write_parquet([r | {"run_id": into} for r in results.merge_runs(runs)], parquet)
    return parquet


def cmd_compare(args: argparse.Namespace) -> int:
    try:
        base, cand = (results.read_any(compare.resolve(ref, args.results_dir)) for ref in (args.baseline, args.candidate))
    except FileNotFoundError as err:
        raise spec.SpecError(str(err)) from err
    if not set(base["cell_id"]) & set(cand["cell_id"]):
        raise spec.SpecError(f"{args.baseline} and {args.candidate} have no cell in common (other matrices or "
                             "settings): nothing to compare")
    gate = compare.Gate(args.mem_rel, args.mem_abs_gib, args.tps_z, args.tps_floor, args.step_rel, args.status_only)
    diffs = compare.compare(base, cand, gate)
    text = compare.markdown(diffs, base, cand, gate)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 1 if any(d.verdict == "regression" for d in diffs) else 0


def cmd_scenarios(args: argparse.Namespace) -> int:
    print(f"scenarios: {scenarios.publish(args.results_dir, args.matrix_file)}")
    return 0


def cmd_site(args: argparse.Namespace) -> int:
    from .site import write_site  # markdown-it and the page's assets only when a page is written
    from .site.data import published_tables

    if not published_tables(args.results_dir):
        raise spec.SpecError(f"no published tables under {args.results_dir} (<matrix>/runs/*.parquet, "
                             "<matrix>/predicted/*.parquet): nothing to put on a page")
    print(f"site: {write_site(args.results_dir, args.out, args.results_url)}")
    return 0


# Warnings optional libraries log as a fake run imports them, about kernels a fake run never calls. They came
# first in every answer, and read as the prediction's own failure ("Failed to load ..."): bitsandbytes' CPU 4-bit
# matmul kernel missing (a CPU with AVX512-BF16), torchao's CUDA extensions not loading on a CPU, torch's
# deprecation of torchao's Enum registrations, DeepSpeed's "Setting accelerator to CPU" (on stdout, amid a ZeRO
# answer). And one library's deprecation warning about another's API, which no answer can act on: peft 0.21 reads
# transformers 5.24's deprecated `is_gradient_checkpointing` as a LoRA stack is applied.
IMPORT_NOISE = ("bitsandbytes.backends.cpu.ops", "torchao", "torch.utils._pytree", "DeepSpeed")
LIBRARY_DEPRECATIONS = (r"`is_gradient_checkpointing` is deprecated",)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def _fake_runs_ahead() -> None:
    """Before a command's fake runs: the loggers of IMPORT_NOISE quiet but for errors, and LIBRARY_DEPRECATIONS
    not shown."""
    for name in IMPORT_NOISE:
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)  # its children's too
        logger.addFilter(_errors_only)  # DeepSpeed sets its logger's level as it is imported; a filter stays
    for message in LIBRARY_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


def cmd_predict(args: argparse.Namespace) -> int:
    _fake_runs_ahead()
    matrix = spec.get(args.matrix_file, args.matrix)
    gpu = _gpu_kind(args.gpu)
    if args.jobs < 1 or any(x is not None and x <= 0 for x in (args.gpu_memory_gib, args.host_memory_gib)):
        raise spec.SpecError("--jobs must be at least 1, --gpu-memory-gib and --host-memory-gib positive")
    planned = predict_runner.plan(matrix, args.only)
    run_id = args.run_id or f"{matrix.name}-predicted-{gpu.key}-{dt.datetime.now(dt.UTC):%Y%m%d}"
    opts = predict_runner.PredictOptions(args.results_dir, run_id, gpu, args.gpu_memory_gib, args.jobs, args.redo,
                                         args.host_memory_gib)
    kept = predict_runner.records_redo_would_replace(planned, opts)
    if kept:
        raise spec.SpecError(f"--redo would replace {len(kept)} prediction(s) of run {run_id} made before a GPU first ran "
                             f"the cell ({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}): PREDICTION.md's "
                             "'Predicted before the GPU ran it' rests on them; predict again under a new --run-id")
    print(f"predict {run_id}: {len(planned)} cells of {matrix.name!r} for {gpu.name}, on this CPU (fake tensors)")
    rows = predict_runner.run(planned, opts, envinfo.provenance(envinfo.host_caps()), _print_prediction)
    table = predict_runner.write_table(opts, matrix)
    accuracy = predict_report.publish(args.results_dir)
    counts = Counter(r["status"] for r in rows)
    print(f"done: {', '.join(f'{n} {s}' for s, n in counts.most_common())}\npredictions: {table}\n"
          f"against the measured cells: {accuracy}")
    return 1 if counts.get("error") else 0


def _print_prediction(cell: cells.Cell, row: dict) -> None:
    if row["status"] == "ok":
        op = f" ({row['peak_op']})" if row.get("peak_op") else ""
        detail = f"peak allocated {row['peak_allocated_gib']:.2f} GiB in {row['peak_phase']}{op}, {row['predict_s']:.1f} s"
        if row.get("host_peak_gib") is not None:
            verdict = f": host_oom on a {row['host_memory_gib']:g} GiB host" if row.get("host_fits") is False else ""
            detail += f", host {row['host_peak_gib']:.1f} GiB{verdict}"
    else:
        detail = str(row.get("unsupported_reason") or row.get("skip_reason") or row.get("error") or "").strip().splitlines()[-1]
    print(f"{row['status']:11} {cell.cell_id}  {detail}", flush=True)


def cmd_ask(args: argparse.Namespace) -> int:
    _fake_runs_ahead()
    model = args.model
    model_files: tuple[Path, ...] = ()  # a config.json asked about: --jobs's processes register it too
    if model.endswith(".json") or Path(model).is_file():
        try:
            model, model_files = models.register_file(Path(model)), (Path(model),)
        except ValueError as err:
            raise spec.SpecError(str(err)) from None
    if any(x is not None and x <= 0 for x in (args.gpu_memory_gib, args.host_memory_gib)):
        raise spec.SpecError("--gpu-memory-gib and --host-memory-gib must be positive")
    card = _asked_card(args)
    sizes = _ask_sizes(args, card)
    stacks = args.stack or ["baseline"]
    if len(stacks) > 1 and args.largest:
        raise spec.SpecError("--largest searches one stack: give --stack once")
    if args.jobs < 1 or (args.jobs > 1 and len(stacks) == 1):
        raise spec.SpecError("--jobs predicts several stacks side by side: give --stack more than once, and a count >= 1")
    question = ask.Question(model, sizes[0] if args.largest == "seq" else args.seq, 1 if args.batch is None else args.batch,
                            stacks[0], args.gpus, args.checkpoint)
    for stack in stacks:  # bad input (model, stack, sizes) is an error before anything runs
        ask.cell_for(dataclasses.replace(question, stack=stack))
    if len(stacks) > 1:
        several = ask_stacks.answers(question, stacks, card, args.host_memory_gib, args.results_dir,
                                     lambda line: print(line, file=sys.stderr, flush=True), args.jobs, model_files)
        print(ask_stacks.as_json(several) if args.json else ask_stacks.text(several))
        return ask.EXIT_CODES[several.verdict]
    if args.largest:
        frontier = ask.largest(question, args.largest, sizes, card, args.host_memory_gib, args.results_dir,
                               lambda line: print(line, file=sys.stderr, flush=True))
        print(ask.largest_json(frontier) if args.json else ask.largest_text(frontier))
        return ask.EXIT_CODES[frontier.verdict]
    found = ask.with_record(ask.answer(question, card, args.host_memory_gib, args.results_dir), args.results_dir)
    print(ask.as_json(found) if args.json else ask.text(found))
    return ask.EXIT_CODES[found.verdict]


def _asked_card(args: argparse.Namespace) -> gpus.GpuKind:
    """--gpu's kind, with the capacity and the memory outside torch asked about where given."""
    card = _gpu_kind(args.gpu)
    if args.outside_torch_gib is not None:
        memory = args.gpu_memory_gib or card.memory_gib
        if args.outside_torch_gib < 0 or (memory is not None and args.outside_torch_gib >= memory):
            raise spec.SpecError(f"--outside-torch-gib must be at least 0 and below the card's memory ({memory} GiB)")
        card = dataclasses.replace(card, outside_torch_gib=args.outside_torch_gib)
    return dataclasses.replace(card, **({"memory_gib": args.gpu_memory_gib} if args.gpu_memory_gib else {}))


def _ask_sizes(args: argparse.Namespace, card: gpus.GpuKind) -> list[int]:
    """The sizes `--largest` searches ([] without it), once the flags are checked."""
    if args.largest is None:
        if args.seq is None:
            raise spec.SpecError("--seq is needed (or --largest seq, to search it)")
        return []
    searched = {"batch": args.batch, "seq": args.seq}[args.largest]
    if searched is not None:
        raise spec.SpecError(f"--largest {args.largest} searches --{args.largest}: do not give it")
    if args.largest == "batch" and args.seq is None:
        raise spec.SpecError("--largest batch searches at one sequence length: give --seq")
    if card.memory_gib is None:
        raise spec.SpecError(f"--largest needs the card's memory: {card.key}'s is not measured, pass --gpu-memory-gib")
    if args.max_batch < 1 or args.seq_step < 1 or args.max_seq < args.seq_step:
        raise spec.SpecError("--max-batch must be >= 1, --max-seq >= --seq-step >= 1")
    return (list(range(1, args.max_batch + 1)) if args.largest == "batch"
            else list(range(args.seq_step, args.max_seq + 1, args.seq_step)))


def cmd_fit(args: argparse.Namespace) -> int:
    matrix, plan = _fit_plan(args)
    if args.predict:
        return _fit_predicted(args, matrix, plan)
    host = envinfo.host_caps()
    device = cells.resolve_device(matrix, host)
    if device == "cuda" and host.cuda_devices == 0:
        return _nothing_runnable(args, matrix, cells.plan(matrix, host), host)
    provenance = envinfo.provenance(host)
    run_id = args.run_id or "fit-" + _default_run_id(matrix.name, device, provenance, fresh=False)
    opts = runner.RunOptions(results_dir=args.results_dir, run_id=run_id, prune_after_oom=False)  # the search decides
    if device == "cpu":
        print("note: on the CPU budgets are recorded, not enforced: only OOMs a stack raises itself bound the search")
    hints = _predicted_hints(args.results_dir / matrix.name / "fit") if device == "cuda" else {}
    probes = fit.MeasuredProbes(matrix, host, opts, provenance, LineProgress())
    known = len(probes.rows)  # a resumed run's
    summary = fit.FrontierRun(matrix, host, plan, probes, hints).all()
    probe_rows = list(results.read_raw(args.results_dir / "raw" / run_id).values())
    board = fitreport.publish(summary, probe_rows, args.results_dir / matrix.name / "fit", run_id)
    print(f"done: {len(summary)} searches, {len(probes.rows) - known} probes run now\nfrontier: {board}")
    return 0


def _fit_plan(args: argparse.Namespace) -> tuple[spec.MatrixSpec, fit.FitPlan]:
    matrix = spec.get(args.matrix_file, args.matrix)
    try:
        budgets = tuple(float(b) for b in args.budgets.split(","))
    except ValueError:
        raise spec.SpecError(f"--budgets: {args.budgets!r} is not a comma list of GiB numbers") from None
    if (not all(math.isfinite(b) and b > 0 for b in budgets) or args.max_batch < 1 or args.seq_step < 1
            or args.max_seq < args.seq_step):
        raise spec.SpecError("--budgets must be positive, --max-batch >= 1, --max-seq >= --seq-step >= 1")
    if matrix.gpus != (1,):
        raise spec.SpecError(f"matrix {matrix.name}: bench fit searches one-GPU cells; remove its gpus: {list(matrix.gpus)}")
    if args.host_memory_gib is not None and not (args.predict and args.host_memory_gib > 0):
        raise spec.SpecError("--host-memory-gib judges predicted probes: it needs --predict and a positive GiB")
    if args.jobs != 1 and not (args.predict and args.jobs > 1):
        raise spec.SpecError("--jobs spreads fake runs over processes: it needs --predict and a count >= 1 (a GPU "
                             "measures one probe at a time)")
    return matrix, fit.FitPlan(budgets, args.max_batch, args.seq_step, args.max_seq)


def _fit_predicted(args: argparse.Namespace, matrix: spec.MatrixSpec, plan: fit.FitPlan) -> int:
    """The frontier from predictions alone, on any machine: each probe a fake run."""
    _fake_runs_ahead()
    gpu = dataclasses.replace(_gpu_kind(args.gpu), budgets_gib=plan.budgets_gib)  # each prediction replayed within each
    on_gpu = dataclasses.replace(matrix, device="cuda")
    run_id = args.run_id or f"fit-{matrix.name}-predicted-{gpu.key}-{dt.datetime.now(dt.UTC):%Y%m%d}"
    opts = predict_runner.PredictOptions(args.results_dir, run_id, gpu, None, host_memory_gib=args.host_memory_gib)
    provenance = envinfo.provenance(envinfo.host_caps())
    with (results.run_lock(args.results_dir / "raw" / run_id),
          predict_runner.spawned_pool(args.jobs) if args.jobs > 1 else contextlib.nullcontext() as pool):
        probes = fit.PredictedProbes(on_gpu, opts, provenance, _print_prediction, pool)
        known = len(probes.predicted)  # a resumed run's
        summary = fit.FrontierRun(on_gpu, probes.host, plan, probes).all(args.jobs)
    board = fitreport.publish_predicted(summary, list(probes.predicted.values()),
                                        args.results_dir / matrix.name / "fit", run_id, gpu.name)
    print(f"done: {len(summary)} searches, {len(probes.predicted) - known} cells predicted now\n"
          f"predicted frontier: {board}")
    return 0


def _predicted_hints(fit_dir: Path) -> fit.Hints:
    """The newest predicted frontier of the matrix (by when its fake runs ran), if there is one: where each
    real search starts, at the largest size it predicted."""
    newest = fitreport.predicted_before(fit_dir, pd.Timestamp.now(tz="UTC"))
    if newest is None:
        return {}
    print(f"starting each search at the predicted frontier of {newest.run_id}")
    return {search: int(answer) for search, answer in newest.answers.items() if answer.isdigit()}


def _gpu_kind(key: str) -> gpus.GpuKind:
    try:
        return gpus.get(key)
    except KeyError as err:
        raise spec.SpecError(str(err.args[0])) from None


def cmd_overhead(args: argparse.Namespace) -> int:
    parquet = args.results_dir / args.matrix / "runs" / f"{args.run_id}.parquet"
    if not parquet.exists():
        raise spec.SpecError(f"no run {args.run_id!r} of matrix {args.matrix!r}: {parquet} does not exist")
    frame = results.read_parquet(parquet)
    rows = overhead.compare_with_bare_loop(frame, args.only)
    if not rows:
        raise spec.SpecError(f"no ok baseline GPU cell in {parquet}" + (f" matching {args.only!r}" if args.only else ""))
    out = args.results_dir / args.matrix / "overhead" / f"{args.run_id}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(overhead.markdown(rows, frame))
    print(out.read_text())
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    host = envinfo.host_caps()
    print(json.dumps({"cuda_devices": host.cuda_devices, "optional_packages": sorted(host.packages),
                      **envinfo.provenance(host)}, indent=2, default=str))
    return 0


def _nothing_runnable(args: argparse.Namespace, matrix: spec.MatrixSpec, planned: list[cells.PlannedCell],
                      host: envinfo.HostCaps) -> int:
    reasons = sorted({pc.skip_reason for pc in planned if pc.skip_reason})
    here = [name for name, m in spec.load(args.matrix_file).items()
            if any(pc.skip_reason is None for pc in cells.plan(m, host))]
    print(f"error: no cell of matrix {matrix.name!r} can run on this machine: {'; '.join(reasons)}.\n"
          f"Matrices that run here: {', '.join(here) or 'none'} (e.g. `make bench MATRIX={here[0] if here else 'smoke'}`). "
          f"`python -m bench list {matrix.name}` shows the plan.", file=sys.stderr)
    return 2


def _prefork(value: str) -> int | None:
    """--prefork: how many workers to start ahead of their cells; None for auto (the device decides)."""
    named = {"auto": None, "on": runner.PREFORK_AHEAD, "off": 0}
    if value in named:
        return named[value]
    if not value.isdigit():
        raise spec.SpecError(f"--prefork takes auto, on, off or a number of workers ahead, not {value!r}")
    return int(value)


def _default_run_id(matrix: str, device: str, provenance: dict, fresh: bool) -> str:
    name = str(provenance.get("gpu_name") or "")
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    where = found.group(1).lower() if device == "cuda" and found else device
    now = dt.datetime.now(dt.UTC)
    stamp = now.strftime("%Y%m%d-%H%M%S") if fresh else now.strftime("%Y%m%d")
    return f"{matrix}-{where}-{stamp}"



