"""Result rows: the schema (column order = schema order), atomic per-cell JSON, parquet per run.

Layout under the results directory:
    raw/<run_id>/<cell_id>.json      one row per finished cell, written atomically (tmp + rename)
    raw/<run_id>/logs/<cell_id>.log  the worker's stdout and stderr
    <matrix>/runs/<run_id>.parquet   all rows of a run, collected from raw/
    <matrix>/LEADERBOARD.md          generated from the newest run's parquet

Memory is in GiB (2^30 bytes), times in ms or s as named, throughput in tokens/s. Memory of a
multi-GPU cell is per GPU, the max over its ranks (each rank's figures are in per_rank_json);
throughput is all ranks together (and per GPU in tokens_per_s_per_gpu).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import json
import os
import sys
import tempfile
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 10  # 2: repeat; 3: budget_gib, allocator_cap_gib; 4: checkpoint columns; 5: gpus, ranks, useful tokens;
# 6: where the wall time goes (imports_s, imports_wait_s, build_s, first_step_s, warmup_s, teardown_s, preforked),
# the phase timeline and the step trace; 7: host RSS around the checkpoint save; 8: segments_json;
# 9: context_before_cell; 10: python_hash_seed
STATUSES = ("ok", "oom", "host_oom", "skipped", "error", "timeout")

# (column, type, definition). Types: str, int, float, bool.
SCHEMA: tuple[tuple[str, str, str], ...] = (
    ("schema_version", "int", "version of this schema"),
    ("run_id", "str", "the run this row belongs to"),
    ("cell_id", "str", "stable id: model, seq, batch, stack label and a hash of every setting"),
    ("repeat", "int", "0-based index of this run of the cell (each in a fresh process); repeats share cell_id"),
    ("matrix", "str", "matrix name in matrix.yaml"),
    ("model", "str", "model registry name (bench/model_configs/<model>.json)"),
    ("seq_len", "int", "tokens per sequence"),
    ("batch_size", "int", "sequences per optimizer step and rank (micro-batch of each GPU)"),
    ("gpus", "int", "ranks of the cell, one process and one GPU each (on a CPU host: gloo processes)"),
    ("stack", "str", "technique stack label; 'baseline' = pure bf16 + fused AdamW + sdpa"),
    ("stack_json", "str", "every technique of the stack with all options resolved (JSON)"),
    ("device", "str", "cuda or cpu"),
    ("warmup_steps", "int", "steps before measurement (the first one included)"),
    ("measure_steps", "int", "timed steps"),
    ("seed", "int", "seed of weights and tokens"),
    ("budget_gib", "float", "memory budget emulated for this cell (bench fit), GiB; empty: the whole card"),
    ("allocator_cap_gib", "float", "cap on torch's caching allocator: budget - memory used outside torch, GiB"),
    ("checkpoint", "str", "none | model | full: what was saved after the last step (checkpoint_* columns)"),
    ("status", "str", " | ".join(STATUSES)),
    ("oom_phase", "str", "for oom: stage/phase it happened in (build, first_step/backward, ...)"),
    ("skip_reason", "str", "for skipped: why (a requirement, a rule, or pruned after an OOM)"),
    ("error", "str", "for error/timeout/host_oom: the tail of the exception or of the worker's log"),
    ("wall_s", "float", "wall time of the cell, from its handover to its worker (the worker's start if not "
                        "preforked) to the worker's exit, s: what the cell cost the host"),
    ("preforked", "bool", "the worker was started while an earlier cell ran (--prefork): its imports overlapped it "
                          "(the part this cell still waited for: imports_wait_s)"),
    ("imports_s", "float", "worker process start to torch, transformers, the model's code and the stack's slow "
                           "modules (Technique.preload) imported, s"),
    ("context_before_cell", "bool", "the worker held a CUDA context before its cell arrived (it should not: "
                                    "while it waited, it would have held device memory in the running cell's "
                                    "NVML figures); empty on a CPU host"),
    ("imports_wait_s", "float", "the part of imports_s the cell waited for (all of it unless preforked early enough), s"),
    ("build_s", "float", "cell handed over to model built, stack applied, engine wrapped and batches made, s"),
    ("first_step_s", "float", "the first step (lazy optimizer state, allocator growth, kernel choice), wall, s"),
    ("warmup_s", "float", "the other warm-up steps, wall, s"),
    ("teardown_s", "float", "the worker's result written to its process's exit (CUDA, NCCL, interpreter), s"),
    ("build_allocated_gib", "float", "allocated after building the model and applying the stack (weights footprint), GiB"),
    ("weights_gib", "float", "bytes of all parameters, GiB"),
    ("grads_gib", "float", "bytes of the gradients of trainable parameters (same dtype as each), GiB"),
    ("optimizer_state_gib", "float", "bytes of optimizer state tensors after the first step, GiB"),
    ("peak_allocated_gib", "float", "overall peak of allocated (live tensor) bytes, build to last step, GiB"),
    ("peak_reserved_gib", "float", "overall peak of bytes reserved by the caching allocator: what must fit, GiB"),
    ("peak_active_gib", "float", "overall peak of active allocator blocks, GiB"),
    ("steady_peak_allocated_gib", "float", "peak allocated during the measured steps only, GiB"),
    ("steady_peak_reserved_gib", "float", "peak reserved during the measured steps only, GiB"),
    ("steady_peak_active_gib", "float", "peak active during the measured steps only, GiB"),
    ("peak_phase", "str", "stage/phase of the overall allocated peak"),
    ("checkpoint_peak_allocated_gib", "float", "peak allocated during the checkpoint save (not in peak_*), GiB"),
    ("checkpoint_peak_reserved_gib", "float", "peak reserved during the checkpoint save (not in peak_*), GiB"),
    ("checkpoint_s", "float", "wall time of the checkpoint save, s"),
    ("checkpoint_disk_gib", "float", "size of the saved checkpoint on disk, GiB"),
    ("checkpoint_host_rss_before_gib", "float", "resident memory of the worker when the save began, GiB"),
    ("checkpoint_host_rss_peak_gib", "float", "peak resident memory of the worker during the save, where the save set "
                                              "the process's peak (getrusage keeps only the maximum: empty where the "
                                              "save stayed below the peak training had set), GiB"),
    ("nvml_peak_gib", "float", "device used memory peak (NVML, 10 ms sampling) minus the used memory before CUDA started, GiB"),
    ("host_rss_peak_gib", "float", "peak resident memory of the worker process, GiB"),
    ("alloc_retries", "int", "allocator retries (cudaMalloc failed, cache flushed, retried)"),
    ("allocator_ooms", "int", "OOMs the allocator raised"),
    ("tokens_per_step", "int", "batch_size * seq_len * gpus: token positions per optimizer step, padding included "
                               "(dynamic_padding: the mean over measured steps, rounded)"),
    ("useful_tokens_per_step", "float", "non-padding tokens per optimizer step (mean over measured steps), all ranks"),
    ("measured_s", "float", "sum of measured step times, s (the slowest rank's)"),
    ("tokens_per_s", "float", "tokens in measured steps / measured_s, all ranks together"),
    ("useful_tokens_per_s", "float", "non-padding tokens in measured steps / measured_s, all ranks together"),
    ("tokens_per_s_per_gpu", "float", "tokens_per_s / gpus"),
    ("step_ms_p10", "float", "10th percentile of measured step times (CUDA events on GPU), ms"),
    ("step_ms_p50", "float", "median measured step time, ms"),
    ("step_ms_p90", "float", "90th percentile of measured step times, ms"),
    ("step_time_cv", "float", "coefficient of variation of measured step times (stdev / mean)"),
    ("flops_per_token", "float", "6 * N_matmul + 12 * L * H * head_dim * T (training FLOPs per token)"),
    ("mfu", "float", "flops_per_token * tokens_per_s / GPU dense bf16 peak (0..1)"),
    ("total_params", "int", "parameters of the model as trained (adapters included)"),
    ("trainable_params", "int", "parameters with requires_grad"),
    ("evidence_json", "str", "what each technique reported when applied (JSON): proof that it applied"),
    ("losses_json", "str", "the loss of every step, warm-up first, mean over ranks (JSON list)"),
    ("phase_timeline_json", "str", "GPU: memory at the end of each phase and its peak within it (end_/peak_ "
                                   "allocated_gib, reserved_gib) for the build, the first step's forward, backward "
                                   "and optimizer, the last measured step's, and the save (JSON list in order)"),
    ("step_trace_json", "str", "after every step, warm-up first: its stage, its positions per row (the batch's "
                               "padded length), its time `ms` (warm-up steps by the host clock, the device "
                               "drained; measured ones as step_ms_*), and on the GPU allocated_gib and "
                               "reserved_gib (JSON list)"),
    ("segments_json", "str", "GPU: the caching allocator's segments once the measured steps have run, before any "
                             "save (torch.cuda.memory_snapshot): per pool (large, small), [size in bytes, how many] "
                             "(bench/segments.py); what made peak_reserved_gib unless the cache was released since"),
    ("per_rank_json", "str", "multi-GPU cells: each rank's memory counters and time (JSON list, rank order)"),
    ("gpu_name", "str", "first visible GPU (NVML)"),
    ("gpu_count", "int", "visible GPUs"),
    ("gpu_memory_gib", "float", "total memory of the GPU, GiB"),
    ("driver", "str", "NVIDIA driver version"),
    ("cuda", "str", "CUDA version torch was built with"),
    ("cpu_name", "str", "host CPU model"),
    ("python", "str", "Python version"),
    ("python_hash_seed", "str", "PYTHONHASHSEED of the process that ran the cell: '0' since the suite pins it "
                                "(bench/hashseed.py); empty before, when each process drew its own"),
    ("torch_version", "str", ""),
    ("transformers_version", "str", ""),
    ("peft_version", "str", ""),
    ("deepspeed_version", "str", ""),
    ("liger_kernel_version", "str", ""),
    ("bitsandbytes_version", "str", ""),
    ("accelerate_version", "str", ""),
    ("git_sha", "str", "commit of the suite that ran the cell"),
    ("git_dirty", "bool", "bench/ or matrix.yaml had uncommitted changes"),
    ("started_at", "str", "UTC time the cell started (ISO 8601)"),
    ("rerun_cmd", "str", "command that re-runs exactly this cell"),
)
COLUMNS = tuple(name for name, _, _ in SCHEMA)

# Predictions (`bench predict`): a table of their own, results/<matrix>/predicted/<run_id>.parquet,
# keyed by the same cell ids as measured rows. Every figure is a prediction, not a measurement.
PREDICTED_SCHEMA_VERSION = 13  # 2: phase_timeline_json, peak_reserved_gib, device_peak_gib, fits,
# alloc_retries, step_trace_json; 3: the hybrid's model_states_gib, buckets_gib; host_peak_gib, host_fits;
# 4: step_tflop; 5: checkpoint and the save's checkpoint_* columns; 6: segments_json; 7: least_card_gib;
# 8: fits_budgets_json; 9: least_torch_gib; 10: python_hash_seed; 11: step_ops, step_kernels, step_compute_tflop,
# step_memory_gb, step_ms; 12: evidence_json; 13: host_memory_gib
PREDICTED_STATUSES = ("ok", "unsupported", "skipped", "error")
_PROVENANCE = tuple(c for c in SCHEMA if c[0] in (
    "cpu_name", "python", "python_hash_seed", "torch_version", "transformers_version", "peft_version", "deepspeed_version",
    "liger_kernel_version", "bitsandbytes_version", "accelerate_version", "git_sha", "git_dirty"))
PREDICTED_SCHEMA: tuple[tuple[str, str, str], ...] = (
    ("schema_version", "int", "version of this (predicted) schema"),
    ("run_id", "str", "the prediction run this row belongs to"),
    *(c for c in SCHEMA if c[0] in ("cell_id", "matrix", "model", "seq_len", "batch_size", "gpus", "stack",
                                    "stack_json", "warmup_steps", "measure_steps", "seed", "checkpoint")),
    ("device", "str", "the cell's device: what is predicted (the fake run itself runs on a CPU)"),
    ("status", "str", " | ".join(PREDICTED_STATUSES)),
    ("unsupported_reason", "str", "for unsupported: what the fake run does not cover yet (a technique, several ranks)"),
    ("skip_reason", "str", "for skipped: the plan's reason (excluded, a rule on the cell's shape)"),
    ("error", "str", "for error: the tail of the exception"),
    ("prediction_method", "str", "how the figures were obtained (fake-run/N: the training step on fake tensors; "
                                 "hybrid/N: a ZeRO cell, DeepSpeed's model-state accounting + the fake run's "
                                 "activations, bench/predict/hybrid.py)"),
    ("gpu_kind", "str", "the GPU predicted for (bench/predict/gpus.py): sets the cuBLAS workspace size"),
    ("gpu_memory_gib", "float", "memory of that GPU, GiB: measured capacity or --gpu-memory-gib; empty if unknown"),
    ("peak_allocated_gib", "float", "PREDICTED overall peak of allocated bytes (first step included), GiB"),
    ("steady_peak_allocated_gib", "float", "PREDICTED peak allocated of a step after the first, GiB"),
    ("peak_phase", "str", "stage/phase of the predicted peak (first_step/..., measure/... = any later step)"),
    ("peak_op", "str", "the op whose result made the predicted peak"),
    ("at_peak_weights_gib", "float", "at the predicted peak: parameters and buffers, GiB"),
    ("at_peak_gradients_gib", "float", "at the predicted peak: parameters' .grad tensors, GiB"),
    ("at_peak_optimizer_state_gib", "float", "at the predicted peak: the optimizer's state tensors, GiB"),
    ("at_peak_activations_gib", "float", "at the predicted peak: tensors made in forward and kept for backward, GiB"),
    ("at_peak_temporaries_gib", "float", "at the predicted peak: everything else (backward's intermediates, scratch), GiB"),
    ("at_peak_inputs_gib", "float", "at the predicted peak: the batches (all steps', as on the GPU), GiB"),
    ("at_peak_workspace_gib", "float", "at the predicted peak: cuBLAS workspaces (per GPU kind), GiB"),
    ("peak_reserved_gib", "float", "PREDICTED peak reserved: the fake run's allocations and frees replayed through "
                                   "a model of the caching allocator (bench/predict/allocator.py; with expandable_segments, "
                                   "its pages mapped on demand; with max_split_size, its oversize blocks kept whole; "
                                   "garbage_collection_threshold acts only under a memory fraction, so not here), "
                                   "bounded by the card where it is known, GiB"),
    ("device_peak_gib", "float", "PREDICTED peak of the whole device: peak_reserved_gib + what the GPU kind keeps "
                                 "outside torch (CUDA context; measured per kind) + CUDA managed memory (a paged "
                                 "optimizer's state, resident), GiB"),
    ("least_card_gib", "float", "PREDICTED smallest card the step runs on, what lives outside torch included: the "
                                "trace replayed within ever smaller capacities (bisection to 2 MiB), the allocator "
                                "releasing its cache and retrying where a segment does not fit, as under a capped "
                                "allocator (a fit probe's budget, a memory fraction: with garbage_collection_threshold, "
                                "collecting as torch does only under one); below device_peak_gib where retries make "
                                "room, each a device synchronisation. The bisection starts from the smallest capacity "
                                "known to run (the card, or a budget in fits_budgets_json), so it is never above one: "
                                "the allocator does not promise a single boundary, GiB"),
    ("least_torch_gib", "float", "PREDICTED least memory the step needs on the card besides the CUDA context and "
                                 "libraries: the caching allocator's smallest capacity, found as for least_card_gib, "
                                 "plus CUDA managed memory. Known on every GPU kind: on one whose context is not "
                                 "measured (an A100, an L40S), the card must hold this and its context, GiB"),
    ("fits_budgets_json", "str", "PREDICTED, where bench fit --predict searched budgets: {budget GiB: whether the "
                                 "step runs within it}, the trace replayed within each as for least_card_gib. The "
                                 "allocator may run within a budget and not within a larger one (it releases its "
                                 "cache sooner): where they disagree, this is the answer at that budget"),
    ("fits", "bool", "PREDICTED: the replay ran to the end within the card (memory_gib - outside torch - CUDA "
                     "managed memory, as in least_card_gib) without an allocator OOM; empty where the card or its "
                     "context is not known"),
    ("alloc_retries", "int", "PREDICTED times a new segment did not fit on the card and the allocator released its "
                             "cache to retry (measured: num_alloc_retries); each costs a device synchronisation. "
                             "With max_split_size, releasing only oversize blocks first is not a retry (as in torch)"),
    ("model_states_gib", "float", "hybrid: weights, gradients and optimizer state per GPU by DeepSpeed's estimator, GiB"),
    ("buckets_gib", "float", "hybrid: DeepSpeed's gradient reduction bucket per GPU (reduce_bucket_size), GiB"),
    ("host_peak_gib", "float", "PREDICTED host RAM of the cell's ranks on one host, where it offloads: ZeRO-2, the "
                               "tensors DeepSpeed makes there (pinned ones in power-of-two blocks); ZeRO-3, DeepSpeed's "
                               "estimate of the offloaded states (x1.5, its default allowance); activation offload and "
                               "FSDP2's CPU offload, the fake run's pinned host memory (power-of-two blocks, cached, as "
                               "PyTorch's host allocator holds them) and pageable optimizer state; + 1.53 GiB per worker "
                               "process (measured), GiB"),
    ("host_fits", "bool", "PREDICTED host_peak_gib and checkpoint_host_peak_gib <= the host's RAM (--host-memory-gib); "
                          "False: expect host_oom"),
    ("host_memory_gib", "float", "the host RAM host_fits was judged against (--host-memory-gib), GiB; empty where "
                                 "not judged. Tables before schema 13 gain it from rerun_cmd, which names the flag"),
    ("checkpoint_peak_allocated_gib", "float", "PREDICTED allocated during the checkpoint save: what the last step "
                                               "left alive, plus the one parameter FSDP2's model save gathers whole "
                                               "(bench/predict/save.py: no other save path modelled allocates on "
                                               "the GPU beyond what training gathers), GiB"),
    ("checkpoint_peak_reserved_gib", "float", "PREDICTED reserved during the save: what training reserved (the "
                                              "cache is kept), GiB"),
    ("checkpoint_host_copies_gib", "float", "PREDICTED host memory the save holds at once: its copies of GPU "
                                            "tensors, or the whole gathered model (bench/predict/save.py), GiB"),
    ("checkpoint_host_peak_gib", "float", "PREDICTED host RAM during the save: the worker processes, what training "
                                          "keeps on the host (offloaded state) and the save's copies, GiB; "
                                          "measured counterpart: host_rss_peak_gib (the whole run's)"),
    ("headroom_gib", "float", "gpu_memory_gib - device_peak_gib (where known, else - peak_allocated_gib: then "
                              "reserved memory and the context are not counted), GiB; negative: does not fit"),
    *(c for c in SCHEMA if c[0] in ("weights_gib", "grads_gib", "optimizer_state_gib", "total_params",
                                    "trainable_params", "flops_per_token")),
    ("step_tflop", "float", "PREDICTED floating-point operations of the last step run (a steady one), as the fake "
                            "run dispatches them (bench/predict/flops.py: matmuls and attention, recomputation "
                            "included, element-wise ops not; before fake-run/12, attention uncounted under torch "
                            "< 2.15); empty where matmuls run in Triton or bitsandbytes kernels (cce, int8_lora; "
                            "qlora before fake-run/22, liger before fake-run/13), TFLOP"),
    ("step_ops", "int", "ops the last step dispatched (views included): the host's share of the predicted step time "
                        "(bench/predict/steptime.py); empty before fake-run/14 and where step_tflop is; before "
                        "fake-run/22 with a fake tensor's device questions (prim.device), about two thirds of them"),
    ("step_kernels", "int", "of step_ops, those that launch a GPU kernel (Triton launches included)"),
    ("step_compute_tflop", "float", "FLOPs of the compute-bound kernels (above 256 FLOPs a byte moved), TFLOP"),
    ("step_memory_gb", "float", "bytes the memory-bound kernels read and write (each input and output once), GB"),
    ("step_ms", "float", "PREDICTED step time at the GPU kind's rates when predicted (bench/predict/steptime.py RATES: "
                         "fitted to measured cells); empty where not predicted (no rates for the kind, a stack or rank "
                         "count the model does not time), ms; measured counterpart: step_ms_p50"),
    ("allocations", "int", "allocations in the fake run's trace"),
    ("evidence_json", "str", "what each technique reported in the fake run (JSON), as a measured row's evidence_json "
                             "does on the GPU: e.g. compile's graphs and saved_for_backward_gib; empty for hybrids and "
                             "before schema 12"),
    ("phase_timeline_json", "str", "predicted allocated at the end of each phase and its peak within it "
                                   "(end_allocated_gib, peak_allocated_gib): the build, the first step's phases, "
                                   "the steady step's (JSON list in order)"),
    ("step_trace_json", "str", "PREDICTED after each step run: its stage, positions per row, allocated_gib and "
                               "reserved_gib (the allocator's model); every step with dynamic_padding, else the first "
                               "and one steady step (JSON list)"),
    ("segments_json", "str", "PREDICTED segments the allocator holds after the last step run: per pool (large, "
                             "small), [size in bytes, how many], as measured rows have them (bench/segments.py); "
                             "empty with expandable_segments and for hybrids"),
    ("predict_s", "float", "time this cell's prediction took (build + fake steps), s"),
    *_PROVENANCE,
    ("started_at", "str", "UTC time the prediction started (ISO 8601)"),
    ("rerun_cmd", "str", "command that re-predicts exactly this cell"),
)


@dataclass(frozen=True)
class Table:
    """A kind of result table: its columns (in order), statuses and version."""

    name: str  # measured | predicted
    version: int
    schema: tuple[tuple[str, str, str], ...]
    statuses: tuple[str, ...]

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.schema)


MEASURED = Table("measured", SCHEMA_VERSION, SCHEMA, STATUSES)
PREDICTED = Table("predicted", PREDICTED_SCHEMA_VERSION, PREDICTED_SCHEMA, PREDICTED_STATUSES)


def row_key(cell_id: str, repeat: int | None) -> str:
    """A row's name (and its raw file's): the cell id, with `.rK` for repeats after the first."""
    return f"{cell_id}.r{repeat}" if repeat else cell_id


def rank_path(out: Path, rank: int) -> Path:
    """Where rank `rank` of a torchrun cell writes its row, next to the cell's `out`."""
    return out.with_name(f"{out.name}.rank{rank}")


