"""Training engines: what wraps a built model and owns backward, the optimizer step and saving.

One module per engine, each with `wrap(job) -> (Engine, evidence)`: `plain` (PyTorch: loss.backward(),
the stack's optimizer), `deepspeed` (ZeRO stages, offload), `fsdp` (FSDP2 fully_shard). A stack picks
one through `TrainSetup.engine`, which its engine technique sets; nothing outside this package asks
what kind of model it holds. Adding an engine: one module here plus the technique that selects it.
"""

from __future__ import annotations

import importlib

from ..techniques.base import Evidence
from .base import Engine, EngineJob


def wrap(job: EngineJob) -> tuple[Engine, Evidence]:
    """The engine the stack selected, wrapped around `job.model` (imported only when used: DeepSpeed is slow to import)."""
    module = importlib.import_module(f"{__name__}.{job.setup.engine}")
    return module.wrap(job)


__all__ = ["Engine", "EngineJob", "wrap"]
