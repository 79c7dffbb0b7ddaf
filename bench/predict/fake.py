"""One cell's training step on fake tensors: its predicted peak allocated and reserved memory on a GPU.

The build is the worker's (bench/trainer.py), so what is predicted is what would be measured:

1. the model is built on the meta device with its stack applied (no memory; seconds for billions
   of parameters), then, inside FakeTensorMode, every parameter and buffer becomes a fake CPU
   tensor of the same shape, stride and dtype (tied weights stay tied), counted as weights; and a
   tied output embedding is made whole and freed, as the GPU's build from the config does before
   transformers ties it (a block the allocator keeps cached);
2. the engine and optimizer are made on those, exactly as the trainer makes them;
3. the cell's batches are drawn for real on the CPU (they are small, and padded or packed layouts
   need real lengths), then copied into fake tensors, all of them alive as on the GPU;
4. two steps run under the MemoryCounter: the first (the optimizer's state appears lazily in it)
   and one steady step, standing for every warm-up and measured step: with fake tensors every
   step after the first allocates exactly the same (with dynamic padding: the widest batch);
5. the counter's trace of allocations and frees is replayed through a model of the caching
   allocator (bench/predict/allocator.py): peak reserved, and, for a GPU kind whose capacity and
   context are known, the device's peak and whether the cell fits.

Fake *CPU* tensors carry CUDA's memory where it matters: sdpa dispatches to flash attention for
CPU, which saves output + logsumexp like CUDA's flash kernel; fused AdamW and non-reentrant
checkpointing run as they do on a GPU; autocast casts as CUDA's does (bench/predict/autocast.py:
CPU's runs a LayerNorm or a softmax of bf16 in bf16, CUDA's in fp32). What no fake kernel allocates is added by
the counter from the GPU kind: cuBLAS workspaces (bench/predict/cublas.py: their size by the GPU kind, how
long they live by the torch release), and the scratch some CUDA
kernels allocate inside their op (the attention's backward, cuDNN's or flash's: bench/predict/attention.py;
a column sum's partial sums: bench/predict/reduction.py; an embedding's backward over more than 3,072
indices: bench/predict/embedding.py; bitsandbytes' 4-bit matmul: bench/predict/bnb.py, and its 8-bit one:
bench/predict/int8.py; cuSOLVER's SVD, GaLore's: bench/predict/lowrank.py).

Values, which fake tensors lack, shape memory in one place: which columns LLM.int8 runs in 16 bits. Their
number is counted beforehand on a CPU (bench/predict/int8.py). A compiled layer (torch.compile) runs the code
inductor generates for it, its kernels never built (bench/predict/compiled.py).

Several ranks (FSDP2): the cell's process group is torch's "fake" backend (a FakeStore, this
process as rank 0 of `gpus` ranks): collectives return at once without moving data, but FSDP2
allocates its all-gather and reduce-scatter buffers as on a GPU, so the counter sees one rank's
memory. FSDP2 pads every shard to the same size, so rank 0 stands for every rank.

Two things transformers does differently on fake tensors: it treats them as tracing, so it cannot
read position ids to see that a batch is not packed, nor read a padding mask to see that it pads
nothing, and would build an explicit (B, 1, S, S) mask a real run never builds (and take attention
kernels that a mask rules out: no flash attention). The data layout is known, so the answers are
given (`_packing_known`, `_unpadded_known`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from .. import data, distributed, measure, models, segments, trainer
from ..cells import Cell
from . import (
    adafactor,
    allocator,
    attention,
    autocast,
    bnb,
    cce,
    compiled,
    cublas,
    ddp,
    embedding,
    fsdp_offload,
    grouped_mm,
    hybrid,
    int8,
    liger,
    lowrank,
    reduction,
    save,
    steptime,
    torchao_optim,
    zero_states,
)
from .counter import KernelScratch, MemoryCounter, Record, Workspaces, all_scratch, no_scratch
from .flops import FlopCount, KernelWork, one_kernel_each
from .gpus import GpuKind
from .steptime import StepWork

STAGES = ("first_step", "measure")  # the steps run: the first, and one standing for all the others
AT_PEAK_COLUMNS = {  # counter role -> column of the breakdown at the peak
    "weight": "at_peak_weights_gib",
    "gradient": "at_peak_gradients_gib",
    "optimizer_state": "at_peak_optimizer_state_gib",
    "activation": "at_peak_activations_gib",
    "temporary": "at_peak_temporaries_gib",
    "input": "at_peak_inputs_gib",
    "workspace": "at_peak_workspace_gib",
}


# Stacks whose matmuls run in kernels the dispatcher does not see (Triton's, bitsandbytes' 8-bit): FLOPs not
# counted, so no step_tflop rather than one too low. Liger's fused loss runs its matmuls with torch, and its
# mirror counts the two it leaves undispatched (bench/predict/liger.py); its other kernels are element-wise.
# bitsandbytes' 4-bit matmul is one op whose kernels are known (bnb.gemm_4bit_kernels).
UNCOUNTED_FLOPS = frozenset({"cce", "int8_lora"})

# Engines whose ranks the fake process group simulates (the others' cells need one GPU).
FAKE_GROUP_ENGINES = ("fsdp", "ddp")


def unsupported_reason(cell: Cell) -> str | None:
    """Why the fake run cannot predict this cell yet, or None. A ZeRO cell's engine is predicted as a
    hybrid (bench/predict/hybrid.py): its other techniques must be ones the fake run covers."""
    zero = hybrid.is_hybrid(cell)
    for use in cell.stack.uses:
        if use.technique.not_predicted and not (zero and use.name in hybrid.ENGINE_TECHNIQUES):
            return f"{use.name}: {use.technique.not_predicted}"
    if "liger" in cell.stack.names and liger.unsupported_reason():
        return f"liger: {liger.unsupported_reason()}"
    cut = _use(cell, "cce")
    if cut is not None and cce.unsupported_reason(cut.opts["impl"]):
        return f"cce: {cce.unsupported_reason(cut.opts['impl'])}"
    if int8.unsupported_reason(cell):
        return f"int8_lora: {int8.unsupported_reason(cell)}"
    if compiled.unsupported_reason(cell.stack):
        return f"compile: {compiled.unsupported_reason(cell.stack)}"
    if zero:
        return hybrid.unsupported_reason(cell)
    if fsdp_offload.applies(cell) and cell.checkpoint != "none":
        return "the save of an FSDP2 cell whose shards live on the host is not modelled"
    if cell.gpus > 1 and not _fake_group_engine(cell):
        return f"{cell.gpus} ranks: only FSDP2's and DDP's ranks are simulated (fake process group)"
    return None


def _fake_group_engine(cell: Cell) -> bool:
    return any(name in FAKE_GROUP_ENGINES for name in cell.stack.names)


def predict_cell(cell: Cell, gpu: GpuKind) -> dict[str, Any]:
    """The prediction's columns, with a status (ok | unsupported | error); never raises."""
    reason = unsupported_reason(cell)
    if reason:
        return {"status": "unsupported", "unsupported_reason": reason}
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    start = time.perf_counter()
    try:
        with predicting(cell):
            found = hybrid.predict(cell, gpu) if hybrid.is_hybrid(cell) else fake_run(cell, gpu)
    except (DynamicOutputShapeException, DataDependentOutputException) as err:  # the model's, not a failure to fix
        return {"status": "unsupported", "unsupported_reason": data_dependent_reason(err)}
    except Exception as err:  # a prediction that fails says why, and the next cell goes on
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        return {"status": "error", "error": "\n".join(text.strip().splitlines()[-12:])}
    return {"status": "ok", **found, "predict_s": time.perf_counter() - start}


