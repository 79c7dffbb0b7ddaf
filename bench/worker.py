"""The worker: one process runs one cell and writes what it measured.

The process side only: the request, the measurement around the training (memory per phase,
NVML, host RSS, step times, the checkpoint save) and the result. What is trained is built by
bench/trainer.py, exactly as every other caller builds it.

It is started by the runner with the cell's environment already set (allocator settings must be in
place before torch is imported), imports the heavy libraries, then waits for its cell on stdin;
so the runner can start the next worker while the current cell runs, hiding the import time.
No CUDA context is made before the cell arrives (the imports may ask torch about the GPU, which should make
none; each row's `context_before_cell` checks it): the NVML baseline is read first.

Protocol: one JSON line on stdin, {"cell": Cell.to_json(), "out": path}; the worker writes the
columns it measured (with a status) to `out` atomically, and the runner assembles the row. EOF on
stdin: exit without doing anything. Under torchrun (cells of several GPUs) every rank reads the
same request from the file named by `--request`, and rank r writes its own measurements to
`out.rank<r>` (bench/ranks.py merges them). A rank
that fails exits non-zero after writing its row, so torchrun stops the ranks waiting on it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from . import data, distributed, kernels, measure, results, segments, trainer
from .cells import Cell
from .engines import Engine
from .measure import GIB

FIRST_IMPORTS_ENV = "BENCH_WORKER_FIRST_IMPORTS"  # a technique's `env` names them (unsloth)
PRELOAD_MODEL_ENV = "BENCH_WORKER_MODEL"  # the runner names the cell's model: its code is imported before the cell
PRELOAD_MODULES_ENV = "BENCH_WORKER_PRELOAD"  # and the slow imports of its stack's builds (Technique.preload)
OOM_MARKERS = ("out of memory", "CUDA error: out of memory")
HOST_OOM_MARKERS = ("DefaultCPUAllocator: can't allocate memory",)  # host RAM exhausted (CPU cells, offload)


def main() -> None:
    request_file = sys.argv[sys.argv.index("--request") + 1] if "--request" in sys.argv else None
    if request_file:  # a rank under torchrun: a killed torchrun takes its ranks along
        distributed.die_with_parent()
        if os.getppid() == 1:  # torchrun died before the line above
            return
    for name in filter(None, os.environ.get(FIRST_IMPORTS_ENV, "").split(",")):
        # a library that patches transformers must be imported before it; if it fails here, the cell's
        # build imports it again and its row records the error
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    import torch  # noqa: F401  (the slow imports happen here, before the cell is handed over)
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    _import_model_code(os.environ.get(PRELOAD_MODEL_ENV))
    _preload(os.environ.get(PRELOAD_MODULES_ENV, ""))
    imported_at = time.time()
    line = Path(request_file).read_text() if request_file else sys.stdin.readline()
    if not line.strip():
        return
    request = json.loads(line)
    imports = {"imports_s": imported_at - _process_started_at(),
               "imports_wait_s": max(0.0, imported_at - request["handed_over_at"]),
               "context_before_cell": _holds_cuda_context(),
               "python_hash_seed": os.environ.get("PYTHONHASHSEED")}  # this process's, over the runner's
    measured = imports | run_cell(Cell.from_json(request["cell"]))
    out = Path(request["out"])
    results.write_json_atomic(results.rank_path(out, distributed.rank()) if request_file else out, measured)
    distributed.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # A failed rank exits non-zero: torchrun then stops the other ranks, which may wait on it in a
    # collective. Either way the result is written: the interpreter's teardown (module and tensor
    # finalizers, about a second a cell) is skipped; the OS frees the memory, the driver the context.
    os._exit(1 if request_file and measured["status"] != "ok" else 0)


def _import_model_code(model: str | None) -> None:
    """transformers imports a model family's code on first use (1.6 s for Llama's on a 2-core CPU host,
    more than the tiny model's whole build): done here, before the cell is handed over, so a preforked
    worker hides it. Pure Python: nothing touches CUDA. Only a head start: if it fails, the cell's own
    build meets the same problem and records it in the row."""
    if not model:
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from . import models

    with contextlib.suppress(Exception):
        MODEL_FOR_CAUSAL_LM_MAPPING[type(models.hf_config(models.get(model), "sdpa"))]


def _preload(modules: str) -> None:
    """The slow imports of the stack's builds (peft, bitsandbytes, Liger's patches), while the worker
    waits. Only a head start, as for the model's code: a failure here is met again, and recorded, by the
    build. These libraries ask torch about the GPU as they import (its capability, for Triton and
    bitsandbytes' kernels): `context_before_cell` records whether that left a CUDA context."""
    for name in filter(None, modules.split(",")):
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _holds_cuda_context() -> bool | None:
    """Whether this process held a CUDA context on its GPU when its cell arrived (None on a CPU host).
    It should not: a worker waiting for its cell holding one would have held its device memory while the
    cell before it ran, in that cell's NVML figures, and its own NVML baseline would include it."""
    import torch

    if not torch.cuda.is_available():
        return None
    if not torch.cuda.is_initialized():
        return False
    return bool(torch._C._cuda_hasPrimaryContext(distributed.local_rank()))  # type: ignore[attr-defined]


def _process_started_at() -> float:
    """When this process started (epoch seconds): its interpreter start and imports count as its cost."""
    import psutil

    return psutil.Process().create_time()


def run_cell(cell: Cell) -> dict[str, Any]:
    """Runs the cell; always returns the measured columns, with a status, never raises."""
    import torch

    cuda = cell.device == "cuda"
    sampler = measure.start_nvml_sampler() if cuda else None  # baseline before CUDA starts
    if cuda:
        torch.cuda.set_device(distributed.local_rank())
    tracker = measure.PhaseTracker(cuda)
    out: dict[str, Any] = {}
    try:
        if cell.budget_gib is not None and cuda:
            out["allocator_cap_gib"] = _cap_allocator(cell.budget_gib, sampler)
        out.update(_train(cell, tracker, out))
        out["status"] = "ok"
    except Exception as err:  # every failure becomes the row's status, never a lost cell
        out.update(status=_status_of(err), error=_tail(err))
        if out["status"] != "error":
            out["oom_phase"] = tracker.where
    tracker.close()
    out.update(tracker.summary())
    if cuda:
        stats = torch.cuda.memory_stats()
        out.update(alloc_retries=stats.get("num_alloc_retries", 0), allocator_ooms=stats.get("num_ooms", 0))
    if sampler is not None:
        out["nvml_peak_gib"] = sampler.stop()
    out["host_rss_peak_gib"] = measure.host_rss_peak_gib()
    return out


def _status_of(err: Exception) -> str:
    """oom: the GPU ran out (torch's OutOfMemoryError, or CUDA's message through another library);
    host_oom: host RAM could not be allocated; else error."""
    import torch

    if any(m in str(err) for m in HOST_OOM_MARKERS):
        return "host_oom"
    if isinstance(err, torch.OutOfMemoryError) or any(m in str(err) for m in OOM_MARKERS):
        return "oom"
    return "error"


def _cap_allocator(budget_gib: float, sampler: measure.NvmlSampler | None) -> float:
    """Emulates a card with `budget_gib` of memory: caps torch's caching allocator at the budget minus
    the memory torch does not see, measured with NVML once CUDA has started (the CUDA context).
    What the cap does not cover: memory allocated outside torch later (NCCL buffers, bitsandbytes'
    paged optimizer state in managed memory): a cell using those can exceed the budget in reality."""
    import torch

    torch.zeros(1, device="cuda")  # starts CUDA: the context now exists
    outside_torch = sampler.used_gib() - torch.cuda.memory_reserved() / GIB if sampler else 0.0
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    cap = budget_gib - outside_torch
    if not 0 < cap <= total:
        raise ValueError(f"budget {budget_gib} GiB cannot be emulated on a {total:.1f} GiB GPU "
                         f"({outside_torch:.2f} GiB is used outside torch)")
    torch.cuda.set_per_process_memory_fraction(cap / total)
    return cap


def _train(cell: Cell, tracker: measure.PhaseTracker, out: dict[str, Any]) -> dict[str, Any]:
    """Build, apply the stack, then warm-up and measured steps. Fills `out` as it goes, so an
    OOM row still carries what was known before it (weights, evidence)."""
    import torch

    started = time.perf_counter()
    built = trainer.build_model(cell)
    out.update(  # counted before an engine shards them (a deferred build's, FSDP2's and ZeRO-3's, are on meta yet)
        flops_per_token=built.flops_per_token,
        total_params=built.total_params,
        trainable_params=built.trainable_params,
        weights_gib=built.weights_gib,
        grads_gib=built.grads_gib,
        build_allocated_gib=torch.cuda.memory_allocated() / GIB if cell.device == "cuda" else None,
    )
    job = trainer.wrap(cell, built)
    del built  # the engine holds the model now
    out["evidence_json"] = json.dumps(job.evidence, sort_keys=True)
    batches = job.batches()
    if cell.device == "cuda":
        torch.cuda.synchronize()
    out["build_s"] = time.perf_counter() - started
    losses, step_s, out["first_step_s"], out["warmup_s"] = _loop(job, batches, tracker)
    if cell.device == "cuda":  # before a save adds its own: what the predictor's replay has at this point
        out["segments_json"] = segments.from_snapshot(torch.cuda.memory_snapshot(), torch.cuda.current_device())
    out["evidence_json"] = json.dumps(job.evidence, sort_keys=True)  # with what the step hooks added
    if cell.checkpoint != "none":
        out.update(_checkpoint(job.engine, cell.checkpoint, tracker, cell.device == "cuda"))
    out["optimizer_state_gib"] = measure.tensor_gib(job.engine.optimizer_state())
    measured = batches[cell.warmup_steps:]
    # this rank's positions (bench/ranks.py sums the ranks): batch_size * seq_len a step, unless batches
    # are padded to their own longest document (dynamic_padding): then they vary from step to step
    positions = sum(b.input_ids.numel() for b in measured)
    useful = sum(b.useful_tokens for b in measured)
    measured_s = sum(step_s)
    return {
        "losses_json": json.dumps([round(x, 6) for x in losses]),
        "tokens_per_step": round(positions / len(measured)),
        "useful_tokens_per_step": useful / len(measured),
        "measured_s": measured_s,
        "tokens_per_s": positions / measured_s,
        "useful_tokens_per_s": useful / measured_s,
        "tokens_per_s_per_gpu": positions / measured_s,
        **measure.step_time_stats(step_s),
    }


RSS_NOISE_GIB = 16 / 1024  # resident-set counters lag by up to 64 pages per thread


def _checkpoint(engine: Engine, kind: str, tracker: measure.PhaseTracker, cuda: bool) -> dict[str, Any]:
    """Saves after the last step into a temporary folder ($BENCH_CHECKPOINT_DIR, else the system's),
    measured as the 'checkpoint/save' phase; the files are deleted afterwards."""
    import torch

    with _checkpoint_dir() as tmp:
        if cuda:
            torch.cuda.synchronize()
        rss_before_gib, rss_peak_before_gib = measure.host_rss_now_gib(), measure.host_rss_peak_gib()
        tracker.enter("checkpoint/save")
        start = time.perf_counter()
        engine.save(kind, Path(tmp))
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tracker.close()
        rss_peak_gib = measure.host_rss_peak_gib()
        disk_gib = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file()) / GIB
    return {"checkpoint_s": seconds, "checkpoint_disk_gib": disk_gib, "checkpoint_host_rss_before_gib": rss_before_gib,
            # only a peak the save set is the save's (getrusage keeps the process's maximum); Linux syncs each
            # thread's RSS count in batches, so a rise within RSS_NOISE_GIB is no evidence
            "checkpoint_host_rss_peak_gib": rss_peak_gib if rss_peak_gib > rss_peak_before_gib + RSS_NOISE_GIB else None}


