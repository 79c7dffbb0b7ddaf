"""pytest-benchmark view of a matrix (default: `regress` on a GPU, `smoke` on a CPU).

For teams whose CI already stores and compares pytest-benchmark results. Each test builds one
cell in-process exactly as the worker does (`bench.trainer.build`: model, stack, engine), then
pytest-benchmark times the training step (`Trainer.step`): `warmup_steps` warm-up rounds, `measure_steps` measured
rounds, one step per round, synchronized on the GPU. Memory goes in `extra_info` (GiB):
`peak_reserved_gib` / `peak_allocated_gib` on the GPU (reset per test), `host_rss_peak_gib` on the
CPU (the pytest process's peak so far: an upper bound, since cells share the process here).

    make regress-benchmark                                 # save a run: .benchmarks/
    pytest benchmarks --benchmark-compare --benchmark-compare-fail=mean:5%   # gate against the last one

`make regress` (`bench compare`) remains the gate for memory: pytest-benchmark compares timings only.
Cells that do not fit a process-per-cell harness (OOM) fail the test here; `bench run` records them.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import pytest

from bench import cells, envinfo, measure, spec, trainer

MATRIX_FILE = Path(__file__).resolve().parents[1] / "matrix.yaml"


def _cells(config: pytest.Config) -> list[cells.Cell]:
    host = envinfo.host_caps()
    name = config.getoption("--bench-matrix") or ("regress" if host.cuda_devices else "smoke")
    only = config.getoption("--bench-only")
    planned = cells.plan(spec.get(MATRIX_FILE, name), host)
    # In-process: one rank. Cells of several GPUs need torchrun; the suite itself measures those.
    return [pc.cell for pc in planned if pc.skip_reason is None and pc.cell.gpus == 1
            and (not only or fnmatch.fnmatch(pc.cell.cell_id, only))]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" in metafunc.fixturenames:
        found = _cells(metafunc.config)
        metafunc.parametrize("cell", found, ids=[c.cell_id for c in found])


def test_train_step(benchmark: Any, cell: cells.Cell) -> None:
    import torch

    cuda = cell.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    held = {"trainer": trainer.build(cell)}  # dropped at the end: the next cell starts empty
    batches = iter(held["trainer"].batches())

    def step() -> None:
        held["trainer"].step(next(batches))
        if cuda:
            torch.cuda.synchronize()

    benchmark.pedantic(step, rounds=cell.measure_steps, warmup_rounds=cell.warmup_steps, iterations=1)
    tokens = cell.batch_size * cell.seq_len
    benchmark.extra_info.update(cell_id=cell.cell_id, tokens_per_step=tokens,
                                tokens_per_s=tokens / benchmark.stats.stats.mean)
    if cuda:
        benchmark.extra_info.update(peak_reserved_gib=torch.cuda.max_memory_reserved() / measure.GIB,
                                    peak_allocated_gib=torch.cuda.max_memory_allocated() / measure.GIB)
    else:
        benchmark.extra_info["host_rss_peak_gib"] = measure.host_rss_peak_gib()
    held.clear()
    if cuda:
        import gc

        gc.collect()
        torch.cuda.empty_cache()
