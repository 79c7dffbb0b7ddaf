"""Plain PyTorch: loss.backward(), the stack's optimizer (torch AdamW unless a technique picks
another), torch.save / save_pretrained checkpoints. The baseline's engine, and FSDP2's base."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..techniques.base import Evidence, Options, Technique, TrainSetup
from .base import EngineJob

# torch AdamW's implementations; pinned per cell, since fused and foreach differ by GiBs at the peak
ADAMW_IMPLEMENTATIONS: dict[str, dict[str, Any]] = {
    "fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False, "fused": False}}


@dataclass
class PlainEngine:
    model: Any
    optimizer: Any

    def backward(self, loss: Any) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, kind: str, directory: Path) -> None:
        import torch

        if kind == "model":
            self.model.save_pretrained(directory)  # a LoRA model saves its adapters only
        else:
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, directory / "state.pt")

    def optimizer_state(self) -> Iterable[Any]:
        import torch

        return (t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t))


def wrap(job: EngineJob) -> tuple[PlainEngine, Evidence]:
    optimizer = make_optimizer(list(job.trainable), job.setup, job.uses)
    return PlainEngine(job.model, optimizer), optimizer_evidence(optimizer)


def optimizer_evidence(optimizer: Any) -> Evidence:
    """An optimizer technique's proof that it built the optimizer (torchao's class, Adafactor's factors)."""
    return optimizer.evidence() if hasattr(optimizer, "evidence") else {}


def make_optimizer(params: list[Any], setup: TrainSetup, uses: tuple[tuple[Technique, Options], ...]) -> Any:
    """The stack's optimizer technique builds it, if there is one; else torch AdamW as pinned in setup."""
    import torch

    for technique, opts in uses:
        if technique.make_optimizer is not None:
            return technique.make_optimizer(params, setup, opts)
    return torch.optim.AdamW(params, lr=setup.lr, **ADAMW_IMPLEMENTATIONS[setup.optimizer_impl])
