"""GPU-only checks, run on the GPU machine (`make test-gpu`); skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import raw_rows, run_bench, write_matrix

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_gpu_cell_records_every_memory_counter(workdir: Path) -> None:
    write_matrix(workdir, """
    matrices:
      g: {device: cuda, models: [tiny-llama], seq_lens: [256], batch_sizes: [2], stacks: [baseline, gc],
          steps: {warmup: 2, measure: 5}}
    """)
    proc = run_bench(workdir, "run", "g", "--run-id", "g")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in raw_rows(workdir, "g").values():
        assert row["status"] == "ok", row["error"]
        assert 0 < row["steady_peak_allocated_gib"] <= row["peak_allocated_gib"] <= row["peak_reserved_gib"]
        assert row["nvml_peak_gib"] >= row["peak_reserved_gib"]  # NVML also sees the CUDA context
        assert row["gpu_name"] and row["cuda"] and row["step_ms_p50"] > 0