def check_row(row: dict[str, Any], table: Table = MEASURED) -> dict[str, Any]:
    """Unknown columns are a bug in the suite; missing ones are filled with None, in schema order."""
    unknown = set(row) - set(table.columns)
    if unknown:
        raise KeyError(f"{table.name} row has columns outside the schema: {sorted(unknown)}")
    if row.get("status") not in table.statuses:
        raise ValueError(f"{table.name} row has an invalid status {row.get('status')!r}")
    return {c: row.get(c) for c in table.columns}


def write_atomic(path: Path, row: dict[str, Any], table: Table = MEASURED) -> None:
    """A whole row, checked against the schema, written atomically (`write_json_atomic`)."""
    write_json_atomic(path, check_row(row, table))


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """A reader (or a resumed run) sees the old file or the whole new one, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunBusy(RuntimeError):
    """Another process holds the run id's lock."""


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """One runner per run id: an OS lock (flock) on run_dir/.lock, released when its holder exits,
    however it exits. A second runner is refused, naming the holder's pid."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            raise RunBusy(f"run {run_dir.name} is being run by another process (pid {holder}): "
                          "wait for it, or use another --run-id") from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        yield


def read_raw(run_dir: Path, table: Table = MEASURED) -> dict[str, dict[str, Any]]:
    """row key -> row, for every finished cell of a run. Dotfiles (temporary files, a worker's
    measurements, torchrun requests, the lock) are never rows; a file that is not a valid row is
    moved to run_dir/broken/, named on stderr, and its cell counts as not run."""
    rows = {}
    for path in sorted(run_dir.glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            row = json.loads(path.read_text())
            key = row_key(row["cell_id"], row.get("repeat"))
            if row.get("status") not in table.statuses:
                raise ValueError(f"status {row.get('status')!r} is not one of {', '.join(table.statuses)}")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
            _set_aside(path, err)
            continue
        rows[key] = row
    return rows


def _set_aside(path: Path, err: Exception) -> None:
    broken = path.parent / "broken"
    broken.mkdir(exist_ok=True)
    os.replace(path, broken / path.name)
    print(f"warning: {path} is not a result row ({type(err).__name__}: {err}); moved to {broken / path.name}, "
          "its cell will run again", file=sys.stderr)


def published_rows(results_dir: Path, run_id: str, folder: str = "runs") -> dict[str, dict[str, Any]]:
    """row key -> row of the run's published table (results/*/FOLDER/RUN_ID.parquet: runs/ measured,
    predicted/ predicted), if there is one: what a run published from another machine (raw rows are
    not committed) already finished. Read in the current schema, as the reports read it: a resumed run
    rewrites these rows, so what an older table's rows say by other columns (a predicted row's host RAM,
    once only in its rerun_cmd) must reach the new table."""
    import pandas as pd

    table = PREDICTED if folder == "predicted" else MEASURED
    rows: dict[str, dict[str, Any]] = {}
    for path in sorted(results_dir.glob(f"*/{folder}/{run_id}.parquet")):
        frame = read_parquet(path, table)
        for record in frame.to_dict("records"):
            row = {k: None if v is pd.NA or v is None or v != v else v for k, v in record.items()}  # v != v: NaN
            rows[row_key(str(row["cell_id"]), row.get("repeat"))] = row
    return rows


def run_ids(results_dir: Path, matrix: str, patterns: list[str]) -> list[str]:
    """The runs of a matrix (raw rows under results/raw/, or a table under results/MATRIX/runs/) whose
    id matches one of the globs; FileNotFoundError naming a glob that matches none."""
    known = {p.stem for p in (results_dir / matrix / "runs").glob("*.parquet")}
    known |= {d.name for d in (results_dir / "raw").glob("*") if d.is_dir() and
              any(r.get("matrix") == matrix for r in read_raw(d).values())}
    found = []
    for pattern in patterns:
        matched = sorted(name for name in known if fnmatch.fnmatch(name, pattern.strip()))
        if not matched:
            raise FileNotFoundError(f"no run of matrix {matrix!r} matches {pattern!r} (runs: {', '.join(sorted(known))})")
        found += [name for name in matched if name not in found]
    return found


def run_rows(results_dir: Path, matrix: str, run_id: str) -> dict[str, dict[str, Any]]:
    """row key -> row of one run of a matrix: its published table, with its raw rows (newer) over it."""
    rows = published_rows(results_dir, run_id) | read_raw(results_dir / "raw" / run_id)
    return {key: row for key, row in rows.items() if row.get("matrix") == matrix}


def collect_run(results_dir: Path, matrix: str, run_id: str) -> Path | None:
    """A run's raw rows (e.g. copied back from a GPU host) over its published table, if it has one -> its
    parquet table; None if the run has no row of the matrix. A published run with no raw rows is left as it
    was published: written again, it would gain the schema's newer columns, empty, and change bytes of a
    measured table that nothing new was measured for."""
    parquet = results_dir / matrix / "runs" / f"{run_id}.parquet"
    raw = [row for row in read_raw(results_dir / "raw" / run_id).values() if row.get("matrix") == matrix]
    if not raw and parquet.exists():
        return parquet
    rows = list(run_rows(results_dir, matrix, run_id).values())
    if not rows:
        return None
    write_parquet(rows, parquet)
    return parquet


def merge_runs(runs: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per cell (and repeat) from several runs: a measured row (ok) over one that is not,
    then the newest. Shards never share a cell; a run and its re-run do."""
    merged: dict[str, dict[str, Any]] = {}
    for rows in runs:
        for key, row in rows.items():
            kept = merged.get(key)
            if kept is None or (row["status"] == "ok", str(row.get("started_at"))) > \
                    (kept["status"] == "ok", str(kept.get("started_at"))):
                merged[key] = row
    return list(merged.values())


