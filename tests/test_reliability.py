"""What an adversary found: paths out of results/, two runners, broken raw files, a new machine's
resume, bad input that ran, faults with the wrong status. Each case as a user meets it, through the CLI."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from bench import cli
from conftest import REPO, bench_args, raw_rows, run_bench, write_matrix

pytestmark = pytest.mark.timeout(600)

TINY = """
matrices:
  t:
    device: cpu
    models: [tiny-llama]
    seq_lens: [32]
    batch_sizes: [1, 2]
    stacks: [baseline]
    steps: {warmup: 1, measure: 2}
    timeout_s: 60
  hang:
    device: cpu
    models: [tiny-llama]
    seq_lens: [32]
    batch_sizes: [1]
    stacks: ["fault(mode=hang)"]
    steps: {warmup: 1, measure: 1}
    timeout_s: 60
  faults:
    device: cpu
    models: [tiny-llama]
    seq_lens: [32]
    batch_sizes: [1]
    gpus: [1, 2]
    stacks: ["fault(mode=alloc)", "fsdp + fault(mode=sigkill, only_rank=1)"]
    exclude: [{gpus: 2, stack: "fault(mode=alloc)"}, {gpus: 1, stack: "fsdp + fault(mode=sigkill, only_rank=1)"}]
    steps: {warmup: 1, measure: 1}
    timeout_s: 120
"""


def test_names_that_would_write_outside_results_are_refused(workdir: Path) -> None:
    write_matrix(workdir, TINY)
    for args in (("run", "t", "--run-id", "../../../x"), ("run", "t", "--run-id", "sub/dir"),
                 ("report", "t", "--run-id", "../x"), ("predict", "t", "--run-id", ".hidden")):
        proc = run_bench(workdir, *args)
        assert proc.returncode == 2 and "run id" in proc.stderr, (args, proc.stderr)
    assert sorted(p.name for p in workdir.iterdir()) == ["matrix.yaml", "results"]
    assert not list((workdir / "results").iterdir())


@pytest.mark.slow
def test_a_second_runner_on_the_same_run_id_is_refused(workdir: Path) -> None:
    write_matrix(workdir, TINY)
    first = subprocess.Popen(bench_args(workdir, "run", "hang", "--run-id", "h"), cwd=REPO, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lock = workdir / "results" / "raw" / "h" / ".lock"
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        second = run_bench(workdir, "run", "hang", "--run-id", "h")
        assert second.returncode == 2
        assert f"run h is being run by another process (pid {first.pid})" in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    again = run_bench(workdir, "run", "t", "--run-id", "h2")  # the lock dies with its holder: other runs go on
    assert again.returncode == 0, again.stderr


@pytest.mark.slow
def test_a_results_dir_relative_to_another_folder_is_where_the_rows_land(workdir: Path) -> None:
    """`--results-dir results` from a folder other than the suite's: the workers, started in the suite's
    folder, write each cell's row under the same results/ the runner reads."""
    write_matrix(workdir, TINY)
    proc = subprocess.run([sys.executable, "-m", "bench", "--matrix-file", "matrix.yaml", "--results-dir", "results",
                           "run", "t", "--run-id", "rel", "--only", "*_b1_*"], cwd=workdir, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = raw_rows(workdir, "rel")
    assert len(rows) == 1 and all(r["status"] == "ok" for r in rows.values()), rows


@pytest.mark.slow
def test_stray_and_broken_raw_files_cost_only_their_cells(workdir: Path) -> None:
    write_matrix(workdir, TINY)
    assert run_bench(workdir, "run", "t", "--run-id", "r").returncode == 0
    raw = workdir / "results" / "raw" / "r"
    b1, b2 = sorted(p for p in raw.glob("*.json"))
    kept = b1.read_bytes()
    b2.write_text(b2.read_text()[:100])  # truncated (a full disk)
    (raw / ".tmp-abc.json").write_text("")  # an interrupted atomic write
    (raw / f".{b1.stem}.request.json").write_text("{}")  # a torchrun request left by a kill
    (raw / f".{b1.stem}.worker.json").write_text('{"status": "ok"}')  # a worker's measurements, never collected
    (raw / "garbage.json").write_bytes(b"\xff\xfe\x00junk")
    (raw / "bogus.json").write_text(json.dumps({"cell_id": "x", "status": "bogus"}))

    proc = run_bench(workdir, "run", "t", "--run-id", "r")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in (b2.name, "garbage.json", "bogus.json"):
        assert f"{name} is not a result row" in proc.stderr and (raw / "broken" / name).exists()
    assert b1.read_bytes() == kept  # untouched, not re-run
    rows = raw_rows(workdir, "r")
    assert sorted(r["status"] for r in rows.values()) == ["ok", "ok"]  # the truncated cell ran again
    assert "done: 2 ok" in proc.stdout


@pytest.mark.slow
def test_a_published_run_resumes_on_a_machine_without_its_raw_rows(workdir: Path) -> None:
    write_matrix(workdir, TINY)
    assert run_bench(workdir, "run", "t", "--run-id", "pub", "--only", "*_b1_*").returncode == 0
    parquet = workdir / "results" / "t" / "runs" / "pub.parquet"
    first = pd.read_parquet(parquet)
    for path in (workdir / "results" / "raw").rglob("*"):  # a fresh clone has no raw rows
        if path.is_file():
            path.unlink()
    proc = run_bench(workdir, "run", "t", "--run-id", "pub")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = pd.read_parquet(parquet).set_index("cell_id")
    assert len(table) == 2 and (table["status"] == "ok").all()
    kept = first.iloc[0]
    assert table.loc[kept["cell_id"], "started_at"] == kept["started_at"]  # not run again
    assert len(list((workdir / "results" / "raw" / "pub").glob("*.json"))) == 1  # only the new cell ran


@pytest.mark.slow
def test_bad_command_lines_exit_2_and_write_nothing(workdir: Path) -> None:
    write_matrix(workdir, TINY)
    proc = run_bench(workdir, "run", "t", "--run-id", "n", "--only", "nomatch*")
    assert proc.returncode == 2 and "--only 'nomatch*' matches no cell of matrix 't'" in proc.stderr
    assert not (workdir / "results" / "t").exists()
    write_matrix(workdir, TINY + "  other: {device: cpu, models: [tiny-qwen2], seq_lens: [32], batch_sizes: [1], "
                                 "stacks: [baseline], steps: {warmup: 1, measure: 2}}\n")
    assert run_bench(workdir, "run", "t", "--run-id", "a", "--only", "*_b1_*").returncode == 0
    assert run_bench(workdir, "run", "other", "--run-id", "b").returncode == 0
    unrelated = run_bench(workdir, "compare", "a", "b")
    assert unrelated.returncode == 2 and "have no cell in common" in unrelated.stderr


@pytest.mark.slow
def test_host_memory_failures_are_host_oom_on_one_rank_and_under_torchrun(workdir: Path) -> None:
    """A CPU allocation that fails, and a rank the OOM killer's SIGKILL ends: host RAM, not 'error'."""
    write_matrix(workdir, TINY)
    proc = run_bench(workdir, "run", "faults", "--run-id", "f")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["gpus"]: r for r in raw_rows(workdir, "f").values() if r["status"] != "skipped"}
    assert rows[1]["status"] == "host_oom" and "can't allocate memory" in rows[1]["error"]
    assert rows[1]["oom_phase"] == "first_step/forward"
    assert rows[2]["status"] == "host_oom" and rows[2]["error"].startswith("a rank was killed by SIGKILL")


