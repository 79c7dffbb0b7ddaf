"""The runner end to end on the CPU: real tiny training runs, in worker processes, as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import REPO, bench_args, raw_rows, run_bench, write_matrix

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # real worker processes, tens of seconds each

TINY = """
matrices:
  tiny:
    device: cpu
    models: [tiny-llama]
    seq_lens: [32]
    batch_sizes: [1, 2]
    stacks: [baseline, gc, lora, mixed]
    ladder: [baseline, gc]
    steps: {warmup: 2, measure: 3}
    timeout_s: 120
"""


def test_tiny_matrix_end_to_end_then_resume_runs_nothing(workdir: Path) -> None:
    write_matrix(workdir, TINY)
    first = run_bench(workdir, "run", "tiny", "--run-id", "t1", "--prefork", "on")
    assert first.returncode == 0, first.stdout + first.stderr
    rows = raw_rows(workdir, "t1")
    assert len(rows) == 8
    assert {r["status"] for r in rows.values()} == {"ok"}, [r["error"] for r in rows.values()]
    assert {r["python_hash_seed"] for r in rows.values()} == {"0"}  # each worker's own (bench/hashseed.py)

    table = pd.read_parquet(workdir / "results" / "tiny" / "runs" / "t1.parquet")
    assert len(table) == 8 and (table.tokens_per_s > 0).all() and (table.host_rss_peak_gib > 0).all()
    board = (workdir / "results" / "tiny" / "LEADERBOARD.md").read_text()
    assert "## tiny-llama · seq 32" in board and "`gc + lora`" not in board and "`lora`" in board
    assert "python -m bench run tiny --run-id t1" in board
    assert "Cumulative ladder at batch 2:" in board and "| 1 | `gc` |" in board
    assert (workdir / "results" / "tiny" / "plots" / "tiny-llama_tokens_vs_memory.png").stat().st_size > 10_000
    _check_where_the_time_went(table, board)

    mtimes = {p.name: p.stat().st_mtime_ns for p in (workdir / "results" / "raw" / "t1").glob("*.json")}
    again = run_bench(workdir, "run", "tiny", "--run-id", "t1")
    assert again.returncode == 0
    assert {p.name: p.stat().st_mtime_ns for p in (workdir / "results" / "raw" / "t1").glob("*.json")} == mtimes
    assert "done: 8 ok" in again.stdout


def test_a_run_with_a_deadline_starts_no_cell_that_would_end_after_it_and_goes_on_later(workdir: Path) -> None:
    """--stop-at (tools/gpu-window.sh passes its window's end): a cell whose stack's earlier rows say it would
    end after the deadline is not started; the run exits 124 with the cells left, and the same command
    later goes on from there. A stack with no earlier row starts (nothing is known of it)."""
    import time

    write_matrix(workdir, TINY.replace("stacks: [baseline, gc, lora, mixed]", "stacks: [baseline]")
                 .replace("ladder: [baseline, gc]", "ladder: [baseline]"))
    early = run_bench(workdir, "run", "tiny", "--run-id", "d", "--stop-at", str(time.time() + 600), "--only", "*_b1_*")
    assert early.returncode == 0, early.stdout + early.stderr  # one cell, ten minutes to spare
    [first] = raw_rows(workdir, "d").values()
    deadline = time.time() + first["wall_s"] / 2  # less than the next cell of its stack is expected to take
    stopped = run_bench(workdir, "run", "tiny", "--run-id", "d", "--stop-at", str(deadline))
    assert stopped.returncode == 124, stopped.stdout + stopped.stderr
    assert "stopped before tiny-llama_s32_b2_baseline" in stopped.stderr and "1 cells left" in stopped.stdout
    assert len(raw_rows(workdir, "d")) == 1
    later = run_bench(workdir, "run", "tiny", "--run-id", "d")
    assert later.returncode == 0 and "done: 2 ok" in later.stdout


def _check_where_the_time_went(table: pd.DataFrame, board: str) -> None:
    """Each cell's wall time is accounted for by its stages, up to what the worker spends measuring."""
    stages = ["imports_wait_s", "build_s", "first_step_s", "warmup_s", "measured_s", "teardown_s"]
    assert (table[[*stages, "imports_s"]] >= 0).all().all() and (table["build_s"] > 0).all()
    assert list(table.sort_values("started_at")["preforked"])[:2] == [False, True]  # the first has no predecessor
    assert (table["imports_wait_s"] <= table["imports_s"] + 0.01).all()
    unaccounted = table["wall_s"] - table[stages].sum(axis=1)
    assert (unaccounted > -0.05).all() and (unaccounted < (0.25 * table["wall_s"]).clip(lower=1.5)).all(), \
        table[["wall_s", *stages]]
    assert "## Where the time went" in board and "wall / measured = " in board


def test_shards_split_a_matrix_by_group_and_report_merges_them(workdir: Path) -> None:
    write_matrix(workdir, TINY.replace("batch_sizes: [1, 2]", "batch_sizes: [1]"))
    for i in (1, 2):
        proc = run_bench(workdir, "run", "tiny", "--run-id", f"sh{i}", "--shard", f"{i}/2")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    shards = [set(raw_rows(workdir, f"sh{i}")) for i in (1, 2)]
    assert all(shards) and not shards[0] & shards[1]  # this matrix's 4 groups land on both shards
    merged = run_bench(workdir, "report", "tiny", "--run-id", "sh*", "--into", "all")
    assert merged.returncode == 0, merged.stderr
    table = pd.read_parquet(workdir / "results" / "tiny" / "runs" / "all.parquet")
    assert set(table["cell_id"]) == shards[0] | shards[1] and len(table) == 4 and set(table["run_id"]) == {"all"}
    assert "Coverage: 4 of the 4 cells" in (workdir / "results" / "tiny" / "runs" / "all.md").read_text()
    again = run_bench(workdir, "report", "tiny", "--run-id", "*", "--into", "all")  # the glob matches `all` too
    assert again.returncode == 0 and "merging 2 runs: sh1, sh2" in again.stdout, again.stderr


def test_stacks_prove_they_applied_and_exact_ones_keep_the_losses(workdir: Path) -> None:
    """gc recomputes the same math: same losses as baseline. LoRA trains a small fraction."""
    stacks = "stacks: [baseline, gc, lora, mixed, dynamic_padding(order=sorted)]"
    matrix = TINY.replace("batch_sizes: [1, 2]", "batch_sizes: [2]")
    write_matrix(workdir, matrix.replace("stacks: [baseline, gc, lora, mixed]", stacks))
    proc = run_bench(workdir, "run", "tiny", "--run-id", "t2", "--prefork", "on")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_stack = {r["stack"]: r for r in raw_rows(workdir, "t2").values()}
    losses = {s: json.loads(r["losses_json"]) for s, r in by_stack.items()}
    assert len(losses["baseline"]) == 5
    assert losses["gc"] == pytest.approx(losses["baseline"], rel=1e-2)
    assert json.loads(by_stack["gc"]["evidence_json"])["gc_modules"] > 0
    assert json.loads(by_stack["lora"]["evidence_json"])["lora_modules"] > 0
    lora = by_stack["lora"]
    assert 0 < lora["trainable_params"] < 0.5 * lora["total_params"]
    assert by_stack["baseline"]["trainable_params"] == by_stack["baseline"]["total_params"]
    assert by_stack["mixed"]["weights_gib"] == pytest.approx(2 * by_stack["baseline"]["weights_gib"])
    # dynamic padding: every step in the trace, its batch as long as its longest document, growing (sorted)
    dynamic = by_stack["dynamic_padding(order=sorted)"]
    trace = json.loads(dynamic["step_trace_json"])
    assert [t["stage"] for t in trace] == ["first_step", "warmup", "measure", "measure", "measure"]
    measured_ms = sorted(t["ms"] for t in trace[2:])  # each step timed; the measured ones are step_ms_*
    assert all(t["ms"] > 0 for t in trace) and measured_ms[1] == pytest.approx(dynamic["step_ms_p50"], rel=1e-6)
    widths = [t["positions"] for t in trace]
    assert widths == sorted(widths) and widths[-1] <= 32 and len(set(widths)) > 1
    assert dynamic["tokens_per_step"] == round(2 * sum(widths[2:]) / 3) < 2 * 32
    assert dynamic["useful_tokens_per_step"] <= dynamic["tokens_per_step"]


FAULTS = """
matrices:
  faults:
    device: cpu
    models: [tiny-llama]
    seq_lens: [32]
    batch_sizes: [1, 2]
    stacks: [fault(mode=raise), fault(mode=oom), fault(mode=exit137), fault(mode=sigkill), fault(mode=hang)]
    exclude: [{batch_size: 2, stack: fault}, {batch_size: 2, stack: fault(mode=exit137)},
              {batch_size: 2, stack: fault(mode=sigkill)}, {batch_size: 2, stack: fault(mode=hang)}]
    steps: {warmup: 1, measure: 1}
    timeout_s: 30
"""


def test_every_failure_becomes_its_row(workdir: Path) -> None:
    write_matrix(workdir, FAULTS)
    proc = run_bench(workdir, "run", "faults", "--run-id", "f")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # an error cell makes the run exit 1
    rows = {(r["stack"], r["batch_size"]): r for r in raw_rows(workdir, "f").values()}
    assert len(rows) == 10

    raised = rows[("fault", 1)]
    assert raised["status"] == "error" and "injected failure" in raised["error"]
    oom = rows[("fault(mode=oom)", 1)]
    assert oom["status"] == "oom" and oom["oom_phase"] == "first_step/forward"
    assert rows[("fault(mode=oom)", 2)]["skip_reason"] == "pruned: OOM at batch 1 for this model/seq/stack"
    for mode in ("exit137", "sigkill"):
        assert rows[(f"fault(mode={mode})", 1)]["status"] == "host_oom"
    hang = rows[("fault(mode=hang)", 1)]
    assert hang["status"] == "timeout" and 30 <= hang["wall_s"] < 60
    assert rows[("fault(mode=hang)", 2)]["skip_reason"] == "excluded by faults.exclude[3]"
    board = (workdir / "results" / "faults" / "LEADERBOARD.md").read_text()
    assert "OOM (first_step/forward)" in board and "host_oom" in board and "timeout" in board


def test_no_prune_runs_larger_batches_after_an_oom(workdir: Path) -> None:
    # no cell here hangs, so the timeout only has to outlast a worker's imports on two busy cores (30 s did not
    # always, beside a second job): a timeout would hide the OOM this test is about
    matrix = FAULTS.replace("fault(mode=raise), ", "").replace("exclude: [{batch_size: 2, stack: fault},", "exclude: [")
    write_matrix(workdir, matrix.replace("timeout_s: 30", "timeout_s: 300"))
    proc = run_bench(workdir, "run", "faults", "--run-id", "np", "--no-prune", "--only", "*fault-mode-oom*")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(r["status"] for r in raw_rows(workdir, "np").values()) == ["oom", "oom"]


def test_workers_started_ahead_wait_for_their_cells_and_those_of_pruned_cells_are_stopped(workdir: Path) -> None:
    """--prefork 3: every cell after the first finds its worker already started; after an OOM at batch 2 the
    worker started for batch 4 (pruned) is stopped, and none outlives the run."""
    write_matrix(workdir, TINY.replace("batch_sizes: [1, 2]", "batch_sizes: [1, 2, 4]").replace(
        "[baseline, gc, lora, mixed]", "[baseline, 'fault(mode=oom, over_tokens=32)']").replace(
        "ladder: [baseline, gc]", "ladder: [baseline]"))
    log = workdir / "run.log"
    with log.open("w") as out:
        proc = subprocess.Popen(bench_args(workdir, "run", "tiny", "--run-id", "ahead", "--prefork", "3"), cwd=REPO,
                                env={**os.environ, "BENCH_TEST_TECHNIQUES": "1"}, stdout=out, stderr=subprocess.STDOUT)
        most_alive = 0
        while proc.poll() is None:
            most_alive = max(most_alive, len(_workers_of(workdir)))
            time.sleep(0.2)
    assert proc.returncode == 0, log.read_text()
    assert most_alive == 4  # the cell running and the workers of the next 3
    rows = sorted(raw_rows(workdir, "ahead").values(), key=lambda r: r["started_at"])
    outcome = {(r["stack"], r["batch_size"]): r["status"] for r in rows}
    assert outcome == {("baseline", 1): "ok", ("baseline", 2): "ok", ("baseline", 4): "ok",
                       ("fault(mode=oom, over_tokens=32)", 1): "ok", ("fault(mode=oom, over_tokens=32)", 2): "oom",
                       ("fault(mode=oom, over_tokens=32)", 4): "skipped"}
    ran = [r for r in rows if r["status"] != "skipped"]
    assert [r["preforked"] for r in ran] == [False] + [True] * (len(ran) - 1)
    assert all(r["imports_wait_s"] <= r["imports_s"] for r in ran)
    logs = {p.stem for p in (workdir / "results" / "raw" / "ahead" / "logs").glob("*.log")}
    assert logs == {r["cell_id"] for r in ran}  # the pruned cell's worker was stopped, its log removed
    assert not _workers_of(workdir)


def test_prefork_takes_a_number_of_workers_and_refuses_anything_else(workdir: Path) -> None:
    write_matrix(workdir, TINY)
    proc = run_bench(workdir, "run", "tiny", "--run-id", "bad", "--prefork", "many")
    assert proc.returncode == 2 and "--prefork takes auto, on, off or a number" in proc.stderr, proc.stderr
    assert not (workdir / "results" / "raw" / "bad").exists()


def test_killed_runner_loses_at_most_the_cell_in_flight(workdir: Path) -> None:
    write_matrix(workdir, TINY.replace("batch_sizes: [1, 2]", "batch_sizes: [1, 2, 4]").replace(
        "[baseline, gc, lora, mixed]", "[baseline, gc]"))
    raw = workdir / "results" / "raw" / "k"
    runner = subprocess.Popen(bench_args(workdir, "run", "tiny", "--run-id", "k"), cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(_rows(raw)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(runner.pid, signal.SIGKILL)  # the runner only: its worker must die with it
    runner.wait()
    finished = _rows(raw)
    assert 2 <= len(finished) < 6

    time.sleep(1)
    assert not _workers_of(workdir), "a worker outlived its killed runner"
    resumed = run_bench(workdir, "run", "tiny", "--run-id", "k")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    after = _rows(raw)
    assert len(after) == 6 and all(after[name] == data for name, data in finished.items())
    assert {json.loads(d)["status"] for d in after.values()} == {"ok"}


def _rows(raw: Path) -> dict[str, bytes]:
    """The run's row files (a dotfile is a worker's or a temporary file, never a row)."""
    return {p.name: p.read_bytes() for p in raw.glob("*.json") if not p.name.startswith(".")}


def _workers_of(workdir: Path) -> list[int]:
    """Worker processes still alive whose log sits under this test's results dir."""
    alive = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            fds = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        if b"bench.worker" in cmdline and any(str(workdir) in fd for fd in fds):
            alive.append(int(proc.name))
    return alive


def test_repeats_run_in_fresh_processes_and_are_folded_in_the_report(workdir: Path) -> None:
    write_matrix(workdir, TINY.replace("batch_sizes: [1, 2]", "batch_sizes: [2]").replace(
        "[baseline, gc, lora, mixed]", "[baseline]").replace("    ladder: [baseline, gc]\n", ""))
    proc = run_bench(workdir, "run", "tiny", "--run-id", "rep", "--repeats", "3", "--prefork", "on")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = raw_rows(workdir, "rep")
    assert len(rows) == 3 and len({r["cell_id"] for r in rows.values()}) == 1
    assert sorted(r["repeat"] for r in rows.values()) == [0, 1, 2]
    assert len({r["started_at"] + str(r["wall_s"]) for r in rows.values()}) == 3
    table = pd.read_parquet(workdir / "results" / "tiny" / "runs" / "rep.parquet")
    assert sorted(table["repeat"]) == [0, 1, 2]
    board = (workdir / "results" / "tiny" / "LEADERBOARD.md").read_text()
    assert "## Repeatability" in board and "| 3 |" in board and "3 runs with repeats" in board
    again = run_bench(workdir, "run", "tiny", "--run-id", "rep", "--repeats", "3")
    assert "done: 3 ok" in again.stdout