@contextlib.contextmanager
def _checkpoint_dir() -> Any:
    """A temporary folder, the same for every rank of a torchrun cell (sharded saves write into one)."""
    root = Path(os.environ.get("BENCH_CHECKPOINT_DIR") or tempfile.gettempdir())
    if not distributed.under_torchrun():
        with tempfile.TemporaryDirectory(dir=root, prefix="bench-ckpt-") as tmp:
            yield Path(tmp)
        return
    import shutil

    import torch.distributed as dist

    shared = root / f"bench-ckpt-{os.environ['TORCHELASTIC_RUN_ID']}"
    shared.mkdir(exist_ok=True)
    try:
        yield shared
    finally:
        dist.barrier()  # every rank has written (and measured its size) before rank 0 deletes
        if distributed.rank() == 0:
            shutil.rmtree(shared, ignore_errors=True)


def _loop(job: trainer.Trainer, batches: list[data.Batch],
          tracker: measure.PhaseTracker) -> tuple[list[float], list[float], float, float]:
    """All steps; the first is the 'first_step' stage (lazy optimizer state; its forward passes name
    the attention kernels that ran: bench/kernels.py), then warm-up, then the measured ones, timed
    with CUDA events on the GPU (host clock on the CPU). Returns the losses, the measured step times,
    and the wall time of the first step and of the other warm-up steps (host clock, the device drained
    at each boundary: what they cost a GPU window)."""
    import torch

    cuda = job.cell.device == "cuda"
    losses, timings, unmeasured_s = [], [], []
    stage_s = {"first_step": 0.0, "warmup": 0.0}
    for i, batch in enumerate(batches):
        stage = "first_step" if i == 0 else "warmup" if i < job.cell.warmup_steps else "measure"
        if stage == "measure":
            start = _mark(cuda)
            losses.append(job.step(batch, tracker, stage))
            timings.append((start, _mark(cuda)))
        else:
            began = time.perf_counter()
            with _attention_recorded(job) if i == 0 else contextlib.nullcontext():
                losses.append(job.step(batch, tracker, stage))
            if cuda:
                torch.cuda.synchronize()
            unmeasured_s.append(time.perf_counter() - began)
            stage_s[stage] += unmeasured_s[-1]
        tracker.step_done(stage, batch.input_ids.shape[-1])
    if cuda:
        torch.cuda.synchronize()
    step_s = [start.elapsed_time(end) / 1000 if cuda else end - start for start, end in timings]
    # each step's time in the trace: whether the warm-up steps already ran at the measured steps' speed
    for entry, seconds in zip(tracker.trace, [*unmeasured_s, *step_s], strict=True):
        entry["ms"] = seconds * 1000
    return [float(x) for x in losses], step_s, stage_s["first_step"], stage_s["warmup"]


def _attention_recorded(job: trainer.Trainer) -> contextlib.AbstractContextManager[None]:
    """The first step's attention kernels, into the evidence (bench/kernels.py), where they can be seen."""
    if not kernels.recordable(job.cell):
        return contextlib.nullcontext()
    return kernels.attention_recorded(job.engine.model, job.evidence)


def _mark(cuda: bool) -> Any:
    if not cuda:
        return time.perf_counter()
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _tail(err: BaseException, lines: int = 12) -> str:
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return "\n".join(text.strip().splitlines()[-lines:])


if __name__ == "__main__":
    main()
