"""tools/cell_trace.py's comparison of a recorded cell with the model and the fake run, on a device trace
written from the fake run's own requests and the model's segments (what CUDA would record were the
prediction exact), then changed where the GPU would differ."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tools")]

import cell_trace  # noqa: E402

from bench import spec  # noqa: E402
from bench.cells import make_cell  # noqa: E402
from bench.predict import fake, gpus  # noqa: E402
from bench.stacks import parse_stack  # noqa: E402


@pytest.fixture(scope="module")
def cell_and_trace() -> tuple[Any, list[tuple[Any, ...]]]:
    cell = make_cell(spec.get(REPO / "matrix.yaml", "smoke"), "cuda", "tiny-llama", 256, 2, parse_stack("baseline"))
    events, _ = fake.trace_of(cell, gpus.get("h100"))
    return cell, events


def _device_rows(events: list[tuple[Any, ...]], extra_at: int | None = None, extra_bytes: int = 0) -> list[list[Any]]:
    """The events as CUDA's recorder keeps them, each segment the model makes before the request it is made
    for; `extra_at`: one more request (and a segment of its own) before that event, never freed."""
    made = dict(cell_trace.segments_made(events))
    rows: list[list[Any]] = []
    for index, (kind, ident, nbytes, stream) in enumerate(events):
        if index == extra_at:
            rows += [["segment_alloc", 1 << 44, extra_bytes, 0], ["alloc", 1 << 44, extra_bytes, 0]]
        if index in made:
            rows.append(["segment_alloc", (1 << 40) + index * (1 << 24), made[index], stream])
        if kind in ("malloc", "free") and nbytes:
            rows.append(["alloc" if kind == "malloc" else "free_completed", (1 << 32) + ident * 512, nbytes, stream])
    return rows


def test_the_fake_runs_own_trace_compares_equal(cell_and_trace: tuple[Any, list[tuple[Any, ...]]]) -> None:
    cell, events = cell_and_trace
    found = cell_trace.comparison({"device_trace": _device_rows(events)}, cell, "h100")
    assert found["model_peak_bytes"] == found["trace_peak_bytes"] > 0
    assert found["parting"] is None and found["segments"] == {}


def test_a_request_the_fake_run_lacks_is_found_with_its_segment(
        cell_and_trace: tuple[Any, list[tuple[Any, ...]]]) -> None:
    cell, events = cell_and_trace
    large = [i for i, e in enumerate(events) if e[0] == "malloc" and e[2] > cell_trace.MIB]
    extra = 300 * cell_trace.MIB
    found = cell_trace.comparison({"device_trace": _device_rows(events, large[5], extra)}, cell, "h100")
    assert found["parting"] == 5  # the sixth large request is the GPU's extra one
    assert found["segments"] == {extra: (["1/1 of 314,572,800 B"], [])}
    assert found["model_peak_bytes"] == found["trace_peak_bytes"]  # the model makes the same segments from it


def test_a_zero_cell_compares_with_the_hybrids_trace_deepspeeds_blocks_named() -> None:
    """A ZeRO cell's prediction is the hybrid's trace: the fake run's requests and DeepSpeed's engine's,
    merged. Its own trace, as CUDA would record it, compares equal, and the engine's large requests (the
    reduce bucket, the fp32 partition) are named DeepSpeed's, the fake run's by their ops."""
    cell = make_cell(spec.get(REPO / "matrix.yaml", "smoke"), "cuda", "tiny-llama", 256, 2, parse_stack("zero2"))
    events, records = fake.trace_of(cell, gpus.get("h100"))
    assert any(ident >= len(records) for _, ident, _, _ in events)  # the engine's blocks are in it
    found = cell_trace.comparison({"device_trace": _device_rows(events)}, cell, "h100")
    assert found["model_peak_bytes"] == found["trace_peak_bytes"] > 0
    assert found["parting"] is None and found["segments"] == {}
    makers = {(op, where) for _, op, where in found["large"][1]}
    assert ("deepspeed", "engine") in makers and len(makers) > 1, makers


def test_compare_refuses_a_cell_the_predictor_does_not_cover(tmp_path: Path) -> None:
    """A trace of a cell with no prediction (Unsloth's own kernels): exit 2, the reason said, no traceback."""
    import gzip
    import json
    import subprocess

    trace = tmp_path / "unsloth.json.gz"
    with gzip.open(trace, "wt") as handle:
        json.dump({"cell_id": "llama-3.2-3b_s2048_b2_unsloth_3f6f0ec3", "entries": 0, "max_entries": 1,
                   "gpu": "NVIDIA H200", "torch": "2.11.0", "peak_reserved_gib": 1.0, "device_trace": []}, handle)
    done = subprocess.run([sys.executable, str(REPO / "tools" / "cell_trace.py"), "compare", "llama3b", str(trace)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "not predicted" in done.stderr and "unsloth" in done.stderr and "Traceback" not in done.stderr


def test_a_free_the_allocator_completed_late_is_found_with_the_requests_it_waited_for() -> None:
    """`record` keeps each free's request beside its completion: a block freed after record_stream on another
    stream completes its free only after later requests (here 2); one freed on its own stream at once. The
    replay reads the same rows at each completion, the requests ignored."""
    from bench.predict import allocator

    rows = [["alloc", 0x100, 4096, 7], ["free_requested", 0x100, 4096, 7], ["alloc", 0x200, 512, 0],
            ["alloc", 0x300, 512, 0], ["free_completed", 0x100, 4096, 7], ["alloc", 0x400, 512, 0],
            ["free_requested", 0x400, 512, 0], ["free_completed", 0x400, 512, 0]]
    assert cell_trace.deferred_frees(rows) == [(4096, 7, 2)]
    assert [kind for kind, *_ in allocator.from_device_trace(rows).events] == \
        ["malloc", "malloc", "malloc", "free", "malloc", "free"]
