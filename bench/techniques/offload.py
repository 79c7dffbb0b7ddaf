"""Offload to host RAM: DeepSpeed ZeRO-Offload (optimizer state; parameters too under ZeRO-3), or
FSDP2's CPUOffloadPolicy (parameters, gradients and optimizer state together: `offload(params=true)`).

Saves: GPU memory of the fp32 master weights and Adam states (12 B/param) with `optimizer=true`, and
of the parameters between uses with `params=true` (ZeRO-3 or FSDP). Costs: host RAM (it moves memory,
it does not remove it: read host_rss_peak_gib), PCIe traffic every step, and the optimizer step on the
CPU (torch AdamW by default; `zero?(adam=deepspeed)` uses DeepSpeed's JIT-built CPUAdam, much faster).
Needs CUDA: on a CPU-only cell there is nothing to offload from. Predicted: under ZeRO from the tensors
DeepSpeed makes on the GPU and the host (bench/predict/hybrid.py); under FSDP2 by the fake run, each host
crossing counted where FSDP makes it (bench/predict/fsdp_offload.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .base import Options, Phase, Technique, TrainSetup


def _fragment(opts: Options) -> dict[str, Any]:
    zero: dict[str, Any] = {}
    if opts["optimizer"]:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if opts["params"]:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"zero_optimization": zero}


def _configure(setup: TrainSetup, opts: Options) -> TrainSetup:
    return replace(setup, cpu_offload=True)  # FSDP reads this; DeepSpeed gets _fragment


def _validate(names: frozenset[str], opts: Options) -> str | None:
    if "fsdp" in names and not (opts["optimizer"] and opts["params"]):
        return "FSDP offloads parameters, gradients and optimizer state together: write offload(params=true)"
    if opts["params"] and not names.intersection(("zero3", "fsdp")):
        return "parameter offload needs zero3 or fsdp (ZeRO-2 keeps whole parameters on the GPU)"
    if not (opts["optimizer"] or opts["params"]):
        return "offloads nothing: set optimizer=true or params=true"
    return None


TECHNIQUE = Technique(
    name="offload",
    summary="optimizer state (and zero3/fsdp params) in host RAM: PCIe traffic, CPU optimizer step",
    phase=Phase.ENGINE,
    options={"optimizer": True, "params": False},
    requires_cuda=True,
    needs_one_of=("zero2", "zero3", "fsdp"),
    configure=_configure,
    ds_config=_fragment,
    validate=_validate,
)
