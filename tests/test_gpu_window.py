"""tools/gpu-window.sh: a lent GPU's window (10 minutes a command, nothing kept between starts) runs the
backlog's steps in order until its budget, tars what it has, and the next window goes on from there."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from conftest import REPO

STEPS = """# a comment, then steps
one: echo one > results/raw/one.txt; echo ${BENCH_STOP_AT:-none} > results/raw/stop_at.txt
fails: exit 3
long: sleep ${LONG_S:-30}; touch results/raw/long.txt
after: touch results/raw/after.txt
"""


def _window(workdir: Path, budget_s: int, **env: str) -> tuple[str, set[str]]:
    """One window in `workdir`; (what it printed, the names in the tarball it left in $OUT)."""
    out = workdir / "out"
    done = subprocess.run([str(REPO / "tools" / "gpu-window.sh"), str(budget_s), "steps"], cwd=workdir,
                          env={**os.environ, "OUT": str(out), **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.search(r"gpu-window\.tgz \(\d", done.stdout), done.stdout + done.stderr  # its size, as du gives it
    with tarfile.open(out / "gpu-window.tgz") as tar:
        return done.stdout, set(tar.getnames())


def test_a_window_stops_at_its_budget_and_the_next_goes_on_from_there(tmp_path: Path) -> None:
    """Steps run in order until the budget; the cut one goes on in the next window. `bench run` in a step is
    told when the window ends (BENCH_STOP_AT, 15 s early) so that it starts no cell the end would cut."""
    import time

    (tmp_path / "steps").write_text(STEPS)
    before = time.time()
    printed, names = _window(tmp_path, 12)
    stop_at = int((tmp_path / "results" / "raw" / "stop_at.txt").read_text())
    assert before + 12 - 15 - 1 <= stop_at <= before + 12 - 15 + 2
    assert "one: ended, exit 0" in printed and "fails: ended, exit 3" in printed  # a failed step does not stop it
    assert "long: cut by the window's end" in printed and "after: running" not in printed
    assert {"results/raw/one.txt", "results/raw/gpu-window/one.done", "results/raw/gpu-window/fails.done"} <= names
    assert "results/raw/long.txt" not in names and "results/raw/gpu-window/long.done" not in names

    printed, names = _window(tmp_path, 0, LONG_S="0")  # the next window: no budget, the long step now quick
    assert "one: ended in an earlier window (exit 0)" in printed
    assert "fails: ended in an earlier window (exit 3)" in printed  # not run again
    assert "long: ended, exit 0" in printed and "after: ended, exit 0" in printed
    assert "steps ended: 4 of 4" in printed
    assert {"results/raw/long.txt", "results/raw/after.txt"} <= names
    assert (tmp_path / "results" / "raw" / "gpu-window" / "fails.log").exists()


def test_a_step_that_makes_no_progress_in_two_windows_is_given_up(tmp_path: Path) -> None:
    """A cell that outlasts every window would hold the backlog forever: cut twice without a new row, the
    step is marked stalled and the next window goes on to the steps after it."""
    (tmp_path / "steps").write_text("stuck: sleep 60\nnext: touch results/raw/next.txt\n")
    stall = {"STALL_S": "1"}
    assert "stuck: cut by the window's end" in _window(tmp_path, 12, **stall)[0]
    assert "stuck: cut twice after" in _window(tmp_path, 12, **stall)[0]
    printed, names = _window(tmp_path, 0, **stall)
    assert "stuck: ended in an earlier window (exit stalled)" in printed and "next: ended, exit 0" in printed
    assert "results/raw/next.txt" in names


def test_a_step_that_stops_itself_before_a_long_cell_lets_the_next_steps_run_and_is_given_up_on_the_second(
        tmp_path: Path) -> None:
    """`bench run` exits 124 with time left when its next cell would outlast the window (--stop-at): the
    window goes on to the steps after it, and the step runs first in the next window. Stopped so twice
    without a new row (its cell outlasts even a whole window), it is given up; a row in between would have
    reset the count."""
    (tmp_path / "steps").write_text("long-cell: exit 124\nafter: touch results/raw/after.txt\n")
    printed, names = _window(tmp_path, 120)
    assert "long-cell: stopped before a cell that would outlast the window" in printed
    assert "after: ended, exit 0" in printed and "results/raw/after.txt" in names
    printed, _ = _window(tmp_path, 120)
    assert "long-cell: stopped twice before its next cell without a new row: given up" in printed
    assert "long-cell: ended in an earlier window (exit stalled)" in _window(tmp_path, 120)[0]


def test_a_cells_expected_wall_time_is_its_stacks_else_that_of_the_same_techniques_but_checkpointing() -> None:
    """What `bench run --stop-at` weighs before starting a cell (bench/runner.expected_wall_s): the median wall
    of the run's rows of its stack; a stack never run is judged by the same techniques without gc (on the
    H200, gc + offload(params=True) + zero3 never ran before; offload(params=True) + zero3 had: 98 s, and it
    took 113 s, its first 91 s cut by a window's end); with neither, nothing is known: 0, and it starts."""
    from bench import runner, spec
    from bench.cells import Cell, make_cell
    from bench.stacks import parse_stack

    smoke = spec.get(REPO / "matrix.yaml", "smoke")

    def cell(stack: str) -> Cell:
        return make_cell(smoke, "cuda", "llama-3.2-3b", 2048, 2, parse_stack(stack))

    rows = {f"r{i}": {"stack": parse_stack(label).label, "wall_s": wall} for i, (label, wall) in enumerate(
        [("offload(params=true) + zero3", 98.0), ("zero3", 20.0), ("baseline", 17.0), ("baseline", 5.0),
         ("baseline", 7.0), ("lora", None)])}
    assert runner.expected_wall_s(cell("baseline"), rows) == 7.0  # the median of its own
    assert runner.expected_wall_s(cell("gc + offload(params=true) + zero3"), rows) == 98.0
    assert runner.expected_wall_s(cell("gc"), rows) == 7.0  # gc less gc: baseline's techniques
    assert runner.expected_wall_s(cell("qlora"), rows) == 0.0
    assert runner.expected_wall_s(cell("lora"), rows) == 0.0  # a row without its wall time says nothing


