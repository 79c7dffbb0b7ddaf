"""The runner: walks a plan, runs each cell in a fresh worker process, records every outcome.

- One OS process per cell, in its own process group: allocator state, monkey-patches and
  distributed state never leak between cells, and a timeout kills the whole group.
- Each finished cell is one JSON file written atomically, so killing the runner (even kill -9)
  loses at most the cell in flight; a re-run with the same run id skips finished cells.
- Workers die with the runner (PR_SET_PDEATHSIG), so a killed run leaves nothing on the GPU.
- After an OOM at batch b, larger batches of the same model/seq/stack are recorded as skipped.
- With `prefork` N, the workers of the next N cells are started while the current one runs: each
  imports torch and transformers (13 s on an H200 host) and waits, without a CUDA context, until its
  cell is handed over. One ahead is not enough where cells are shorter than the imports (`Spares`).
- A cell of several GPUs runs under torchrun (one worker per rank, the request in a file); its
  ranks' rows are merged into one (bench/ranks.py). torchrun's rendezvous is what would carry a
  cell across nodes; here every cell runs on this host (--standalone).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fnmatch
import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from . import checkpoints, distributed, hashseed, prebuild, ranks, results
from .cells import Cell, Group, PlannedCell
from .envinfo import REPO
from .stacks import parse_stack
from .worker import PRELOAD_MODEL_ENV, PRELOAD_MODULES_ENV

HOST_OOM_CODES = (-signal.SIGKILL, 128 + signal.SIGKILL)  # killed by SIGKILL: the kernel's OOM killer
RANK_SIGKILLED = re.compile(r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)")  # torchrun's report of a rank killed so
LOG_TAIL_LINES = 15
PREFORK_AHEAD = 3  # workers started ahead with --prefork on (and auto, on a GPU): see Spares


@dataclass(frozen=True)
class RunOptions:
    results_dir: Path
    run_id: str
    prune_after_oom: bool = True
    redo: frozenset[str] = frozenset()  # re-run cells whose recorded status is one of these ("all": any)
    only: str | None = None  # fnmatch pattern on cell ids
    prefork: int = 0  # how many of the next cells' workers are started ahead of them (0: none)
    stop_at: float | None = None  # epoch seconds: no cell starts that its stack's earlier rows say would end after


@dataclass
class Worker:
    cell: Cell
    proc: subprocess.Popen
    log: IO[bytes]


class Progress(Protocol):
    def start(self, total: int) -> None: ...
    def cell_started(self, cell: Cell) -> None: ...
    def cell_finished(self, cell: Cell, row: dict[str, Any]) -> None: ...


def run(planned: list[PlannedCell], opts: RunOptions, provenance: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Runs every cell of the plan not yet finished; returns the run's rows (cell_id -> row)."""
    raw_dir = opts.results_dir / "raw" / opts.run_id
    with results.run_lock(raw_dir):
        raw = results.read_raw(raw_dir)
        broken = {path.stem for path in (raw_dir / "broken").glob("*.json")}  # set aside: those cells run again
        published = {k: r for k, r in results.published_rows(opts.results_dir, opts.run_id).items() if k not in broken}
        rows = {**published, **raw}
        return _run(planned, rows, raw_dir, opts, provenance, progress)


def _run(planned: list[PlannedCell], rows: dict[str, dict[str, Any]], raw_dir: Path, opts: RunOptions,
         provenance: dict[str, Any], progress: Progress) -> dict[str, Any]:
    oom_batch = _oom_batches(planned, rows)
    todo = [pc for pc in planned if _wanted(pc, rows, opts)]
    _prebuild_ops([pc.cell for pc in todo if not pc.skip_reason])
    for line in checkpoints.prepare(pc.cell for pc in todo if not pc.skip_reason):
        print(line, file=sys.stderr, flush=True)
    progress.start(len(todo))
    spares = Spares(raw_dir)
    try:
        for index, pc in enumerate(todo):
            cell = pc.cell
            reason = pc.skip_reason or _pruned(cell, oom_batch, opts)
            progress.cell_started(cell)
            base = _base_row(cell, opts, provenance)
            if reason:
                row = base | {"status": "skipped", "skip_reason": reason}
            elif _past_deadline(cell, rows, opts.stop_at):
                break  # the cells left run in the next window: nothing of this one has started
            else:
                request = _request(cell, raw_dir)
                worker = spares.take(cell)
                base = base | {"preforked": worker is not None}
                worker = worker or _spawn(cell, raw_dir, request)
                upcoming = _runnable(todo[index + 1:], oom_batch, opts)
                row = _finish(worker, request, base, raw_dir, on_handover=functools.partial(spares.start, upcoming))
            results.write_atomic(raw_dir / f"{cell.row_key}.json", row)
            rows[cell.row_key] = row
            if row["status"] == "oom":
                oom_batch[cell.group] = min(cell.batch_size, oom_batch.get(cell.group, cell.batch_size))
            progress.cell_finished(cell, row)
    finally:
        spares.discard_all()
    return rows


