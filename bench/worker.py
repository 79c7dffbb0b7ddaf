"""The worker: one process runs one cell and writes its row.

It is started by the runner with the cell's environment already set (allocator settings must be in
place before torch is imported), imports the heavy libraries, then waits for its cell on stdin;
so the runner can start the next worker while the current cell runs, hiding the import time.
Nothing touches CUDA before the cell arrives: the NVML baseline is read first.

Protocol: one JSON line on stdin, {"cell": Cell.to_json(), "row": base row, "out": path}; the
worker writes the finished row to `out` atomically. EOF on stdin: exit without doing anything.
Under torchrun (cells of several GPUs) every rank reads the same request from the file named by
`--request`, and rank r writes its own row to `out.rank<r>` (bench/ranks.py merges them). A rank
that fails exits non-zero after writing its row, so torchrun stops the ranks waiting on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from . import data, distributed, measure, models, results, saving
from .measure import GIB
from .techniques import REGISTRY, Technique, TrainSetup

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
OOM_MARKERS = ("out of memory", "CUDA error: out of memory")


def main() -> None:
    request_file = sys.argv[sys.argv.index("--request") + 1] if "--request" in sys.argv else None
    if request_file:  # a rank under torchrun: a killed torchrun takes its ranks along
        distributed.die_with_parent()
        if os.getppid() == 1:  # torchrun died before the line above
            return
    import torch  # noqa: F401  (the slow imports happen here, before the cell is handed over)
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    line = Path(request_file).read_text() if request_file else sys.stdin.readline()
    if not line.strip():
        return
    request = json.loads(line)
    row = {**request["row"], **run_cell(request["cell"])}
    out = Path(request["out"])
    results.write_atomic(results.rank_path(out, distributed.rank()) if request_file else out, row)
    distributed.shutdown()
    if request_file and row["status"] != "ok":
        os._exit(1)  # torchrun then stops the other ranks, which may wait on this one in a collective


def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """Runs the cell; always returns the measured columns, with a status, never raises."""
    import torch

    cuda = cell["device"] == "cuda"
    sampler = measure.start_nvml_sampler() if cuda else None  # baseline before CUDA starts
    if cuda:
        torch.cuda.set_device(distributed.local_rank())
    tracker = measure.PhaseTracker(cuda)
    out: dict[str, Any] = {}
    try:
        if cell.get("budget_gib") is not None and cuda:
            out["allocator_cap_gib"] = _cap_allocator(cell["budget_gib"], sampler)
        out.update(_train(cell, tracker, out))
        out["status"] = "ok"
    except Exception as err:  # every failure becomes the row's status, never a lost cell
        is_oom = isinstance(err, torch.OutOfMemoryError) or any(m in str(err) for m in OOM_MARKERS)
        out.update(status="oom" if is_oom else "error", error=_tail(err))
        if is_oom:
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


def _train(cell: dict[str, Any], tracker: measure.PhaseTracker, out: dict[str, Any]) -> dict[str, Any]:
    """Build, apply the stack, then warm-up and measured steps. Fills `out` as it goes, so an
    OOM row still carries what was known before it (weights, evidence)."""
    import torch

    uses = [(REGISTRY[name], opts) for name, opts in cell["stack_uses"]]
    setup = _setup(uses)
    model, evidence, out["flops_per_token"] = _build_with_stack(cell, setup, uses)
    trainable = [p for p in model.parameters() if p.requires_grad]
    out.update(  # counted before an engine partitions the parameters (ZeRO-3 leaves them empty)
        total_params=sum(p.numel() for p in model.parameters()),
        trainable_params=sum(p.numel() for p in trainable),
        weights_gib=measure.tensor_gib(model.parameters()),
        grads_gib=measure.tensor_gib(trainable),
        build_allocated_gib=torch.cuda.memory_allocated() / GIB if cell["device"] == "cuda" else None,
    )
    vocab_size = model.config.vocab_size  # an engine's .config is its own
    model, optimizer = _trainer(model, trainable, setup, uses, cell, evidence)
    out["evidence_json"] = json.dumps(evidence, sort_keys=True)
    steps = cell["warmup_steps"] + cell["measure_steps"]
    batches = data.batches(setup.data, vocab_size, cell["batch_size"], cell["seq_len"], steps, cell["seed"],
                           cell["device"], setup.min_doc_frac, distributed.rank(), distributed.world_size())
    losses, step_s = _loop(model, optimizer, batches, setup, tracker, cell)
    if cell.get("checkpoint", "none") != "none":
        out.update(_checkpoint(model, optimizer, cell["checkpoint"], tracker, cell["device"] == "cuda"))
    states = innermost_optimizer(optimizer).state.values()
    out["optimizer_state_gib"] = measure.tensor_gib(t for state in states for t in state.values() if torch.is_tensor(t))
    tokens_per_step = cell["batch_size"] * cell["seq_len"]  # this rank's; bench/ranks.py sums the ranks
    useful = [b.useful_tokens for b in batches[cell["warmup_steps"]:]]
    measured_s = sum(step_s)
    return {
        "losses_json": json.dumps([round(x, 6) for x in losses]),
        "tokens_per_step": tokens_per_step,
        "useful_tokens_per_step": sum(useful) / len(useful),
        "measured_s": measured_s,
        "tokens_per_s": tokens_per_step * len(step_s) / measured_s,
        "useful_tokens_per_s": sum(useful) / measured_s,
        "tokens_per_s_per_gpu": tokens_per_step * len(step_s) / measured_s,
        **measure.step_time_stats(step_s),
    }


def _checkpoint(model: Any, optimizer: Any, kind: str, tracker: measure.PhaseTracker, cuda: bool) -> dict[str, Any]:
    """Saves after the last step into a temporary folder ($BENCH_CHECKPOINT_DIR, else the system's),
    measured as the 'checkpoint/save' phase; the files are deleted afterwards."""
    import torch

    with _checkpoint_dir() as tmp:
        if cuda:
            torch.cuda.synchronize()
        tracker.enter("checkpoint/save")
        start = time.perf_counter()
        saving.save(model, optimizer, kind, Path(tmp))
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tracker.close()
        disk_gib = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file()) / GIB
    return {"checkpoint_s": seconds, "checkpoint_disk_gib": disk_gib}


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


def prepare(cell: dict[str, Any]) -> tuple[Any, Any, TrainSetup]:
    """(model, optimizer, setup) of a cell with its stack applied, for in-process use
    (benchmarks/): the same build as a worker's, without the measurement around it."""
    uses = [(REGISTRY[name], opts) for name, opts in cell["stack_uses"]]
    setup = _setup(uses)
    model, evidence, _ = _build_with_stack(cell, setup, uses)
    model, optimizer = _trainer(model, [p for p in model.parameters() if p.requires_grad], setup, uses, cell, evidence)
    return model, optimizer, setup


def train_step(model: Any, optimizer: Any, batch: data.Batch, autocast: Any, micro_batches: int = 1,
               tracker: measure.PhaseTracker | None = None, stage: str = "") -> Any:
    """One optimizer step on one batch, in `micro_batches` forward/backward passes whose gradients
    accumulate; returns the batch's mean loss, detached. An engine (DeepSpeed) owns backward and
    the step (loss scaling, gradient partitioning); FSDP's sharded model trains like a plain one."""
    engine = hasattr(model, "backward") and hasattr(model, "step")  # a DeepSpeedEngine
    total = 0.0
    for chunk in batch.chunk(micro_batches):
        _enter(tracker, f"{stage}/forward")
        with autocast:
            loss = model(**chunk.model_inputs()).loss / micro_batches
        _enter(tracker, f"{stage}/backward")
        if engine:
            model.backward(loss)
        else:
            loss.backward()
        total += loss.detach()
    _enter(tracker, f"{stage}/optimizer")
    if engine:
        model.step()  # also zeroes the gradients
    else:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return total


def _enter(tracker: measure.PhaseTracker | None, phase: str) -> None:
    if tracker is not None:
        tracker.enter(phase)


def innermost_optimizer(optimizer: Any) -> Any:
    """The optimizer holding the state: engines wrap torch's (DeepSpeed's ZeRO optimizer -> AdamW)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def autocast_for(setup: TrainSetup, device: str) -> Any:
    import torch

    if setup.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=getattr(torch, DTYPES[setup.autocast_dtype]))


def _build_with_stack(cell: dict[str, Any], setup: TrainSetup,
                      uses: list[tuple[Technique, dict[str, Any]]]) -> tuple[Any, dict[str, Any], float | None]:
    """Patches, build (or a technique's load), then each technique's apply hook:
    (model, evidence, flops per token of the base, None for a quantized base)."""
    family = models.get(cell["model"]).family
    for technique, opts in uses:
        if technique.before_build is not None:
            technique.before_build(family, opts)
    loaders = [(t, opts) for t, opts in uses if t.load is not None]  # at most one: slot "base"
    if loaders:
        loader, opts = loaders[0]
        model = loader.load(cell, setup.attn_implementation, opts)  # type: ignore[misc]
        flops = None  # quantized base: no plain-bf16 FLOP count, MFU left empty
    else:
        model = _build(cell, setup)
        flops = measure.flops_per_token(model, cell["seq_len"])
    evidence: dict[str, Any] = {}
    for technique, opts in uses:
        if technique.apply is not None:
            model, found = technique.apply(model, opts)
            evidence.update(found)
    return model, evidence, flops


def _trainer(model: Any, trainable: list[Any], setup: TrainSetup, uses: list[tuple[Technique, dict[str, Any]]],
             cell: dict[str, Any], evidence: dict[str, Any]) -> tuple[Any, Any]:
    """(what the loop steps, its optimizer): the model and the stack's optimizer, or an engine."""
    if setup.engine == "fsdp":
        from .engines import fsdp

        opts = next(o for t, o in uses if t.name == "fsdp")
        model, found = fsdp.shard(model, setup, opts, cell["device"] == "cuda")
        evidence.update(found)  # sharding replaced the parameters: the optimizer takes the new ones
        return model, _optimizer([p for p in model.parameters() if p.requires_grad], setup, uses)
    if setup.engine == "deepspeed":
        from .engines import deepspeed

        engine, optimizer, found = deepspeed.initialize(
            model, trainable, deepspeed.config(uses, setup, cell["batch_size"]))
        evidence.update(found)
        return engine, optimizer
    return model, _optimizer(trainable, setup, uses)


def _setup(uses: list[tuple[Technique, dict[str, Any]]]) -> TrainSetup:
    setup = TrainSetup()
    for technique, opts in uses:
        if technique.configure is not None:
            setup = technique.configure(setup, opts)
    return setup


def _build(cell: dict[str, Any], setup: TrainSetup) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    config = models.hf_config(models.get(cell["model"]), setup.attn_implementation)
    config.use_cache = False  # a training forward must not build a KV cache
    torch.manual_seed(cell["seed"])
    with torch.device(cell["device"]):  # random init directly on the device: no host copy
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPES[setup.param_dtype]))
    return model.train()  # dropout and checkpointing act only in train mode


