"""DeepSpeed as the cell's engine: config assembled from the stack's fragments, one process, world size 1.

The base config is the suite's baseline translated to DeepSpeed: micro-batch = the cell's batch, no
accumulation, bf16 — which in DeepSpeed means bf16 weights with **fp32 master weights and fp32 Adam
states** in the optimizer (compare with the `mixed` stack, not only with the pure-bf16 baseline) —
and AdamW at the suite's learning rate, with `torch_adam: true`: torch's AdamW instead of DeepSpeed's
JIT-built FusedAdam / CPUAdam, so no kernel is compiled at run time (the engine techniques' option
`adam=deepspeed` selects those).
"""

from __future__ import annotations

import copy
from typing import Any

from .. import distributed
from ..techniques.base import Technique, TrainSetup


def config(uses: list[tuple[Technique, dict[str, Any]]], setup: TrainSetup, batch_size: int) -> dict[str, Any]:
    merged: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        # torch AdamW's implementation pinned (DeepSpeed passes only `foreach` through): the same
        # multi-tensor update on every host, never torch's device-dependent default
        "optimizer": {"type": "AdamW", "params": {"lr": setup.lr, "torch_adam": True, "foreach": True}},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    for technique, opts in uses:
        if technique.ds_config is not None:
            _merge(merged, technique.ds_config(opts))
    return merged


def initialize(model: Any, params: list[Any], ds_config: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """(engine, its optimizer, evidence of what the engine reports it does)."""
    import deepspeed
    import torch

    cuda = torch.cuda.is_available()
    distributed.init(cuda)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")  # adopts the group above
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=copy.deepcopy(ds_config))
    offload_param = engine.zero_offload_param()
    evidence = {
        "zero_stage": engine.zero_optimization_stage(),
        "offload_optimizer": "cpu" if engine.zero_cpu_offload() else "none",
        "offload_param": str(offload_param.device.value) if offload_param is not None else "none",
        "ds_world_size": torch.distributed.get_world_size(),
        "ds_optimizer": f"{type(optimizer).__name__}({type(getattr(optimizer, 'optimizer', None)).__name__})",
    }
    return engine, optimizer, evidence


def _merge(into: dict[str, Any], fragment: dict[str, Any]) -> None:
    for key, value in fragment.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