class Spares:
    """Workers started ahead of their cells, each importing while the cells before it run.

    Why several: on an H200 host a worker's imports took 11-15 s while most cells ran for 4-10 s after
    their handover, so with one worker ahead the cells of llama3b-h200-20261127 waited 44 s of their
    121 s for imports. Started N cells early (--prefork N), a worker has the time of N cells to import.
    Each costs an idle interpreter's host RAM while it waits (on this 2-core CPU host, torch 2.13 for CPU:
    429 MB with Llama's code imported, 484 MB with peft, bitsandbytes and Liger too), and makes no CUDA
    context, so the running cell's device figures are its own (each row's `context_before_cell` checks it)."""

    def __init__(self, raw_dir: Path):
        self.raw_dir = raw_dir
        self.waiting: dict[str, Worker] = {}  # row key -> its worker

    def take(self, cell: Cell) -> Worker | None:
        """The worker started for this cell, if one was."""
        return self.waiting.pop(cell.row_key, None)

    def start(self, upcoming: list[Cell]) -> None:
        """Workers for the upcoming cells that lack one; those of cells no longer upcoming (pruned after
        an OOM) are stopped. torchrun starts a cell of several GPUs itself."""
        wanted = [c for c in upcoming if c.gpus == 1]
        for key in set(self.waiting) - {c.row_key for c in wanted}:
            _discard(self.waiting.pop(key))
        for c in wanted:
            if c.row_key not in self.waiting:
                self.waiting[c.row_key] = _spawn(c, self.raw_dir)

    def discard_all(self) -> None:
        for worker in self.waiting.values():
            _discard(worker)
        self.waiting.clear()


def _past_deadline(cell: Cell, rows: dict[str, dict[str, Any]], stop_at: float | None) -> bool:
    """Whether the cell would end after `stop_at`, by its expected wall time (`expected_wall_s`): a lent GPU's
    window cut in a cell loses all of it (an offload cell took 113 s, its first 91 s lost, on the H200)."""
    if stop_at is None:
        return False
    expected_s = expected_wall_s(cell, rows)
    if time.time() + expected_s <= stop_at:
        return False
    print(f"stopped before {cell.cell_id}: it takes about {expected_s:.0f} s, {max(stop_at - time.time(), 0):.0f} s "
          "are left before --stop-at", file=sys.stderr, flush=True)
    return True


def expected_wall_s(cell: Cell, rows: dict[str, dict[str, Any]]) -> float:
    """The median wall time of the run's rows of the cell's stack; else of stacks of the same techniques
    but checkpointing (which changes the step, not the engine's build and teardown); else 0 (unknown)."""
    def techniques(label: str) -> frozenset[str]:
        return frozenset(parse_stack(label).names) - {"gc"}

    walls = [r["wall_s"] for r in rows.values() if r.get("stack") == cell.stack.label and r.get("wall_s")]
    if not walls:
        mine = techniques(cell.stack.label)
        walls = [r["wall_s"] for r in rows.values() if r.get("wall_s") and r.get("stack")
                 and techniques(str(r["stack"])) == mine]
    return float(statistics.median(walls)) if walls else 0.0


def _prebuild_ops(cells: list[Cell]) -> None:
    """The JIT-built ops the cells need, compiled before the first one (see bench/prebuild.py). A failed
    build is only reported: the cells that need the op record their own error, the others run."""
    names = prebuild.ops_needed(cells)
    if names:
        print(f"building DeepSpeed ops before the first cell: {', '.join(names)}", file=sys.stderr, flush=True)
        failed = prebuild.build(names)
        if failed:
            print(failed, file=sys.stderr, flush=True)


def _wanted(pc: PlannedCell, rows: dict[str, dict[str, Any]], opts: RunOptions) -> bool:
    key = pc.cell.row_key
    if opts.only and not any(fnmatch.fnmatch(pc.cell.cell_id, g) for g in opts.only.split(",")):
        return False
    return key not in rows or rows[key]["status"] in opts.redo or "all" in opts.redo


