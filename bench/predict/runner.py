"""Predicting a matrix's cells: many cells per process, each row written as soon as it is known.

    results/raw/<run_id>/<cell_id>.json          one predicted row per cell, atomic (a re-run resumes)
    results/<matrix>/predicted/<run_id>.parquet  the run's table (results.PREDICTED), same cell ids as measured;
                                                 a run resumes from it too (raw rows are not committed)

Cells are planned as the GPU run would plan them (device cuda, every optional package present), so
their ids are the measured cells' ids. A cell the plan skips (excluded, a rule on its shape) is a
`skipped` row; one with a technique the fake run does not cover is `unsupported`, with the reason.
With jobs > 1, cells are spread over that many processes (each imports torch once).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import pandas as pd

from .. import cells, models, results
from ..cells import Cell, PlannedCell
from ..envinfo import OPTIONAL_PACKAGES, HostCaps
from ..spec import MatrixSpec
from . import gpus
from . import report as predict_report  # not `report`: _run's callback is named so

METHOD = "fake-run/29"  # bump when what a prediction counts changes (2: reserved memory replayed; 3: flash
# attention backward's scratch; 4: a pool per stream, which moves only cells with a second stream: FSDP2's;
# 5: an empty tensor takes no block, which moves only cells that make one: FSDP2's; 6: a tied output
# embedding made whole then freed by the build, which moves only models with tied embeddings built from
# their config: Llama-3.2-1B/3B's, Qwen2.5-0.5B/1.5B's; 7: a thread's cuBLAS workspace after its first GEMM's
# outputs, as the H200's traces order them, which moved peak reserved in 2 of the 76 measured llama3b cells:
# `mixed` s1024 b2 and s2048 b1, +0.78% -> -0.02%; and peak allocated as torch counts it, whole blocks handed
# out (a block not split keeps its tail) from the allocator's replay, no longer the requests' sum; 8: cuDNN's
# attention backward workspace on sm90/sm100 under torch 2.10 on (where sdpa ranks it first) and CUDA's column
# sums' partial-sum buffer, both from the H200's cell traces: over the 76 measured llama3b cells (per GPU) peak
# reserved moved in 18, each nearer the GPU's (median |error| 0.015% -> 0.003%; gc s1024 b1 -1.06% -> -0.13%);
# 9: a gradient sum is in place unless its operand is itself a view (not: unless a view of it ever existed),
# and in place it continues the operand's block in the allocator's trace: the fake run's first step then
# makes the GPU's large requests in the GPU's order, and gc s2048 b2 went -3.21% -> 0.00%, gc + adamw8bit
# -3.97% -> 0.00%; over the 76 cells over 1%: 8 -> 2, the two ZeRO offload cells; 10: CUDA's embedding
# backward takes a partial-sum buffer over more than 3,072 indices (bench/predict/embedding.py), the only
# large request the fake run's first step lacked beside the H200's trace of gc s2048 b2; 11: a load's allocator
# warmup (transformers' from_pretrained: one block of the loaded weights' size, freed at once), which moves only
# the load stacks (qlora, unsloth): the H200's Llama-3.2-3B qlora +0.30% -> +0.24%, its 2096 MiB segment the GPU's to the byte;
# 12: attention's FLOPs counted under torch before 2.15 (step_tflop: Llama-3.2-3B baseline s2048 b2 78.95 ->
# 89.05 TFLOP, torch 2.15's count), and selective_gc(ops=matmuls) saves the CPU attention the fake run
# dispatches, as it saves the GPU's (it recomputed it), which moves only that stack's predictions; 13: Liger's
# fused loss counts its matmuls (step_tflop, empty before: a stack with liger counts what it counts without),
# which moves no memory figure; 14: the step's ops, kernels and their bytes (step_ops, ...: what its time is
# predicted from, bench/predict/steptime.py), Triton launches counted as kernels, which moves no memory figure;
# 15: torchao's low-bit AdamW predicted (bench/predict/torchao_optim.py: its states made by torchao's code, its
# compiled step's buffers as inductor's code allocates them), which moves only torchao_adamw cells, unsupported
# before; 16: LLM.int8 bases predicted (bench/predict/int8.py: 8-bit weights as a load makes them, each layer's
# outlier columns counted beforehand by a real forward on a CPU), which moves only int8_lora cells, unsupported before;
# 17: torch.compile predicted (bench/predict/compiled.py: inductor compiles for the CPU, its generated code runs on
# fake tensors with its kernels never built), which moves only compile cells, unsupported before; 18: Liger's
# Triton kernels taken into compiled graphs as on a GPU (bench/predict/triton_launch.py) and compilation's
# leftovers collected after the first step, which moves only compile + liger cells, unsupported before; 19: the
# kernels of compiled code counted (step_kernels, step_memory_gb: each reading or writing its tensors once), and
# compile cells without Liger timed (bench/predict/steptime.py), which moves no memory figure; 20: cut
# cross-entropy's torch_compile loss run as compiled code (bench/predict/compiled.py), which moves only
# cce(impl=torch_compile) cells, unsupported before; 21: Python's cycle collector paused within each step of a
# cell running compiled code and run after it (bench/predict/compiled.py `collector_paused`), which moves only
# those cells, where the collector's own timing had moved them: compile + gc + liger s2048 b2 reserved 25.680 or
# 25.662 GiB by the cells predicted before it, now 25.662; 22: a step's work counted without the device questions
# a fake tensor answers through the dispatcher, each counted as a kernel reading its tensor (Llama-3.2-3B baseline
# s2048 b2: ops 20,319 -> 6,168, kernels 17,258 -> 3,107, memory-bound bytes 639 -> 236 GB), and bitsandbytes' 4-bit matmul
# counted as the kernels CUDA runs for it (its FLOPs in step_tflop), chosen as bitsandbytes chooses for the GPU kind
# (bench/predict/bnb.py): which moves the memory of qlora cells of 512 rows or fewer, where the old 512-row rule
# assumed bitsandbytes' own kernel and an H100 or H200 dequantizes from a few dozen rows on (no published cell);
# 23: Liger's fused loss counts the bytes of the two matmuls its mirror writes in place (memory-bound: a chunk of
# rows against the whole output layer), the host op each is, and its cross-entropy kernel (bench/predict/liger.py),
# which moves only liger cells' step work, no memory figure; 24: a Triton kernel's tensor it overwrites in place
# counted read and written (bench/predict/triton_launch.py: Liger's SwiGLU backward, its RoPE), which moves only
# liger cells' step work, no memory figure; 25: causal attention's compute-bound FLOPs the share of its scores a
# flash kernel computes (bench/predict/flops.py `causal_share`: about half; step_tflop still torch's count), which
# moves every cell's step work (step_compute_tflop), no memory figure; 26: a fused optimizer's gradients read, not
# written, without a GradScaler (bench/predict/flops.py GRADS_WRITTEN_WITH_SCALE_ONLY), which moves the step work
# (step_memory_gb) of every cell that steps fused AdamW, no memory figure; 27: a mixture of experts' grouped matmuls
# in fp32 (`mixed`) predicted as CUDA's fallback runs them (bench/predict/grouped_mm.py: torch 2.11-2.14's meta
# kernel refused them), their step untimed (a device synchronisation a call), which moves only those cells, an
# error before; every other cell's count as fake-run/26's, so steptime.WORK_COUNTED_SINCE stays 26; 28: torch 2.15's
# cuBLAS workspaces, taken by each GEMM and given back as it returns (bench/predict/cublas.py), which moves only
# predictions made under torch 2.15 or newer: those before it kept two for the process's life, as 2.11-2.14 do;
# 29: a padding mask the model makes itself when given none (all ones: BART's decoder and its family) skipped as
# transformers skips it on real tensors (fake._unpadded_known), where the fake run had built a (B, 1, S, S) mask and
# taken a masked attention kernel, which moves only models that make one: none in the registry, no published figure
# (found by tools/fake_vs_real.py, which sets every architecture's fake run beside its real one on the CPU); and
# `mixed` cast as CUDA's autocast casts (bench/predict/autocast.py: a LayerNorm, RMSNorm, softmax, sum, exp, ... of a
# bf16 tensor in fp32, where CPU's autocast, which the fake CPU tensors took, left them bf16), which moves only
# models that give such an op a bf16 tensor under `mixed` (Persimmon's q/k LayerNorms): no registry model, no
# published figure (Llama-3.2-1B/3B, OLMoE `mixed`, fsdp(precision=mixed) predicted the same to the byte)


@dataclass(frozen=True)
class PredictOptions:
    results_dir: Path
    run_id: str
    gpu: gpus.GpuKind
    gpu_memory_gib: float | None  # the card's memory (None: the GPU kind's measured capacity, if known)
    jobs: int = 1
    redo: bool = False  # predict again cells the run already has
    host_memory_gib: float | None = None  # the host's RAM: offload cells judged against it (host_fits)

    @property
    def card(self) -> gpus.GpuKind:
        """The GPU kind, with --gpu-memory-gib as its capacity where given."""
        if self.gpu_memory_gib is None:
            return self.gpu
        return dataclasses.replace(self.gpu, memory_gib=self.gpu_memory_gib)


def plan(matrix: MatrixSpec, only: str | None) -> list[PlannedCell]:
    """The matrix's cells as a GPU host would plan them (same ids), filtered by `only` globs."""
    on_gpu = dataclasses.replace(matrix, device="cuda")
    host = HostCaps(cuda_devices=max(matrix.gpus), packages=frozenset(OPTIONAL_PACKAGES))
    return cells.matching(cells.plan(on_gpu, host), only, matrix.name)


