"""The pytest-benchmark view of a matrix runs, times the step and stores memory in extra_info."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_matrix_benchmark_module_on_a_tiny_cell(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    # a pytest of its own: under pytest-xdist, the worker's variables would make pytest-benchmark disable itself
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "benchmarks/test_matrix_benchmark.py",
                           "--bench-matrix", "smoke", "--bench-only", "tiny-qwen2_s256_b1_gc+lora_*",
                           f"--benchmark-json={out}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = json.loads(out.read_text())["benchmarks"]
    assert result["stats"]["rounds"] == 5  # smoke: measure 5, after 2 warm-up rounds
    assert result["extra_info"]["cell_id"].startswith("tiny-qwen2_s256_b1_gc+lora_")
    assert result["extra_info"]["host_rss_peak_gib"] > 0
    assert result["extra_info"]["tokens_per_s"] == pytest.approx(256 / result["stats"]["mean"])