def _oom_batches(planned: list[PlannedCell], rows: dict[str, dict[str, Any]]) -> dict[Group, int]:
    """The smallest batch that ran out of memory in each group of the plan, from the rows recorded so far."""
    smallest: dict[Group, int] = {}
    for pc in planned:
        row = rows.get(pc.cell.row_key)
        if row is not None and row["status"] == "oom":
            group, batch = pc.cell.group, pc.cell.batch_size
            smallest[group] = min(batch, smallest.get(group, batch))
    return smallest


def _pruned(cell: Cell, oom_batch: dict[Group, int], opts: RunOptions) -> str | None:
    b = oom_batch.get(cell.group)
    # Repeats of a cell that OOMed would OOM again: they are pruned with the larger batches.
    if opts.prune_after_oom and b is not None and (cell.batch_size > b or (cell.repeat and cell.batch_size == b)):
        return f"pruned: OOM at batch {b} for this model/seq/stack"
    return None


def _runnable(rest: list[PlannedCell], oom_batch: dict, opts: RunOptions) -> list[Cell]:
    """The cells of `rest` that will run as things stand (not skipped, not pruned): at most `prefork`."""
    cells: list[Cell] = []
    for pc in rest:
        if len(cells) >= opts.prefork:
            break
        if not pc.skip_reason and not _pruned(pc.cell, oom_batch, opts):
            cells.append(pc.cell)
    return cells


def _base_row(cell: Cell, opts: RunOptions, provenance: dict[str, Any]) -> dict[str, Any]:
    c = cell.to_json()
    return {
        **provenance,
        "schema_version": results.SCHEMA_VERSION,
        "run_id": opts.run_id,
        **{k: c[k] for k in ("cell_id", "repeat", "budget_gib", "checkpoint", "matrix", "model", "seq_len",
                             "batch_size", "gpus", "stack", "device", "warmup_steps", "measure_steps", "seed")},
        "stack_json": json.dumps(c["stack_uses"], sort_keys=True),
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "rerun_cmd": f"python -m bench run {cell.matrix} --run-id {opts.run_id} --only '{cell.cell_id}' --redo all",
    }


def _cell_env(cell: Cell) -> dict[str, str]:
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",  # models come from shipped configs; never reach for a hub
        hashseed.ENV: hashseed.HASH_SEED,  # set iteration order, hence allocation order, the same every run
        PRELOAD_MODEL_ENV: cell.model,  # the worker imports this model family's code before its cell
        PRELOAD_MODULES_ENV: ",".join(cell.stack.preload),  # and the slow imports of its stack's builds
    }
    env.update(cell.stack.env)
    if cell.gpus > 1:  # torchrun sets the ranks' own
        for key in distributed.SINGLE_RANK_ENV:
            env.pop(key, None)
    return env


def _request(cell: Cell, raw_dir: Path) -> dict[str, Any]:
    """What a worker is handed: the cell, where to write what it measured, and when (epoch s: the
    worker tells how much of its imports the cell waited for)."""
    out = raw_dir / f".{cell.row_key}.worker.json"
    for stale in (out, *(results.rank_path(out, r) for r in range(cell.gpus))):
        stale.unlink(missing_ok=True)
    return {"cell": cell.to_json(), "out": str(out), "handed_over_at": time.time()}


def _spawn(cell: Cell, raw_dir: Path, request: dict[str, Any] | None = None) -> Worker:
    """A worker waiting on stdin for its request; for several GPUs, torchrun with the request in a file."""
    log_path = raw_dir / "logs" / f"{cell.row_key}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "bench.worker"]
    if cell.gpus > 1:
        assert request is not None, "a torchrun cell is never preforked"
        request_path = raw_dir / f".{cell.row_key}.request.json"
        request_path.write_text(json.dumps(request))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cell.gpus}",
                   "-m", "bench.worker", "--request", str(request_path)]
    log = open(log_path, "wb")  # noqa: SIM115 (closed by _finish / _discard)
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE if cell.gpus == 1 else subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, **_cell_env(cell)}, cwd=REPO,
        start_new_session=True,  # its own process group: a timeout kills it and its children
        preexec_fn=distributed.die_with_parent,
    )
    return Worker(cell, proc, log)


