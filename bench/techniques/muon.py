"""Muon (`torch.optim.Muon`) for the decoder layers' matrices, AdamW for everything else.

Saves: optimizer state. Muon keeps one momentum buffer per matrix (2 B/param in pure bf16) where AdamW
keeps two moments (4 B/param); the embedding, the output layer and the norms keep AdamW, as Muon's
authors and Moonshot train them (torch's Muon takes 2-D parameters only, and is meant for hidden
layers). Llama-3.2-3B's decoder matrices are 2.8 of its 3.2 B parameters: about 5 GiB of its 12 GiB of
AdamW state. Costs: each step orthogonalizes every matrix's update by `ns_steps` Newton-Schulz
iterations in bf16, three matmuls each (X X^T, its square, that times X), one matrix at a time (torch's
Muon has no foreach path): 2 x ns_steps x (2 m^2 n + m^3) FLOPs for an m x n matrix (m <= n), a
fixed cost per optimizer step whatever the batch (bench predict counts it in the step's FLOPs), and
temporaries the size of the largest matrix plus its m x m Gram matrices. Not exact: another update, so
the losses leave AdamW's after the first step. The learning rate is scaled per matrix as Moonshot's
recipe does (`adjust_lr_fn="match_rms_adamw"`), so the AdamW learning rate and weight decay of the
baseline carry over. Predicted: the step runs on fake tensors (it reads no value back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._lowrank import param_groups
from .base import Evidence, Options, Phase, Technique, TrainSetup

if TYPE_CHECKING:
    from ..cells import Cell

WEIGHT_DECAY = 0.01  # torch AdamW's default, which the baseline trains with; Muon's own default is 0.1


class MuonWithAdamW:
    """Two optimizers stepped as one: Muon over the decoder matrices, AdamW over the rest (none where every
    trainable parameter is a decoder matrix)."""

    def __init__(self, muon: Any, adamw: Any | None, evidence: Evidence):
        self.parts = [part for part in (muon, adamw) if part is not None]
        self._evidence = evidence

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for part in self.parts for p, s in part.state.items()}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in part.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {type(part).__name__: part.state_dict() for part in self.parts}

    def evidence(self) -> Evidence:
        return dict(self._evidence)


def make(params: list[Any], setup: TrainSetup, opts: Options) -> MuonWithAdamW:
    import torch

    from ..engines.plain import ADAMW_IMPLEMENTATIONS

    matrices, rest = (group["params"] for group in param_groups(params, {}))
    if not matrices:
        raise ValueError("muon: the model has no trainable decoder matrix to orthogonalize")
    # Nesterov's (torch's default) orthogonalizes a fresh tensor. Without it, torch before 2.15 normalizes the bf16
    # momentum buffer itself in place (`grad.bfloat16()` is the buffer; fixed by pytorch/pytorch#194664): checked
    # here under 2.13, a buffer of norm 6.93 came out of one step at 1.00
    muon = torch.optim.Muon(matrices, lr=setup.lr, weight_decay=WEIGHT_DECAY, ns_steps=opts["ns_steps"],
                            adjust_lr_fn="match_rms_adamw", nesterov=True)
    adamw = torch.optim.AdamW(rest, lr=setup.lr, weight_decay=WEIGHT_DECAY,
                              **ADAMW_IMPLEMENTATIONS[setup.optimizer_impl]) if rest else None
    return MuonWithAdamW(muon, adamw, {"muon_matrices": len(matrices), "muon_adamw_params": len(rest),
                                       "muon_ns_steps": opts["ns_steps"]})


def _check(cell: Cell, opts: Options) -> str | None:
    """Before any cell runs: torch's Muon is a recent addition (2.11, the oldest torch this suite is run
    under, has it)."""
    import torch

    return None if hasattr(torch.optim, "Muon") else f"torch {torch.__version__} has no torch.optim.Muon"


TECHNIQUE = Technique(
    name="muon",
    summary="torch Muon on the decoder matrices (1 momentum: 2 B/param bf16), AdamW on the rest: Newton-Schulz per step",
    phase=Phase.OPTIMIZER,
    slot="optimizer",
    options={"ns_steps": 5},
    ranges={"ns_steps": "[1, 99]"},  # torch's Muon refuses 100 or more
    # DeepSpeed owns the optimizer; on FSDP2's shards each rank would orthogonalize its slice of a matrix,
    # which is not Muon's update (a sharded Muon gathers each matrix first). Full-parameter, as GaLore: the
    # split by shape (bench/techniques/_lowrank.py) tells the vocabulary's matrices apart, not adapters' ranks
    conflicts=("zero2", "zero3", "fsdp", "lora", "dora", "qlora", "int8_lora", "unsloth"),
    check_cell=_check,
    make_optimizer=make,
)