def _optimizer(params: list[Any], setup: TrainSetup, uses: list[tuple[Technique, dict[str, Any]]]) -> Any:
    """The stack's optimizer technique builds it, if there is one; else torch AdamW as pinned in setup."""
    import torch

    for technique, opts in uses:
        if technique.make_optimizer is not None:
            return technique.make_optimizer(params, setup, opts)
    impl: dict[str, Any] = {"fused": {"fused": True}, "foreach": {"foreach": True},
            "forloop": {"foreach": False, "fused": False}}[setup.optimizer_impl]
    return torch.optim.AdamW(params, lr=setup.lr, **impl)


def _loop(model: Any, optimizer: Any, batches: list[data.Batch], setup: TrainSetup, tracker: measure.PhaseTracker,
          cell: dict[str, Any]) -> tuple[list[float], list[float]]:
    """All steps; the first is the 'first_step' stage (lazy optimizer state), then warm-up, then
    the measured ones, timed with CUDA events on the GPU (host clock on the CPU)."""
    import torch

    cuda = cell["device"] == "cuda"
    autocast = autocast_for(setup, cell["device"])
    losses, timings = [], []
    for i, batch in enumerate(batches):
        stage = "first_step" if i == 0 else "warmup" if i < cell["warmup_steps"] else "measure"
        start = _mark(cuda)
        losses.append(train_step(model, optimizer, batch, autocast, setup.micro_batches, tracker, stage))
        if stage == "measure":
            timings.append((start, _mark(cuda)))
    if cuda:
        torch.cuda.synchronize()
    step_s = [start.elapsed_time(end) / 1000 if cuda else end - start for start, end in timings]
    return [float(x) for x in losses], step_s


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
