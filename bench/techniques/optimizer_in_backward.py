"""Optimizer step in backward: each parameter has its own AdamW, stepped by a hook the moment its
gradient is complete, and the gradient is freed right after (torchtune's `optimizer_in_bwd`).

Saves: the gradients. Without it every gradient lives from its backward until the optimizer step, so
the step's peak holds a whole model's worth of gradients (2 B/param in pure bf16); with it only the
gradients of the parameters backward is working on exist at once. Costs: one small AdamW step per
parameter (the fused kernel runs per tensor, not over the model), issued from autograd's thread
during backward. Exact: the same AdamW update, so the losses must track the baseline's. No gradient
accumulation (a parameter would step after each micro-batch) and no clipping of the global gradient
norm (no moment where all gradients exist); not with engines that own the optimizer or reduce
gradients themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Options, Phase, Technique, TrainSetup


class StepInBackward:
    """An optimizer per parameter, each stepped from its post-accumulate-grad hook. To the engine it
    looks like one optimizer whose own step has nothing left to do."""

    def __init__(self, params: list[Any], make: Callable[[list[Any]], Any]):
        self.by_param = {param: make([param]) for param in params}
        self.hooks = [param.register_post_accumulate_grad_hook(self._step) for param in params]

    def evidence(self) -> dict[str, Any]:
        return {"optimizer_in_backward_optimizers": len(self.by_param), "optimizer_in_backward_hooks": len(self.hooks)}

    def _step(self, param: Any) -> None:
        optimizer = self.by_param[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # the gradient is freed now, not at the end of the step

    def step(self) -> None:
        """Every parameter stepped in backward already."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every gradient was freed in backward already."""

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for optimizer in self.by_param.values() for p, s in optimizer.state.items()}

    def state_dict(self) -> dict[str, Any]:
        return {str(i): optimizer.state_dict() for i, optimizer in enumerate(self.by_param.values())}


def _make(params: list[Any], setup: TrainSetup, opts: Options) -> StepInBackward:
    import torch

    from ..engines.plain import ADAMW_IMPLEMENTATIONS

    return StepInBackward(params, lambda group: torch.optim.AdamW(group, lr=setup.lr,
                                                                  **ADAMW_IMPLEMENTATIONS[setup.optimizer_impl]))


TECHNIQUE = Technique(
    name="optimizer_in_backward",
    summary="AdamW stepped per parameter in backward, each gradient freed at once: no gradients at the step",
    phase=Phase.OPTIMIZER,
    slot="optimizer",
    conflicts=("grad_accum", "zero2", "zero3", "fsdp", "ddp"),
    make_optimizer=_make,
)