def data_dependent_reason(err: BaseException) -> str:
    """Why a step whose shapes or branches follow its data's values is not predicted: the op, and the model's line
    that asked it (a mixture of experts that loops over the experts its tokens chose, as DBRX's and LongCat's do;
    BLT's byte patches), so a user sees which module a fake tensor cannot follow."""
    import torch

    ours = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))  # torch's dispatch, our counter
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(ours)]
    where = ""
    if frames:
        last = frames[-1]
        where = f" at {os.path.basename(last.filename)}:{last.lineno}, in {last.name}: `{(last.line or '').strip()}`"
    return (f"the step computes on its data's values ({err}{where}), which fake tensors do not hold: its shapes and "
            "branches are unknown")


def trace_of(cell: Cell, gpu: GpuKind) -> tuple[list[tuple[str, int, int, int]], list[Record]]:
    """The fake run's allocations and frees as the allocator model replays them, and the counter's records
    (where and by which op each block was made): to set beside a GPU's own (tools/cell_trace.py). A ZeRO
    cell's are the hybrid's (`hybrid.trace_of`): the engine's blocks among them have no record."""
    reason = unsupported_reason(cell)
    if reason:
        raise ValueError(f"{cell.cell_id}: not predicted ({reason})")
    with predicting(cell):
        if hybrid.is_hybrid(cell):
            return hybrid.trace_of(cell, gpu)
        counter, _, _ = counted_for(cell, gpu)
    return allocator.trace(counter.records, counter.releases), counter.records