def derive(row: dict[str, Any]) -> dict[str, Any]:
    """Columns computed from others at collection time, so old raw rows gain them too.

    MFU needs the GPU's peak rate, known from the GPU name the runner recorded (not the worker).
    """
    from .measure import peak_bf16_flops

    row = dict(row)
    gpus = row.get("gpus") or 1  # rows before schema 5: one GPU
    peak_flops = peak_bf16_flops(row.get("gpu_name")) if row.get("device") == "cuda" else None
    if row.get("mfu") is None and peak_flops and row.get("tokens_per_s") and row.get("flops_per_token"):
        row["mfu"] = row["flops_per_token"] * row["tokens_per_s"] / (peak_flops * gpus)
    if (row.get("schema_version") or 0) < 5:  # one rank, full rows of real tokens: every token was useful
        row.update(gpus=1, useful_tokens_per_s=row.get("tokens_per_s"), tokens_per_s_per_gpu=row.get("tokens_per_s"),
                   useful_tokens_per_step=row.get("tokens_per_step"))
    return row


_DTYPES = {"str": "string", "int": "Int64", "float": "Float64", "bool": "boolean"}  # pandas' nullable ones


def to_frame(rows: list[dict[str, Any]], table: Table = MEASURED):
    import pandas as pd

    checked = [check_row(derive(r) if table is MEASURED else r, table) for r in rows]
    frame = pd.DataFrame(checked, columns=list(table.columns))
    return frame.astype({name: _DTYPES[kind] for name, kind, _ in table.schema})