@pytest.mark.slow
def test_a_users_run_never_replaces_or_writes_into_a_published_run(workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Publishing is committing a run's parquet. A user's run then gets its own board and its own
    run id, even on the day of the published run, and the matrix's LEADERBOARD.md stays as published."""
    write_matrix(workdir, TINY)
    first = run_bench(workdir, "run", "t", "--only", "*_b1_*")
    assert first.returncode == 0, first.stderr
    (published,) = (workdir / "results" / "t" / "runs").glob("*.parquet")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(workdir)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", str(published)], check=True)
    subprocess.run([*git, "commit", "-qm", "publish"], check=True)
    board = workdir / "results" / "t" / "LEADERBOARD.md"
    before = board.read_text()

    # Both cells, on the published run's day (held there: CI may cross midnight between the two runs),
    # so its id would be the published one's.
    published_day = dt.datetime.strptime(published.stem.rsplit("-", 1)[1], "%Y%m%d").replace(tzinfo=dt.UTC)
    monkeypatch.setattr(cli, "dt", SimpleNamespace(datetime=_FrozenClock(published_day), UTC=dt.UTC))
    assert cli.main(bench_args(workdir, "run", "t")[3:]) == 0
    assert f"run {published.stem}-local:" in capsys.readouterr().out
    assert (workdir / "results" / "t" / "runs" / f"{published.stem}-local.md").exists()
    assert board.read_text() == before
    assert pd.read_parquet(published)["cell_id"].nunique() == 1  # the published table is untouched


@dataclass(frozen=True)
class _FrozenClock:
    """Stands in for `datetime.datetime` where only `now` is asked for."""

    at: dt.datetime

    def now(self, tz: dt.tzinfo | None = None) -> dt.datetime:
        return self.at.astimezone(tz)


def _planted_build_lock(workdir: Path, monkeypatch: pytest.MonkeyPatch, op_dir: str, age_s: float = 0) -> Path:
    """A build lock as a killed build leaves it, where torch builds under $TORCH_EXTENSIONS_DIR (NAME/lock:
    the pyXY_cpu level exists only under torch's default root)."""
    pytest.importorskip("deepspeed")
    lock = workdir / "ext" / op_dir / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    then = time.time() - age_s
    os.utime(lock, (then, then))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(workdir / "ext"))
    return lock