def fake_run(cell: Cell, gpu: GpuKind) -> dict[str, Any]:
    """The prediction's figures: the cell's steps on fake tensors, counted for this GPU kind."""
    counter, built, optimizer_state_gib = counted_for(cell, gpu)
    at_peak = counter.breakdown(counter.peak)
    work = counter.steps[-1].work
    if work is not None and work.grouped_mm_fallbacks:
        built.evidence[grouped_mm.FALLBACK_CALLS] = work.grouped_mm_fallbacks
    reserved = reserved_columns(cell, counter, gpu)
    return {
        **reserved,
        **_save(cell, counter, built, json.loads(reserved["step_trace_json"])[-1]["reserved_gib"]),
        "steady_peak_allocated_gib": counter.steady_peak.nbytes / measure.GIB,
        "peak_phase": counter.peak.where,
        "peak_op": counter.peak.op,
        **{AT_PEAK_COLUMNS[role]: nbytes / measure.GIB for role, nbytes in at_peak.items()},
        "weights_gib": built.weights_gib,
        "grads_gib": built.grads_gib,
        "optimizer_state_gib": optimizer_state_gib,
        "total_params": built.total_params,
        "trainable_params": built.trainable_params,
        "flops_per_token": built.flops_per_token,
        **_work(cell, work, gpu, built.trainable_params),
        "allocations": len(counter.records),
        "evidence_json": json.dumps(built.evidence, sort_keys=True, default=str),
        "phase_timeline_json": json.dumps(_timeline(counter)),
        **_host(cell, counter),
    }


def _work(cell: Cell, work: StepWork | None, gpu: GpuKind, trainable_params: int) -> dict[str, Any]:
    """The last step's work (a steady one): its FLOPs, and what its time is predicted from, and that time at
    the GPU kind's rates of the day (bench/predict/steptime.py; kept, so a later fit cannot make it in-sample);
    none where kernels the dispatcher does not see do work it cannot count, or where CUDA runs a grouped matmul by
    its fallback (bench/predict/grouped_mm.py: a synchronisation each call; the evidence says how many)."""
    if work is None or set(cell.stack.names) & UNCOUNTED_FLOPS or work.grouped_mm_fallbacks:
        return {}
    columns = {"step_tflop": work.flops / 1e12, "step_ops": work.ops, "step_kernels": work.kernels,
               "step_compute_tflop": work.compute_flops / 1e12, "step_memory_gb": work.memory_bytes / 1e9}
    step_ms = steptime.predicted_ms({**columns, "trainable_params": trainable_params}, gpu.key, cell.stack, cell.gpus)
    return {**columns, "step_ms": step_ms}


def _save(cell: Cell, counter: MemoryCounter, built: trainer.Built, reserved_gib: float) -> dict[str, Any]:
    """A checkpoint save after the last step (bench/predict/save.py): the GPU as the step left it plus
    the save's gathers; on the host, the worker processes, pinned memory still held, the save's copies."""
    if cell.checkpoint == "none":
        return {}
    host_gib = cell.gpus * hybrid.WORKER_PROCESS_GIB + counter.host_bytes / measure.GIB
    cost = save.engine_cost(cell, counter, built.model)
    return save.columns(cost.host_bytes, (counter.steps[-1].live_bytes + cost.gpu_bytes) / measure.GIB, reserved_gib,
                        host_gib)


def _host(cell: Cell, counter: MemoryCounter) -> dict[str, Any]:
    """Where the step pins host memory (activation offload): the cell's ranks on one host, each its
    pinned peak (rank 0's stands for each) and its worker process; an offload stack that pinned nothing
    this time still needs its workers."""
    if not counter.host_peak_bytes and not {"activation_offload", "offload"} & set(cell.stack.names):
        return {}
    return {"host_peak_gib": cell.gpus * (counter.host_peak_bytes / measure.GIB + hybrid.WORKER_PROCESS_GIB)}


