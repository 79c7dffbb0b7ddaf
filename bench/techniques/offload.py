"""Offload to host RAM (DeepSpeed ZeRO-Offload): optimizer state and, under ZeRO-3, parameters.

Saves: GPU memory of the fp32 master weights and Adam states (12 B/param) with `optimizer=true`, and
of the parameters between uses with `params=true` (ZeRO-3 only). Costs: host RAM (it moves memory,
it does not remove it: read host_rss_peak_gib), PCIe traffic every step, and the optimizer step on the
CPU (torch AdamW by default; `zero?(adam=deepspeed)` uses DeepSpeed's JIT-built CPUAdam, much faster).
Needs CUDA: on a CPU-only cell there is nothing to offload from.
"""

from __future__ import annotations

from typing import Any

from .base import Options, Phase, Technique


def _fragment(opts: Options) -> dict[str, Any]:
    zero: dict[str, Any] = {}
    if opts["optimizer"]:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if opts["params"]:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"zero_optimization": zero}


def _validate(names: frozenset[str], opts: Options) -> str | None:
    if opts["params"] and "zero3" not in names:
        return "parameter offload needs zero3 (ZeRO-2 keeps whole parameters on the GPU)"
    if not (opts["optimizer"] or opts["params"]):
        return "offloads nothing: set optimizer=true or params=true"
    return None


TECHNIQUE = Technique(
    name="offload",
    summary="ZeRO-Offload: optimizer state (and zero3 params) in host RAM; PCIe traffic, CPU optimizer step",
    phase=Phase.ENGINE,
    options={"optimizer": True, "params": False},
    requires_cuda=True,
    needs_one_of=("zero2", "zero3"),
    ds_config=_fragment,
    validate=_validate,
)