def _write_ds_matrix(workdir: Path, stack: str, batch_sizes: str, timeout_s: int) -> None:
    write_matrix(workdir, TINY.replace("  hang:", f"  ds:\n    device: cpu\n    models: [tiny-llama]\n    seq_lens: [32]\n"
                                       f"    batch_sizes: {batch_sizes}\n    stacks: [{stack}]\n"
                                       f"    steps: {{warmup: 1, measure: 1}}\n    timeout_s: {timeout_s}\n  hang:"))


@pytest.mark.slow
def test_a_stale_extension_build_lock_is_named_in_the_timed_out_row(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed JIT-builds its CPU communication op on first use; a build killed midway leaves a lock
    every later build waits on. The cell times out, and its row says which file to delete."""
    lock = _planted_build_lock(workdir, monkeypatch, "deepspeed_shm_comm")
    _write_ds_matrix(workdir, "zero2", "[1]", timeout_s=40)
    proc = run_bench(workdir, "run", "ds", "--run-id", "ds")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = raw_rows(workdir, "ds").values()
    assert row["status"] == "timeout" and f"a torch extension build lock is held ({lock})" in row["error"]


@pytest.mark.slow
def test_a_stale_lock_on_an_op_the_cells_need_stops_the_run_before_any_cell(workdir: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`zero2(adam=deepspeed)` needs DeepSpeed's JIT-built FusedAdam: the runner builds it before
    the first cell, so a stale lock (older than any build) is found at once, named, and nothing runs
    (instead of every cell hanging until its timeout)."""
    lock = _planted_build_lock(workdir, monkeypatch, "fused_adam", age_s=3600)
    _write_ds_matrix(workdir, "'zero2(adam=deepspeed)'", "[1, 2]", timeout_s=600)
    proc = run_bench(workdir, "run", "ds", "--run-id", "ds")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "FusedAdamBuilder cannot be built" in proc.stderr and f"lock is held ({lock})" in proc.stderr
    assert not raw_rows(workdir, "ds")


def test_only_cells_that_choose_deepspeeds_adam_need_a_jit_build() -> None:
    from bench import prebuild
    from bench.cells import Cell
    from bench.stacks import parse_stack

    def cell(stack: str, device: str = "cuda") -> Cell:
        return Cell(matrix="m", model="tiny-llama", seq_len=32, batch_size=1, stack=parse_stack(stack), device=device,
                    warmup_steps=1, measure_steps=1, seed=0, timeout_s=60)

    assert prebuild.ops_needed([cell("zero2"), cell("zero3 + offload"), cell("baseline")]) == ()
    assert prebuild.ops_needed([cell("zero3(adam=deepspeed)")]) == ("FusedAdamBuilder",)
    assert prebuild.ops_needed([cell("zero2(adam=deepspeed) + offload"),
                                cell("zero3(adam=deepspeed)", "cpu")]) == ("CPUAdamBuilder", "FusedAdamBuilder")


def test_every_process_of_the_suite_runs_under_one_hash_seed() -> None:
    """A set of strings iterates in hash order, and model code allocates in that order (Gemma 3's RoPE
    tables): a process with its own seed may peak differently. The CLI pins the seed whatever it was
    started with, before anything runs."""
    probe = "from bench import hashseed; hashseed.pin(); print(hash('sliding_attention'))"
    started_with = ({**os.environ, "PYTHONHASHSEED": seed} for seed in ("1", "2", "random"))
    hashes = {subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                             check=True).stdout for env in started_with}
    assert len(hashes) == 1

    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    shown = subprocess.run([sys.executable, "-m", "bench", "env"], cwd=REPO, env=env, capture_output=True, text=True,
                           check=True, timeout=300)
    assert json.loads(shown.stdout)["python_hash_seed"] == "0"