def reserved_columns(cell: Cell, counter: MemoryCounter, gpu: GpuKind) -> dict[str, Any]:
    """The trace replayed through the caching allocator's model (`replayed_columns`). A paged optimizer's
    CUDA managed memory is counted resident at its peak, on the card as in the smallest card: bitsandbytes
    may page it out to make room, at a cost this prediction does not know."""
    events = allocator.trace(counter.records, counter.releases)
    at_steps = allocator.positions(counter.records, [s.event for s in counter.steps], counter.releases)
    managed_gib = counter.apart_peak_bytes["managed"] / measure.GIB
    return replayed_columns(cell, events, at_steps, counter.steps, gpu, managed_gib)


def replayed_columns(cell: Cell, events: list[tuple[Any, ...]], at_steps: list[int], steps: list[Any],
                     gpu: GpuKind, managed_gib: float = 0.0) -> dict[str, Any]:
    """Allocation events replayed through the caching allocator's model: peak reserved and reserved after
    each step (`at_steps`: how many events precede each of `steps`' ends). Where the card's capacity and
    what lives outside torch are known, the replay is bounded by the card, as on the GPU: a new segment
    that does not fit makes the allocator release its cache and retry (alloc_retries) before it gives up
    (fits = False; then the unbounded replay says what the cell would need); and the smallest budget
    within which those retries would still get it through (least_card_gib), a memory fraction as `bench
    fit` emulates it; on any card, what torch needs of it (least_torch_gib, `_smallest_cards`).
    `managed_gib`: CUDA managed memory beside the allocator's."""
    settings = allocator_settings(cell)
    state = allocator.replay(events, samples=at_steps, settings=settings)
    unbounded_bytes = state.peak_reserved_bytes  # the bounded replay below may replace `state`
    out: dict[str, Any] = {}
    card_bytes = None  # what torch may hold on the whole card, where the cell runs within it
    if gpu.memory_gib is not None and gpu.outside_torch_gib is not None:  # the whole card: no memory fraction
        torch_bytes = _torch_bytes(gpu.memory_gib - gpu.outside_torch_gib - managed_gib)
        bounded = allocator.replay(events, torch_bytes, at_steps, settings)
        out["fits"] = bounded.oom_at is None
        if out["fits"]:
            state, card_bytes = bounded, torch_bytes
            out["alloc_retries"] = bounded.retries
    out["peak_reserved_gib"] = state.peak_reserved_bytes / measure.GIB
    # torch's peak allocated counts whole blocks, a block's unsplit tail too (the H200's cell traces:
    # their requests replayed give its figure to the byte, their sum falls short by up to 0.13%)
    out["peak_allocated_gib"] = state.peak_allocated_bytes / measure.GIB
    if isinstance(state, allocator.Replay):  # expandable segments: one growing range per pool, no list to compare
        out["segments_json"] = segments.to_json(state.held_segments())
    if gpu.outside_torch_gib is not None:
        out["device_peak_gib"] = out["peak_reserved_gib"] + gpu.outside_torch_gib + managed_gib
    out.update(_smallest_cards(events, settings, gpu, managed_gib, unbounded_bytes, card_bytes))
    out["step_trace_json"] = json.dumps([
        {"stage": s.stage, "positions": s.positions, "allocated_gib": s.live_bytes / measure.GIB,
         "reserved_gib": reserved / measure.GIB} for s, reserved in zip(steps, state.samples, strict=True)])
    return out


def _smallest_cards(events: list[tuple[Any, ...]], settings: allocator.Settings, gpu: GpuKind, managed_gib: float,
                    unbounded_bytes: int, card_bytes: int | None) -> dict[str, Any]:
    """The least memory the step runs within, the allocator releasing its cache and retrying: torch's need
    (least_torch_gib) on any card; where the card's context is measured, the smallest card (least_card_gib)
    and each of the kind's budgets replayed (fits_budgets_json). `card_bytes`: the card's capacity for torch
    where the step runs within it."""
    out: dict[str, Any] = {}
    known = [card_bytes]  # capacities the step runs within
    if gpu.outside_torch_gib is not None:
        apart_gib = gpu.outside_torch_gib + managed_gib
        runs_within = {b: _runs_within(events, settings, b - apart_gib) for b in gpu.budgets_gib}
        if runs_within:  # each budget replayed: the allocator may run within one and not within a larger one
            out["fits_budgets_json"] = json.dumps({f"{b:g}": ran for b, ran in runs_within.items()})
        known += [_torch_bytes(b - apart_gib) for b, ran in runs_within.items() if ran]
    elif gpu.memory_gib is not None and _runs_within(events, settings, gpu.memory_gib - managed_gib):
        known.append(_torch_bytes(gpu.memory_gib - managed_gib))  # the whole card, its context unknown
    # the bisection starts from the least capacity known to run, so the smallest card is never above
    # a budget the step runs within
    start = min((n for n in known if n is not None), default=None)
    least_gib = allocator.least_capacity(events, unbounded_bytes, settings, runs_within_bytes=start) / measure.GIB
    out["least_torch_gib"] = least_gib + managed_gib
    if gpu.outside_torch_gib is not None:
        out["least_card_gib"] = out["least_torch_gib"] + gpu.outside_torch_gib
    return out


