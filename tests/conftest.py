"""Shared helpers: tiny matrices written to a temp dir, and the CLI run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _allow_test_techniques(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_TEST_TECHNIQUES", "1")  # the `fault` technique is refused otherwise


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "results").mkdir()
    return tmp_path


def write_matrix(workdir: Path, body: str) -> Path:
    path = workdir / "matrix.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def bench_args(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "bench", "--matrix-file", str(workdir / "matrix.yaml"),
            "--results-dir", str(workdir / "results"), *args]


def run_bench(workdir: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "BENCH_TEST_TECHNIQUES": "1", "COLUMNS": "200"}
    return subprocess.run(bench_args(workdir, *args), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def raw_rows(workdir: Path, run_id: str) -> dict[str, dict]:
    from bench import results

    return results.read_raw(workdir / "results" / "raw" / run_id)
