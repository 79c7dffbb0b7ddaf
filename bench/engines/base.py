"""The engine interface: the four things a training step needs from whatever owns the model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..techniques.base import Options, Technique, TrainSetup

if TYPE_CHECKING:
    from ..cells import Cell


@dataclass(frozen=True)
class EngineJob:
    """What an engine is given: the cell, its stack's setup and techniques, and the built model."""

    cell: Cell
    setup: TrainSetup
    uses: tuple[tuple[Technique, Options], ...]  # the stack, in phase order
    model: Any  # built, the stack applied, in train mode
    trainable: tuple[Any, ...]  # its parameters with requires_grad, before any sharding
    device: str = ""  # where its tensors go (the cell's device; a prediction's fake "cpu")
    deferred: Any = None  # a bench.deferred.Record: the parameters are on meta, to be made and initialised

    def options_of(self, name: str) -> Options:
        return next(opts for technique, opts in self.uses if technique.name == name)


class Engine(Protocol):
    model: Any  # what the forward pass is called on

    def backward(self, loss: Any) -> None:
        """Gradients of `loss` (accumulated over micro-batches until `step`)."""

    def step(self) -> None:
        """One optimizer step; the gradients are zeroed (freed) after it."""

    def save(self, kind: str, directory: Path) -> None:
        """A checkpoint as trainers write it: `model` (the exported weights) or `full` (+ optimizer state)."""

    def optimizer_state(self) -> Iterable[Any]:
        """The tensors the optimizer holds as state (this rank's)."""