def _torch_bytes(gib: float) -> int:
    return int(max(0.0, gib) * measure.GIB)


def _runs_within(events: list[tuple[Any, ...]], settings: allocator.Settings, torch_gib: float) -> bool:
    """Whether the trace runs to its end with torch capped at `torch_gib` by a memory fraction, as `bench
    fit` caps a budget."""
    return allocator.replay(events, _torch_bytes(torch_gib), settings=settings, fraction=True).oom_at is None


def allocator_settings(cell: Cell) -> allocator.Settings:
    """The cell's allocator settings (its stack's allocator techniques, joined in one PYTORCH_CUDA_ALLOC_CONF on
    the GPU) as the model takes them."""
    opts = {use.name: use.opts for use in cell.stack.uses}
    max_split = opts.get("max_split_size")
    collect = opts.get("garbage_collection_threshold")
    return allocator.Settings(expandable="expandable_segments" in opts,
                              max_split_bytes=None if max_split is None else int(max_split["mb"]) * allocator.MIB,
                              gc_threshold=None if collect is None else float(collect["fraction"]))


def _timeline(counter: MemoryCounter) -> list[dict[str, Any]]:
    """Allocated at the end of each phase, in order, and its peak within it (a phase that allocated
    nothing, e.g. a steady optimizer step's in-place update, peaks where it began or ended)."""
    out, before = [], 0
    for where, end in counter.phase_ends.items():
        peak = max(counter.phase_peaks.get(where, 0), before, end)
        out.append({"phase": where, "end_allocated_gib": end / measure.GIB, "peak_allocated_gib": peak / measure.GIB})
        before = end
    return out


def counted_for(cell: Cell, gpu: GpuKind) -> tuple[MemoryCounter, trainer.Built, float]:
    """The cell's fake run counted for this GPU kind: with its cuBLAS workspaces, the scratch its
    kernels allocate that fake kernels do not (bitsandbytes' 4-bit matmul, the attention's backward,
    cuSOLVER's SVD, column sums, the embedding's backward), and the kernels bitsandbytes' 4-bit matmul
    runs where the fake run sees one op."""
    scratch = all_scratch(bnb.gemm_4bit_scratch(gpu), int8.kernel_scratch, attention.backward_scratch(gpu),
                          lowrank.svd_scratch, reduction.column_sum_scratch, embedding.backward_scratch)
    workspaces = cublas.for_gpu(gpu.cublas_workspace_bytes)  # as the GPU host's torch, this one's release, keeps them
    return counted_run(cell, workspaces, kernel_scratch=scratch, kernel_work=bnb.gemm_4bit_kernels(gpu))