def test_a_slimmed_wheel_drops_the_libraries_asked_and_still_installs(tmp_path: Path) -> None:
    """tools/offline-gpu/slim_wheel.py, as prepare.sh calls it on bitsandbytes' wheel: the members the pattern
    matches leave the wheel and its RECORD (so the installed RECORD lists only installed files), the rest
    stay byte for byte, and pip installs what is left, as setup.sh installs it."""
    import base64
    import hashlib
    import sys
    import zipfile

    files = {"demo/__init__.py": b"VALUE = 1\n", "demo/lib_cuda118.so": b"\0" * 4096, "demo/lib_cuda130.so": b"\1" * 64,
             "demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
             "demo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def digest(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{name},{digest(data)},{len(data)}\n" for name, data in files.items())
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr("demo-1.0.dist-info/RECORD", record + "demo-1.0.dist-info/RECORD,,\n")
    done = subprocess.run([sys.executable, str(REPO / "tools" / "offline-gpu" / "slim_wheel.py"), str(wheel),
                           r"lib_cuda1[12][0-9]\.so$"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "dropped 1 files" in done.stdout
    with zipfile.ZipFile(wheel) as archive:
        assert "demo/lib_cuda118.so" not in archive.namelist()
        assert archive.read("demo/lib_cuda130.so") == files["demo/lib_cuda130.so"]
        assert "lib_cuda118" not in archive.read("demo-1.0.dist-info/RECORD").decode()
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                                "--target", str(tmp_path / "site"), str(wheel)], capture_output=True, text=True,
                               timeout=120)
    assert installed.returncode == 0, installed.stderr
    assert sorted(p.name for p in (tmp_path / "site" / "demo").iterdir()) == ["__init__.py", "lib_cuda130.so"]
    installed_record = (tmp_path / "site" / "demo-1.0.dist-info" / "RECORD").read_text()
    assert "lib_cuda130.so" in installed_record and "lib_cuda118" not in installed_record