def write_parquet(rows: list[dict[str, Any]], path: Path, table: Table = MEASURED) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrow = pa.Table.from_pandas(to_frame(rows, table), preserve_index=False)
    meta = {b"bench.schema_version": str(table.version).encode(), b"bench.schema": json.dumps(table.schema).encode()}
    if table is not MEASURED:  # measured tables keep the metadata they were published with
        meta[b"bench.table"] = table.name.encode()
    arrow = arrow.replace_schema_metadata({**(arrow.schema.metadata or {}), **meta})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(arrow, tmp)
    os.replace(tmp, path)


def read_any(path: Path):
    """A measured or a predicted table, whichever the file is (its `bench.table` metadata)."""
    import pyarrow.parquet as pq

    kind = (pq.read_schema(path).metadata or {}).get(b"bench.table", b"measured")
    return read_parquet(path, PREDICTED if kind == b"predicted" else MEASURED)


def holds_cells(path: Path, cell_ids: Collection[str]) -> bool:
    """Whether a table has a row of any of these cells (its cell ids read alone: no conversion)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    ids = pq.read_table(path, columns=["cell_id"])["cell_id"]
    return bool(pc.any(pc.is_in(ids, value_set=pa.array(sorted(cell_ids), type=pa.string()))).as_py())


def read_parquet(path: Path, table: Table = MEASURED, cell_ids: Collection[str] | None = None):
    """A run's table in the current schema (of these cells' rows, if given): tables published under an older
    schema version stay readable by the current reports (columns added since are derived where they can be,
    else empty). A process reads a file once (the site, PREDICTION.md and the boards each read every published
    table): later reads of the same file, unchanged, get a copy of the first's frame."""
    stat = path.stat()  # a table is replaced whole (write_parquet): a new inode, mtime and size
    cells = None if cell_ids is None else frozenset(cell_ids)
    return _read_parquet(str(path.resolve()), stat.st_ino, stat.st_mtime_ns, stat.st_size, table, cells).copy()