def counted_run(cell: Cell, workspaces: Workspaces, fake: bool = True,
                kernel_scratch: KernelScratch = no_scratch,
                kernel_work: KernelWork = one_kernel_each) -> tuple[MemoryCounter, trainer.Built, float]:
    """The cell's steps under a MemoryCounter: (counter, the build, optimizer state GiB).
    fake=False runs the same steps on real CPU tensors (the model built on the CPU under the
    counter): what the tests compare the fake run with. A GPU's workspaces and kernels' scratch are
    counted as given (a prediction gives its GPU kind's; the tests none, to compare like with like)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter = MemoryCounter(workspaces, kernel_scratch)
    if not fake:
        with bnb.fresh_map_cache(), bnb.paged_state_apart(counter), fsdp_offload.predicting(cell, counter), \
                lowrank.predicting(cell.stack.names), torchao_optim.predicting(cell.stack.names), \
                compiled.predicting(cell.stack, fake=False), autocast.as_cuda_casts(), counter:
            # the branches the fake run takes, to compare like with like (torchao's compiled step replaced by what it
            # allocates: compiled, it would not run under the counter's dispatch mode)
            built = trainer.build_model(cell, device="cpu")
            for tensor in (*built.model.parameters(), *built.model.buffers()):
                if tensor.is_meta:  # deferred (FSDP2): made when the engine has sharded them
                    continue
                counter.track(tensor, "parameter", role="weight")
                for state in bnb.quantized_state_tensors(tensor):  # a 4-bit weight's statistics
                    counter.track(state, "quant_state", role="weight")
            batches = [_counted_batch(b, lambda t: t, counter) for b in _cell_batches(cell, built)]
            return counter, built, _steps(cell, built, batches, counter, kernel_work, fake=False)
    built = trainer.build_model(cell, device="meta")
    real_batches = _cell_batches(cell, built)
    with _packing_known(built.setup.data == "pack"), _unpadded_known(_padded(real_batches)), \
            bnb.real_quantization_maps(), bnb.paged_state_apart(counter), \
            _ddp(cell), fsdp_offload.predicting(cell, counter), lowrank.predicting(cell.stack.names), \
            adafactor.predicting(cell.stack.names), torchao_optim.predicting(cell.stack.names), \
            int8.predicting(cell, built.model), compiled.predicting(cell.stack), grouped_mm.as_cuda_runs(), \
            autocast.as_cuda_casts(), FakeTensorMode() as mode, counter:
        if _loaded(cell):
            _load_warmup_made_then_freed(built.model)
        model = _fake_parameters(built.model, counter, deferred=built.deferred is not None)
        if _built_from_config(cell, built):
            _tied_output_made_then_freed(model)
        # weights and parameters counted as the loaded model counts them (a 4-bit weight: its packed bytes)
        built = replace(built, model=model, device="cpu", weights_gib=measure.tensor_gib(model.parameters()),
                        total_params=sum(p.numel() for p in model.parameters()))
        batches = [_counted_batch(b, mode.from_tensor, counter) for b in real_batches]
        return counter, built, _steps(cell, built, batches, counter, kernel_work, fake=True)


def _steps(cell: Cell, built: trainer.Built, batches: list[data.Batch], counter: MemoryCounter,
           kernel_work: KernelWork, fake: bool) -> float:
    """The engine made on the built model, then the steps (STAGES); returns the optimizer state in GiB."""
    job = trainer.wrap(cell, built)
    counter.mark(job.engine.model.parameters(), "weight")  # an engine's own copies of them (FSDP2's shards)
    if fake:  # a fake group's all-reduce returns nothing (bench/predict/ddp.py)
        ddp.reduce_in_place(job.engine.model)
    if fsdp_offload.applies(cell):
        fsdp_offload.step_on_host(job.engine, counter)
    counter.on_optimizer = job.engine.model.parameters
    counter.after_step = job.engine.optimizer_state
    counter.watch_gradients(job.engine.model.parameters())  # where ZeRO's hooks would take them (hybrid.py)
    if not compiled.applies(cell.stack):  # its hooks, traced into a compiled layer, would recompile it per layer
        counter.watch_backward_use(job.engine.model)  # which weights ZeRO-3 would gather for backward (hybrid.py)
    for stage, batch in _stepped(cell, built, batches):
        with compiled.collector_paused(cell.stack), FlopCount(kernel_work) as counted:  # what recomputation costs shows here
            job.step(batch, counter, stage)
        counter.step_done(stage, batch.input_ids.shape[-1], counted.work())
    counter.finish()
    built.evidence.update(job.evidence)  # with what the steps' hooks added (compile's graphs, its saved bytes)
    return measure.tensor_gib(job.engine.optimizer_state())


def _cell_batches(cell: Cell, built: trainer.Built) -> list[data.Batch]:
    """Every step's batch, real, on the CPU, each field its own storage, as after `.to("cuda")` (on
    the CPU, `.to` keeps input_ids and labels in one): the worker moves them all to the GPU first."""
    return [data.Batch(*(t.clone() if t is not None else None for t in
                         (b.input_ids, b.labels, b.attention_mask, b.position_ids)))
            for b in trainer.cell_batches(cell, built.setup, built.vocab_size, "cpu")]


def _stepped(cell: Cell, built: trainer.Built, batches: list[data.Batch]) -> list[tuple[str, data.Batch]]:
    """The steps run, (stage, batch): the first and one standing for all the others (STAGES), the
    widest, since with dynamic padding the widest sets the peak allocated. With dynamic padding every
    step is run: what the caching allocator reserves climbs as longer batches arrive, step by step."""
    first, *rest = batches
    if built.setup.data == "dynpad":
        return [(STAGES[0], first), *((STAGES[1], b) for b in rest)]
    return [(STAGES[0], first), (STAGES[1], max(rest, key=lambda b: b.input_ids.shape[-1]))] if rest else \
        [(STAGES[0], first)]


def _fake_parameters(model: Any, counter: MemoryCounter, deferred: bool = False) -> Any:
    """Every parameter and buffer of the meta model replaced by a fake CPU tensor like it; one
    fake per meta tensor, so tied weights (embeddings and lm_head) stay one tensor. A `deferred`
    build's meta parameters become fake *meta* tensors, holding no memory until the engine has
    sharded them and replays their init (bench/deferred.py), allocating them under the counter."""
    made: dict[int, Any] = {}
    originals = []  # kept alive while replacing, so no id is reused
    for module in model.modules():
        for slots, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in list(slots.items()):
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    originals.append(tensor)
                    still_meta = deferred and is_param and tensor.is_meta
                    made[id(tensor)] = _meta_like(tensor) if still_meta else _fake_like(tensor, module, is_param, counter)
                slots[name] = made[id(tensor)]
    return model


def _loaded(cell: Cell) -> bool:
    """Whether a technique loads the model from a checkpoint (a quantized base, Unsloth): from_pretrained."""
    return any(use.technique.load is not None for use in cell.stack.uses)


def _built_from_config(cell: Cell, built: trainer.Built) -> bool:
    """Whether the GPU run builds this model from its config on the GPU (trainer.base_model), as opposed
    to a load (a quantized base, Unsloth) or a deferred build (FSDP2, ZeRO-3), which tie on meta."""
    return built.deferred is None and not _loaded(cell)


def _load_warmup_made_then_freed(model: Any) -> None:
    """transformers' from_pretrained, given a device map, warms the caching allocator up before it loads
    (modeling_utils.caching_allocator_warmup, 5.17): one block of the weights' loaded size (each weight
    once, tied ones too; `_loaded_bytes`), freed at once. The allocator keeps it cached, and the load and
    the steps carve their blocks out of it. The H200's Llama-3.2-3B qlora: 2,197,641,216 B, the GPU's 2096
    MiB segment to the byte. The weights loaded are
    the frozen base's: the adapters, trained, come after the load. Not counted: the warmup takes off what
    the cache holds unused, and stops 1.2 GiB short of the card (a model that large does not fit)."""
    import torch

    nbytes = sum(_loaded_bytes(p) for p in model.parameters() if not p.requires_grad)
    if nbytes:
        made = torch.empty(nbytes // 2, dtype=torch.float16)
        del made


def _loaded_bytes(param: Any) -> int:
    """A meta weight's bytes once a load has made it: a 4-bit one half a byte an element, an 8-bit one a byte."""
    if bnb.is_4bit(param):
        return int(param.numel()) // 2
    if int8.is_int8(param):
        return int(param.numel())
    return int(param.numel() * param.element_size())


