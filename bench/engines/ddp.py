"""DDP (`torch.nn.parallel.DistributedDataParallel`) as the cell's engine: the multi-GPU baseline
people try before FSDP or ZeRO.

Every rank holds the whole model, its gradients and its optimizer state; backward all-reduces the
gradients in buckets while it runs. The optimizer is the stack's, on the whole model, as with
`plain`. Checkpoints are those of the plain engine, written by rank 0 only (every rank holds the same).
"""

from __future__ import annotations

from pathlib import Path

from .. import distributed
from ..techniques.base import Evidence
from .base import EngineJob
from .plain import PlainEngine, make_optimizer, optimizer_evidence


class DdpEngine(PlainEngine):
    """Trains like plain PyTorch through the DDP wrapper; rank 0 saves the wrapped model."""

    def save(self, kind: str, directory: Path) -> None:
        import torch

        if torch.distributed.get_rank() == 0:
            PlainEngine(self.model.module, self.optimizer).save(kind, directory)
        torch.distributed.barrier()


def wrap(job: EngineJob) -> tuple[DdpEngine, Evidence]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    distributed.init(job.cell.device == "cuda")
    # where the weights are, not the cell's device: a prediction runs a CUDA cell on fake CPU tensors
    cuda = next(job.model.parameters()).device.type == "cuda"
    opts = job.options_of("ddp")
    model = DistributedDataParallel(job.model, device_ids=[distributed.local_rank()] if cuda else None,
                                    bucket_cap_mb=opts["bucket_mb"], gradient_as_bucket_view=opts["bucket_view"],
                                    static_graph=_reentrant_checkpointing(job))
    evidence = {
        "ddp_world_size": torch.distributed.get_world_size(),
        "ddp_bucket_mb": opts["bucket_mb"],
        "ddp_gradient_as_bucket_view": opts["bucket_view"],
        "ddp_static_graph": _reentrant_checkpointing(job),
    }
    optimizer = make_optimizer(list(job.trainable), job.setup, job.uses)
    return DdpEngine(model, optimizer), evidence | optimizer_evidence(optimizer)


def _reentrant_checkpointing(job: EngineJob) -> bool:
    """Reentrant activation checkpointing runs a layer's backward outside DDP's autograd hooks: DDP
    then needs `static_graph` to know every parameter's gradient arrives exactly once. gc's default
    (non-reentrant) recomputes inside the same graph and needs nothing."""
    return any(technique.name == "gc" and opts["use_reentrant"] for technique, opts in job.uses)


