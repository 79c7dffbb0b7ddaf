"""Memory and time counters of one cell. All memory figures are GiB (2^30 bytes).

Definitions (the README and results.SCHEMA repeat them):
- peak allocated / reserved / active: the caching allocator's peaks (torch.cuda.memory_stats),
  bytes held by live tensors / bytes the allocator holds from the driver / bytes in blocks in use.
  "overall" covers every phase of the cell from model build through the first step to the last
  step: it decides "does it fit". "steady" covers the measured steps only (after warm-up).
- the phase of the peak: the (stage, phase) whose allocated peak was highest; stages are build,
  first_step (lazy optimizer state appears here), warmup, measure; phases forward, backward, optimizer.
- NVML peak: device-level used memory sampled every 10 ms, minus the device's used memory before
  this process touched CUDA. It sees what torch does not (CUDA context, cuBLAS workspaces, NCCL,
  memory other libraries allocate themselves) and also any other process on the same GPU.
- host RSS peak: the worker process's maximum resident set (getrusage), GiB.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

GIB = 2**30

# Dense bf16 peak FLOP/s by GPU name fragment (first match wins); the GPU name is stored on every
# row, so MFU can be re-derived if a figure here changes.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("RTX 4090", 165e12),
)


def peak_bf16_flops(gpu_name: str | None) -> float | None:
    for fragment, flops in PEAK_BF16_FLOPS:
        if gpu_name and fragment in gpu_name:
            return flops
    return None


def flops_per_token(model: Any, seq_len: int) -> float | None:
    """6 * N_matmul + 12 * L * H * head_dim * T (the PaLM / torchtitan convention).

    N_matmul counts every parameter except the input embedding (a lookup, not a matmul); a tied
    lm_head is counted once, since its matmul runs although its weight is the embedding's. In a
    mixture of experts a token runs only the experts it is routed to: a routed expert's parameters
    count at that share (`_active_share`). The second term is attention's score and value matmuls at
    sequence length T, summed over the layers (a heterogeneous config's, Gemma 4's, differ in head_dim). None for a
    config without the sizes the convention reads (BLT's are in nested configs): the cell has no MFU, its step
    still runs.
    """
    cfg = model.config
    try:
        attention = sum(12 * layer.num_attention_heads * _head_dim(layer) * seq_len for layer in _layer_configs(cfg))
    except AttributeError:
        return None
    n_total = sum(p.numel() * _active_share(name, cfg) for name, p in model.named_parameters())
    n_embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    tied_head = head.weight.numel() if head is not None and head.weight is model.get_input_embeddings().weight else 0
    return 6 * (n_total - n_embedding + tied_head) + attention


def _layer_configs(cfg: Any) -> list[Any]:
    """One config per decoder layer: a heterogeneous config's own (transformers >= 5.2x), else the config itself."""
    if getattr(cfg, "is_heterogeneous", False):
        return list(cfg.per_layer_config)
    return [cfg] * cfg.num_hidden_layers


def _head_dim(layer: Any) -> int:
    return getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads


# The config keys of a mixture of experts: how many routed experts a layer has, and how many run a token.
_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _active_share(name: str, cfg: Any) -> float:
    """The share of a parameter's weights a token runs: num_experts_per_tok / experts for the routed
    experts (transformers 5 fuses a layer's experts into one parameter under `.experts.`, and peft's
    adapters of them sit there too; a shared expert, `shared_experts`, runs every token), else 1."""
    experts = next((getattr(cfg, key) for key in _EXPERTS_KEYS if getattr(cfg, key, None)), None)
    active = getattr(cfg, "num_experts_per_tok", None)
    if not experts or not active or ".experts." not in f".{name}":
        return 1.0
    return active / experts


def host_rss_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux reports KiB


def host_rss_now_gib() -> float:
    """The process's resident memory now (Linux: /proc/self/statm, in pages)."""
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * resource.getpagesize() / GIB


def storage_tensors(tensors: Iterable[Any]) -> Iterator[Any]:
    """The tensors that own memory: a wrapper subclass stands for the tensors inside it (FSDP2's DTensor
    for its local shard, torchao's quantized optimizer state for its codes and scales)."""
    from torch import Tensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for tensor in tensors:
        if is_traceable_wrapper_subclass(tensor):
            inner, _ = tensor.__tensor_flatten__()
            yield from storage_tensors(t for t in (getattr(tensor, name) for name in inner) if isinstance(t, Tensor))
        else:
            yield tensor


def tensor_gib(tensors: Iterable[Any]) -> float:
    """Bytes held by these tensors in this process (a wrapper subclass: the tensors inside it)."""
    return sum(t.numel() * t.element_size() for t in storage_tensors(tensors)) / GIB


def step_time_stats(step_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in step_s)
    mean = statistics.fmean(ms)
    cuts = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
    return {
        "step_ms_p10": cuts[0],
        "step_ms_p50": statistics.median(ms),
        "step_ms_p90": cuts[8],
        "step_time_cv": statistics.pstdev(ms) / mean if mean else 0.0,
    }


TIMELINE_STAGES = ("build", "first_step", "measure", "checkpoint")  # not warm-up: the first step and a steady one


class PhaseTracker:
    """Per-phase allocator peaks: reset the peak at each phase boundary, read it at the next.

    The caching allocator updates its statistics on the host when it hands out memory, so the
    peaks need no device synchronisation. On the CPU it only remembers the phase (for OOM rows).
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.where = "build"
        self.peaks: dict[str, tuple[int, int, int]] = {}  # "stage/phase" -> (allocated, reserved, active)
        # "stage/phase" -> memory at its end and its own peak, GiB: the build, the first step's phases and
        # the last measured step's (a steady one), the save: how a report reads "after backward, 61 GB"
        self.timeline: dict[str, dict[str, float]] = {}
        self.trace: list[dict[str, Any]] = []  # after every step: its stage, positions, allocated, reserved
        if cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def enter(self, where: str) -> None:
        self.close()
        self.where = where

    def close(self) -> None:
        if not self.cuda:
            return
        import torch

        s = torch.cuda.memory_stats()
        now = (s.get("allocated_bytes.all.peak", 0), s.get("reserved_bytes.all.peak", 0),
               s.get("active_bytes.all.peak", 0))
        old = self.peaks.get(self.where, (0, 0, 0))
        self.peaks[self.where] = tuple(max(a, b) for a, b in zip(old, now, strict=False))  # type: ignore[assignment]
        if self.where.split("/")[0] in TIMELINE_STAGES:
            self.timeline[self.where] = {"end_allocated_gib": torch.cuda.memory_allocated() / GIB,
                                         "end_reserved_gib": torch.cuda.memory_reserved() / GIB,
                                         "peak_allocated_gib": now[0] / GIB, "peak_reserved_gib": now[1] / GIB}
        torch.cuda.reset_peak_memory_stats()

    def step_done(self, stage: str, positions: int) -> None:
        """After a step: what it held on to (the allocator's cache keeps what the longest batch so far
        reserved: padded batches of growing length climb in stairs)."""
        entry: dict[str, Any] = {"stage": stage, "positions": positions, "allocated_gib": None, "reserved_gib": None}
        if self.cuda:
            import torch

            entry.update(allocated_gib=torch.cuda.memory_allocated() / GIB, reserved_gib=torch.cuda.memory_reserved() / GIB)
        self.trace.append(entry)

    def summary(self) -> dict[str, Any]:
        trace = {"step_trace_json": json.dumps(self.trace)} if self.trace else {}
        if not self.peaks:
            return trace
        # The checkpoint save is reported on its own (checkpoint_peak_*): peak_* stays "training".
        training = {k: v for k, v in self.peaks.items() if not k.startswith("checkpoint/")} or self.peaks
        steady = [v for k, v in training.items() if k.startswith("measure/")]
        saving = [v for k, v in self.peaks.items() if k.startswith("checkpoint/")]
        overall, measured, save = _max_gib(training.values()), _max_gib(steady), _max_gib(saving)
        out: dict[str, Any] = {
            "peak_phase": max(training, key=lambda k: training[k][0]),
            "peak_allocated_gib": overall[0],
            "peak_reserved_gib": overall[1],
            "peak_active_gib": overall[2],
            "steady_peak_allocated_gib": measured[0],
            "steady_peak_reserved_gib": measured[1],
            "steady_peak_active_gib": measured[2],
        }
        if saving:
            out.update(checkpoint_peak_allocated_gib=save[0], checkpoint_peak_reserved_gib=save[1])
        out["phase_timeline_json"] = json.dumps([{"phase": k, **v} for k, v in self.timeline.items()])
        return out | trace


def _max_gib(peaks: Any) -> tuple[float | None, float | None, float | None]:
    """Per counter (allocated, reserved, active), the max over these phases' peaks in GiB; None if no phase."""
    peaks = list(peaks)
    if not peaks:
        return None, None, None
    allocated, reserved, active = (max(p[i] for p in peaks) / GIB for i in range(3))
    return allocated, reserved, active


class NvmlSampler:
    """Samples the device's used memory from a thread; the baseline is read before CUDA starts."""

    def __init__(self, interval_s: float = 0.01):
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = nvml_device_handle(pynvml, int(os.environ.get("LOCAL_RANK", "0")))
        self.baseline_bytes = self._used()
        self.peak_bytes = self.baseline_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), daemon=True)
        self._thread.start()

    def _used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.peak_bytes = max(self.peak_bytes, self._used())

    def used_gib(self) -> float:
        """Device memory in use now above the baseline, GiB."""
        return (self._used() - self.baseline_bytes) / GIB

    def stop(self) -> float:
        """Stops sampling; returns the peak above the baseline in GiB."""
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._used())
        return (self.peak_bytes - self.baseline_bytes) / GIB


def nvml_device_handle(pynvml: Any, local_rank: int = 0) -> Any:
    """The NVML handle of this process's GPU: entry `local_rank` of CUDA_VISIBLE_DEVICES (an index or
    a UUID), or GPU `local_rank` when the variable is not set. NVML ignores CUDA_VISIBLE_DEVICES itself."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    mine = visible.split(",")[local_rank].strip() if visible else str(local_rank)
    if mine.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(mine))
    return pynvml.nvmlDeviceGetHandleByUUID(mine)


def start_nvml_sampler() -> NvmlSampler | None:
    try:
        return NvmlSampler()
    except Exception:  # no NVML (driverless container): the NVML column stays empty
        return None