def _tied_output_made_then_freed(model: Any) -> None:
    """A build from the config makes the output embedding's weight whole, after every other weight, then
    transformers ties it to the input embedding's and the whole one is freed (seen in a real build on the
    CPU under the counter): on the GPU, a block the allocator keeps cached (Llama-3.2-3B's 752 MiB), which
    the steps reuse or work around. Made and freed here, where the build makes them."""
    import torch

    nbytes = zero_states.tied_output_bytes(model)
    if nbytes:
        made = torch.empty(nbytes, dtype=torch.uint8)
        del made


def _meta_like(param: Any) -> Any:
    """A fake meta parameter like `param` (FakeTensorMode takes no real tensor, meta ones included)."""
    import torch

    fake = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device="meta")
    return torch.nn.Parameter(fake, requires_grad=param.requires_grad)


def _fake_like(tensor: Any, module: Any, is_param: bool, counter: MemoryCounter) -> Any:
    """A fake CPU tensor like the meta one, counted as a weight. A 4-bit weight is quantized as a
    load quantizes it, from the bf16 weight _quantized loads (bench/predict/bnb.py); an 8-bit one too
    (bench/predict/int8.py)."""
    import torch

    if bnb.is_4bit(tensor):
        fake = bnb.quantized_weight(tensor, module, torch.bfloat16)
        for state in bnb.quantized_state_tensors(fake):
            counter.track(state, "quant_state", role="weight")
    elif int8.is_int8(tensor):
        fake, scales = int8.int8_weight(tensor)
        counter.track(scales, "quant_state", role="weight")
    else:
        fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
        if is_param:
            fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
    counter.track(fake, "parameter" if is_param else "buffer", role="weight")
    return fake