def run(planned: list[PlannedCell], opts: PredictOptions, provenance: dict[str, Any],
        report: Callable[[Cell, dict[str, Any]], None]) -> list[dict[str, Any]]:
    """Predicts every planned cell not yet in the run; returns the run's rows of these cells."""
    raw_dir = opts.results_dir / "raw" / opts.run_id
    with results.run_lock(raw_dir):
        return _run(planned, known_rows(opts), raw_dir, opts, provenance, report)


def known_rows(opts: PredictOptions) -> dict[str, dict[str, Any]]:
    """Every row the run has: its published table's (a clone resumes a published run without its raw
    rows), under the raw rows of this machine."""
    published = results.published_rows(opts.results_dir, opts.run_id, folder="predicted")
    return {**published, **results.read_raw(opts.results_dir / "raw" / opts.run_id, results.PREDICTED)}


def records_redo_would_replace(planned: list[PlannedCell], opts: PredictOptions) -> list[str]:
    """With --redo, the planned cells whose prediction in this run was made before a GPU first ran the cell:
    PREDICTION.md's "Predicted before the GPU ran it" rests on them, and a prediction made again now would
    have been made after the measurement. A new run id keeps them."""
    if not opts.redo:
        return []
    rows, first = known_rows(opts), predict_report.first_runs(opts.results_dir)
    return [pc.cell.cell_id for pc in planned if pc.cell.cell_id in rows and pc.cell.cell_id in first.index
            and pd.Timestamp(rows[pc.cell.cell_id]["started_at"]) < first[pc.cell.cell_id]]