def test_prepare_keeps_bitsandbytes_library_for_the_gpu_images_cuda_alone() -> None:
    """prepare.sh's pattern, applied to the libraries the installed bitsandbytes ships: what travels is the CPU one
    and CUDA 13.0's (the image's torch is 2.11.0+cu130; bitsandbytes falls back to it on a later CUDA 13). Dropping
    CUDA 13.2's and the XPU ones took .gpu/whl from 14.3 to 10.3 MiB; a pattern that dropped 13.0's too would leave
    every 8-bit and 4-bit cell of a window without its kernels."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes

    script = (REPO / "tools" / "offline-gpu" / "prepare.sh").read_text()
    (pattern,) = re.findall(r"slim_wheel\.py \S*bitsandbytes\S* \\\n\s*'([^']+)'", script)
    shipped = sorted(p.name for p in Path(bitsandbytes.__file__).parent.glob("libbitsandbytes_*.so"))
    assert "libbitsandbytes_cuda132.so" in shipped  # the installed wheel ships them all: the pattern meets them all
    assert [name for name in shipped if not re.search(pattern, name)] == ["libbitsandbytes_cpu.so",
                                                                            "libbitsandbytes_cuda130.so"]


def test_every_line_of_the_backlog_is_a_comment_or_a_named_step() -> None:
    """tools/gpu-backlog.steps, read as the window reads it: a line that is neither blank nor a comment is a step,
    `name: command`, each name once. A comment's continuation that lost its `#` would be run as a command."""
    names = []
    for number, line in enumerate((REPO / "tools" / "gpu-backlog.steps").read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        found = re.fullmatch(r"([a-z0-9][a-z0-9-]*): (\S.*)", line)
        assert found, f"line {number} is neither a comment nor `name: command`: {line[:80]!r}"
        names.append(found.group(1))
    assert len(names) == len(set(names)) > 10


def test_travel_size_counts_what_a_device_call_copies_and_fails_over_the_limit(tmp_path: Path) -> None:
    """tools/offline-gpu/travel_size.py, as prepare.sh ends: the tracked files, the untracked ones git does not
    ignore and the carried ignored paths count; other ignored files do not. Over the limit it exits 1 naming the
    largest tracked folder, so a GPU window is not refused after the session waited for it."""
    import sys

    def write(name: str, size: int) -> None:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text(".gpu/\nresults/raw/\n")
    write("results/big/table.parquet", 600_000)
    write("bench/code.py", 1_000)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    write("notes.txt", 2_000)  # untracked, not ignored: travels
    write(".gpu/whl/lib.whl", 300_000)  # carried
    write(".gpu/extra/big.whl", 5_000_000)  # ignored, not carried: stays
    tracked = 600_000 + 1_000 + len(".gpu/\nresults/raw/\n")

    def check(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(REPO / "tools" / "offline-gpu" / "travel_size.py"), *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)

    fits = check("--limit-mib", "1", ".gpu/whl", "results/raw")
    assert fits.returncode == 0, fits.stderr
    total_mib = (tracked + 2_000 + 300_000) / 2**20
    assert f"{total_mib:8.1f} MiB  in all, of 1 MiB: {1 - total_mib:.1f} MiB left" in fits.stdout
    assert f"{tracked / 2**20:8.1f} MiB  tracked" in fits.stdout
    assert "0.0 MiB  carry results/raw" in fits.stdout  # absent: nothing

    outside = tmp_path / "outside"
    outside.mkdir()
    refused = subprocess.run([sys.executable, str(REPO / "tools" / "offline-gpu" / "travel_size.py")], cwd=outside,
                             capture_output=True, text=True, timeout=60, env={**os.environ, "GIT_CEILING_DIRECTORIES":
                                                                              str(tmp_path)})
    assert refused.returncode == 2 and "not in a git checkout" in refused.stderr

    over = check("--limit-mib", "1", ".gpu")
    assert over.returncode == 1
    assert "over the limit" in over.stderr and "results/big" in over.stderr.split("\n")[1]