@functools.lru_cache(maxsize=4096)  # every published table (344 today, 28 MiB in all) and room to grow
def _read_parquet(path: str, _inode: int, _mtime_ns: int, _size: int, table: Table, cell_ids: frozenset[str] | None):
    import pandas as pd

    frame = pd.read_parquet(path)
    if cell_ids is not None:
        frame = frame[frame["cell_id"].isin(cell_ids)]
    if table is not MEASURED:  # nothing derived: converted whole columns at a time
        return _conform(frame, table)
    rows = [{k: None if v is pd.NA or v is None or v != v else v for k, v in r.items()}  # v != v: NaN
            for r in frame.to_dict("records")]
    return to_frame(rows, table)


def _conform(frame, table: Table):
    """A table's frame in the current schema, as `to_frame` makes it from the same rows, a column at a time
    (the 335 published predicted tables: 2.7 s on a 2-core CPU, 6.2 s row by row, besides 3.4 s reading them):
    columns outside the schema or a status outside its statuses refused, missing columns empty (host_memory_gib
    read from rerun_cmd), every column in its dtype."""
    import pandas as pd

    unknown = set(frame.columns) - set(table.columns)
    if unknown:
        raise KeyError(f"{table.name} row has columns outside the schema: {sorted(unknown)}")
    if not frame["status"].isin(table.statuses).all():
        bad = sorted(set(frame["status"][~frame["status"].isin(table.statuses)].astype(str)))
        raise ValueError(f"{table.name} row has an invalid status {bad[0]!r}")

    if "host_memory_gib" in table.columns and "host_memory_gib" not in frame and {"rerun_cmd", "host_fits"} <= set(frame):
        frame = frame.assign(host_memory_gib=_host_memory_flag_gib(frame["rerun_cmd"]).where(frame["host_fits"].notna()))

    def column(name: str, dtype: str):
        if name not in frame.columns:  # added since the table was written: empty
            return pd.array([None] * len(frame), dtype=dtype)
        values = frame[name].reset_index(drop=True)
        return values if str(values.dtype) == dtype else values.astype(dtype)

    return pd.DataFrame({name: column(name, _DTYPES[kind]) for name, kind, _ in table.schema})


def _host_memory_flag_gib(rerun_cmd):
    """The --host-memory-gib a prediction ran with, from its rerun_cmd (which has named every flag given since
    host_fits was added, schema 3); empty where the flag was not given (the caller keeps it where host_fits
    was judged, as a prediction records it)."""
    import pandas as pd

    return pd.to_numeric(rerun_cmd.astype("string").str.extract(r"--host-memory-gib (\S+)")[0], errors="coerce")


MEMORY_COLUMNS = tuple(name for name, _, _ in SCHEMA if name.endswith("_gib"))
# where a cell's wall time goes, in order, besides measured_s and checkpoint_s (a torchrun cell: the slowest rank)
STAGE_TIME_COLUMNS = ("imports_s", "imports_wait_s", "build_s", "first_step_s", "warmup_s")