def _run(planned: list[PlannedCell], rows: dict[str, dict[str, Any]], raw_dir: Path, opts: PredictOptions,
         provenance: dict[str, Any], report: Callable[[Cell, dict[str, Any]], None]) -> list[dict[str, Any]]:
    todo = [pc for pc in planned if opts.redo or pc.cell.cell_id not in rows]
    runnable = [pc.cell for pc in todo if pc.skip_reason is None]
    for pc in todo:
        if pc.skip_reason is not None:
            rows[pc.cell.cell_id] = record(pc.cell, {"status": "skipped", "skip_reason": pc.skip_reason},
                                           opts, provenance, raw_dir, report)
    for cell, found in _predictions(runnable, opts):
        rows[cell.cell_id] = record(cell, found, opts, provenance, raw_dir, report)
    return [rows[pc.cell.cell_id] for pc in planned if pc.cell.cell_id in rows]


def write_table(opts: PredictOptions, matrix: MatrixSpec) -> Path:
    """The run's table: every row the run has, not only those this invocation predicted (a run
    resumed with --only adds to its table, a published one too), in the matrix's plan order."""
    rows = known_rows(opts)
    order = {pc.cell.cell_id: i for i, pc in enumerate(plan(matrix, None))}
    ordered = sorted(rows.values(), key=lambda r: (order.get(r["cell_id"], len(order)), r["cell_id"]))
    path = opts.results_dir / matrix.name / "predicted" / f"{opts.run_id}.parquet"
    results.write_parquet(ordered, path, results.PREDICTED)
    return path


def _predictions(runnable: list[Cell], opts: PredictOptions) -> Any:
    """(cell, predicted columns) as each is done: in this process, or spread over `jobs` processes."""
    if opts.jobs <= 1 or len(runnable) <= 1:
        from .fake import predict_cell

        for cell in runnable:
            yield cell, predict_cell(cell, opts.card)
        return
    with spawned_pool(opts.jobs) as pool:
        found = pool.map(_predict_in_worker, [(c.to_json(), opts.card) for c in runnable])
        yield from zip(runnable, found, strict=True)


