"""FSDP2 (`torch.distributed.fsdp.fully_shard`) as the cell's engine.

Each decoder layer (the model's `_no_split_modules`) is one FSDP unit, then the root: parameters,
gradients and optimizer states are sharded over the ranks (DTensors); a unit's full parameters
exist only while it computes (all-gather before, free after with `reshard_after_forward`), and
gradients are reduce-scattered. The optimizer is the stack's, built on the sharded parameters, and
training is a plain loss.backward() / optimizer.step(). With one rank nothing is divided, but the
precision policy and CPU offload still act, so fsdp on one GPU is a cell of its own.
Built on meta (bench/deferred.py): the units are sharded while the model holds no memory, then
each rank's shards are made (on the host with CPU offload) and the build's init replayed into
them, one whole parameter at a time, as torchtitan builds: no GPU ever holds the whole model.
Checkpoints: full -> torch.distributed.checkpoint, each rank its shards of model and optimizer
state; model -> the full state dict gathered to the CPU (as an export does), written by rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import deferred, distributed
from ..techniques.base import Evidence
from .base import EngineJob
from .plain import PlainEngine, make_optimizer, optimizer_evidence


class FsdpEngine(PlainEngine):
    """Trains like plain PyTorch on the sharded model; saves through torch.distributed.checkpoint."""

    def save(self, kind: str, directory: Path) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        if kind == "full":
            dcp.save({"model": get_model_state_dict(self.model),
                      "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}, checkpoint_id=str(directory))
            return
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if torch.distributed.get_rank() == 0:
            torch.save(full, directory / "model.pt")


def wrap(job: EngineJob) -> tuple[FsdpEngine, Evidence]:
    """Shards the model in place; the optimizer takes the sharded parameters that replaced the built ones."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    model, opts = job.model, job.options_of("fsdp")
    distributed.init(job.cell.device == "cuda")
    # mixed: fp32 sharded master weights, bf16 compute, fp32 gradient reduction. pure: all bf16.
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if opts["precision"] == "mixed" else MixedPrecisionPolicy())
    offload = CPUOffloadPolicy() if job.setup.cpu_offload else OffloadPolicy()
    kinds = _layer_classes(model)
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    ranks = distributed.mesh(job.device)
    for module in [*layers, model]:
        fully_shard(module, mesh=ranks, mp_policy=policy, offload_policy=offload, reshard_after_forward=opts["reshard"])
    if job.deferred is not None:  # the shards get their memory and the build's weights only now
        deferred.materialize(model, job.deferred, "cpu" if job.setup.cpu_offload else job.device)
    params = list(model.parameters())
    evidence = {
        "fsdp_units": len(layers) + 1,
        "fsdp_world_size": torch.distributed.get_world_size(),
        "fsdp_sharded_params": sum(isinstance(p, DTensor) for p in params),
        "fsdp_params": len(params),
        "fsdp_param_device": str(params[0].device.type),
        "fsdp_master_dtype": str(params[0].dtype).removeprefix("torch."),
        "fsdp_init": "deferred" if job.deferred is not None else "whole model first",
    }
    optimizer = make_optimizer([p for p in params if p.requires_grad], job.setup, job.uses)
    return FsdpEngine(model, optimizer), evidence | optimizer_evidence(optimizer)


def _layer_classes(model: Any) -> set[str]:
    """The transformer block classes (transformers' `_no_split_modules`, found through wrappers like peft)."""
    for module in model.modules():
        found = getattr(module, "_no_split_modules", None)
        if found:
            return set(found)
    raise ValueError(f"{type(model).__name__} names no transformer block class (_no_split_modules) to shard by")