def _counted_batch(batch: data.Batch, convert: Callable[[Any], Any], counter: MemoryCounter) -> data.Batch:
    """The batch converted (to fake tensors, or kept), counted as input."""
    def fake(tensor: Any) -> Any:
        if tensor is None:
            return None
        copy = convert(tensor)
        counter.track(copy, "batch", role="input")
        return copy

    return data.Batch(fake(batch.input_ids), fake(batch.labels), fake(batch.attention_mask), fake(batch.position_ids))


@contextlib.contextmanager
def predicting(cell: Cell) -> Iterator[None]:
    """What a prediction of `cell` runs within, around its counted run: the cell's environment, a fake process
    group for FSDP2 and DDP, Liger's and cut cross-entropy's kernels launching nothing."""
    with _cell_env(cell), _fake_process_group(cell), _liger(cell), _cce(cell):
        yield


@contextlib.contextmanager
def _cell_env(cell: Cell) -> Iterator[None]:
    """The environment variables the cell's techniques set for a worker (e.g. the allocator's
    settings), set while it is predicted: their hooks check them. On a CPU they change nothing."""
    wanted = cell.stack.env
    before = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _fake_process_group(cell: Cell) -> Iterator[None]:
    """For an FSDP2 or DDP cell: this process as rank 0 of `cell.gpus` ranks of torch's fake backend, and the
    ranks' device mesh made before any tensor turns fake. Torn down after, so the next cell starts clean."""
    if not _fake_group_engine(cell):
        yield
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cell.gpus)
    try:
        distributed.mesh("cpu")
        yield
    finally:
        distributed.shutdown()


def _liger(cell: Cell) -> contextlib.AbstractContextManager[None]:
    """Liger's Triton kernels launch nothing on fake tensors, and its patch goes with the cell
    (bench/predict/liger.py)."""
    if "liger" not in cell.stack.names:
        return contextlib.nullcontext()
    return liger.predicting(models.get(cell.model).family)


def _ddp(cell: Cell) -> contextlib.AbstractContextManager[None]:
    """DDP's by-value steps set aside on fake tensors (bench/predict/ddp.py)."""
    return ddp.predicting() if "ddp" in cell.stack.names else contextlib.nullcontext()


def _cce(cell: Cell) -> contextlib.AbstractContextManager[None]:
    """Cut cross-entropy's Triton kernels launch nothing on fake tensors (bench/predict/cce.py)."""
    return cce.predicting() if "cce" in cell.stack.names else contextlib.nullcontext()


def _use(cell: Cell, name: str) -> Any:
    """The stack's use of technique `name`, or None."""
    return next((use for use in cell.stack.uses if use.name == name), None)


def _padded(batches: list[data.Batch]) -> bool:
    """Whether any batch masks a position (its attention mask holds a 0)."""
    return any(b.attention_mask is not None and not bool(b.attention_mask.all()) for b in batches)


@contextlib.contextmanager
def _unpadded_known(padded: bool) -> Iterator[None]:
    """transformers skips the attention mask where a padding mask masks nothing (SDPA's is_causal instead), but
    on fake tensors cannot read the mask and builds it. A model that makes its own all-ones mask when given none
    (BART's decoder and its family) would build a (B, 1, S, S) mask on fake tensors that a real run skips. Where no
    batch pads, every padding mask holds ones, and the answer is given: the mask skipped, as a real run finds."""
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers import masking_utils

    originals = {name: getattr(masking_utils, name) for name in ("_ignore_causal_mask_sdpa",
                                                                  "_ignore_bidirectional_mask_sdpa")
                 if hasattr(masking_utils, name)}  # a transformers without one: the other alone

    def unpadded(original: Callable[..., bool]) -> Callable[..., bool]:
        def ignore(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
            return original(None if isinstance(padding_mask, FakeTensor) else padding_mask, *args, **kwargs)
        return ignore

    if not padded:
        for name, original in originals.items():
            setattr(masking_utils, name, unpadded(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(masking_utils, name, original)


@contextlib.contextmanager
def _packing_known(packed: bool) -> Iterator[None]:
    """transformers asks find_packed_sequence_indices whether a batch is packed; on fake tensors it
    cannot tell and assumes packed. The trainer knows: not packed -> None, as a real run finds."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    if not packed:
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