def _predict_in_worker(job: tuple[dict[str, Any], gpus.GpuKind]) -> dict[str, Any]:
    from .fake import predict_cell

    cell_json, card = job
    return predict_cell(Cell.from_json(cell_json), card)


def predicted_in(pool: Executor | None, planned: PlannedCell, card: gpus.GpuKind) -> dict[str, Any]:
    """One planned cell's predicted columns: skipped, or its fake run in one of `pool`'s processes (each
    imports torch once; a thread may wait on it while others search), else in this process."""
    if planned.skip_reason is not None:
        return {"status": "skipped", "skip_reason": planned.skip_reason}
    return fake_run(pool, planned.cell, card)


def fake_run(pool: Executor | None, cell: Cell, card: gpus.GpuKind) -> dict[str, Any]:
    """The cell's fake run, in one of `pool`'s processes (the calling thread waits), else in this process."""
    if pool is None:
        from .fake import predict_cell

        return predict_cell(cell, card)
    return pool.submit(_predict_in_worker, (cell.to_json(), card)).result()


def spawned_pool(jobs: int, model_files: tuple[Path, ...] = ()) -> ProcessPoolExecutor:
    """`jobs` processes that predict cells (spawned: a fork would copy this process's torch state), each
    registering `model_files` first (config.json files outside the registry, as this process did)."""
    return ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_register_files,
                               initargs=(model_files,))


def _register_files(paths: tuple[Path, ...]) -> None:
    for path in paths:
        models.register_file(path)


def record(cell: Cell, found: dict[str, Any], opts: PredictOptions, provenance: dict[str, Any], raw_dir: Path,
            report: Callable[[Cell, dict[str, Any]], None]) -> dict[str, Any]:
    c = cell.to_json()
    memory = opts.gpu_memory_gib if opts.gpu_memory_gib is not None else opts.gpu.memory_gib
    row = {
        **{k: v for k, v in provenance.items() if k in results.PREDICTED.columns},
        "schema_version": results.PREDICTED_SCHEMA_VERSION,
        "run_id": opts.run_id,
        **{k: c[k] for k in ("cell_id", "matrix", "model", "seq_len", "batch_size", "gpus", "stack", "device",
                             "warmup_steps", "measure_steps", "seed", "checkpoint")},
        "stack_json": json.dumps(c["stack_uses"], sort_keys=True),
        "prediction_method": METHOD,
        "gpu_kind": opts.gpu.key,
        "gpu_memory_gib": memory,
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "rerun_cmd": f"python -m bench predict {cell.matrix} --gpu {opts.gpu.key} --run-id {opts.run_id} "
                     f"--only '{cell.cell_id}' --redo" + "".join(
                         f" --{flag} {value:g}" for flag, value in (("gpu-memory-gib", opts.gpu_memory_gib),
                                                                    ("host-memory-gib", opts.host_memory_gib))
                         if value is not None),
        **found,
    }
    row.update(judged(row, memory, opts.host_memory_gib))
    results.write_atomic(raw_dir / f"{cell.cell_id}.json", row, results.PREDICTED)
    report(cell, row)
    return row


def judged(row: dict[str, Any], memory_gib: float | None, host_memory_gib: float | None) -> dict[str, Any]:
    """A predicted row against the card and the host: `headroom_gib` (the card's memory less the whole
    device's peak, or less peak allocated where what lives outside torch is not known) and `host_fits`, with
    the host's RAM it was judged against."""
    out: dict[str, Any] = {}
    peak = row.get("device_peak_gib") if row.get("device_peak_gib") is not None else row.get("peak_allocated_gib")
    if memory_gib is not None and peak is not None:
        out["headroom_gib"] = memory_gib - peak
    host = host_needed_gib(row)
    if host_memory_gib is not None and host is not None:
        out.update(host_fits=host <= host_memory_gib, host_memory_gib=host_memory_gib)
    return out


def host_needed_gib(row: dict[str, Any]) -> float | None:
    """The host RAM a predicted cell needs: its training's, or its save's if more; None where not predicted."""
    host = [row[c] for c in ("host_peak_gib", "checkpoint_host_peak_gib") if row.get(c) is not None]
    return max(host) if host else None