def _discard(worker: Worker | None) -> None:
    if worker is None:
        return
    _kill_group(worker.proc)
    worker.log.close()
    Path(worker.log.name).unlink(missing_ok=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """The worker, its process group, and every descendant: torchrun's ranks run in groups of their own."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            child.kill()
    proc.wait()


def _finish(worker: Worker, request: dict[str, Any], base: dict[str, Any], raw_dir: Path,
            on_handover: Callable[[], None]) -> dict[str, Any]:
    """Hands the cell to its worker, calls `on_handover` (which starts the next cells' workers), waits;
    returns `base` (what the runner knows of the cell) with what the worker measured, or how it ended."""
    cell, proc = worker.cell, worker.proc
    out = Path(request["out"])
    started = time.monotonic()
    if proc.stdin is not None:
        try:
            proc.stdin.write((json.dumps(request | {"handed_over_at": time.time()}) + "\n").encode())
            proc.stdin.close()
        except BrokenPipeError:  # the worker died while importing: its log says why
            pass
    on_handover()
    try:
        proc.wait(timeout=cell.timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        timed_out = True
    exited_at = time.time()
    worker.log.close()
    wall_s = time.monotonic() - started
    (raw_dir / f".{cell.row_key}.request.json").unlink(missing_ok=True)
    teardown_s = _teardown_s(out, cell.gpus, exited_at)
    row = _row_of(worker, base, out, timed_out)
    if cell.gpus > 1 and row["status"] == "error" and RANK_SIGKILLED.search(_log_tail(worker, 200)):
        row = row | {"status": "host_oom", "error": "a rank was killed by SIGKILL: most likely the kernel's OOM "
                                                    f"killer, out of host RAM\n{row['error']}"}
    return row | {"wall_s": wall_s, "teardown_s": teardown_s}


def _teardown_s(out: Path, gpus: int, exited_at: float) -> float | None:
    """From the worker's result written (its file's time) to the process's exit: CUDA, NCCL and the
    interpreter shutting down. The last rank's file for a torchrun cell; None without a result."""
    written = [p.stat().st_mtime for p in (out, *(results.rank_path(out, r) for r in range(gpus))) if p.exists()]
    return max(0.0, exited_at - max(written)) if written else None


def _row_of(worker: Worker, base: dict[str, Any], out: Path, timed_out: bool) -> dict[str, Any]:
    """The cell's row from what its worker (or its ranks) wrote, or from how the process ended."""
    cell, proc = worker.cell, worker.proc
    rank_rows = _rank_rows(out, cell.gpus) if cell.gpus > 1 else {}
    if rank_rows:
        row = ranks.merge(base, rank_rows, cell.gpus)  # every rank's row: ok, even if one then hung exiting
        if timed_out and row["status"] == "error":  # no rank failed: the missing ones were still running
            row = row | {"status": "timeout",
                         "error": f"killed after {cell.timeout_s:.0f} s{prebuild.held_build_locks()}\n{row['error']}"}
        return row
    if out.exists():  # the worker's own measurements win, even if it hung while exiting
        row = base | json.loads(out.read_text())
        out.unlink()
        return row
    if timed_out:
        return base | {"status": "timeout", "error": f"killed after {cell.timeout_s:.0f} s{prebuild.held_build_locks()}\n"
                                                     + _log_tail(worker)}
    if proc.returncode in HOST_OOM_CODES:
        return base | {"status": "host_oom",
                       "error": f"worker killed by SIGKILL (exit {proc.returncode}): most likely the kernel's "
                                f"OOM killer, out of host RAM\n" + _log_tail(worker)}
    return base | {"status": "error", "error": f"worker exited {proc.returncode} without a result\n" + _log_tail(worker)}


def _rank_rows(out: Path, world: int) -> dict[int, dict[str, Any]]:
    """The rows the ranks wrote (rank -> row), the files removed."""
    found = {}
    for r in range(world):
        path = results.rank_path(out, r)
        if path.exists():
            found[r] = json.loads(path.read_text())
            path.unlink()
    return found


def _log_tail(worker: Worker, lines: int = LOG_TAIL_LINES) -> str:
    text = Path(worker.log.name).read_text(errors="replace").strip().splitlines()
    return "\n".join(text[-lines:])


def summarize(rows: dict[str, dict[str, Any]], planned: list[PlannedCell]) -> Counter:
    ids = {pc.cell.row_key for pc in planned}
    return Counter(r["status"] for cid, r in rows.items() if cid in ids)
