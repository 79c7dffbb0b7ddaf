"""An optimizer made by a technique, carrying the evidence the engine records of it
(engines/plain.optimizer_evidence); everything else (step, zero_grad, state, state_dict, param_groups) is the
optimizer's own."""

from __future__ import annotations

from typing import Any

from .base import Evidence


class Evidenced:
    def __init__(self, optimizer: Any, evidence: Evidence):
        self.optimizer, self._evidence = optimizer, evidence

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.optimizer, attr)

    def evidence(self) -> Evidence:
        return dict(self._evidence)
