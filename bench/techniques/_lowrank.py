"""What the low-rank gradient optimizers share (not a technique): which parameters they project, and
an optimizer whose state, as the suite counts it, includes the projection matrices.

GaLore and APOLLO project the gradient of each 2-D weight of the decoder layers (attention and MLP
projections) to `rank` dimensions and keep Adam's moments there; embeddings, the output layer, norms
and biases keep full AdamW state (as both papers train them). Muon (muon.py) splits the parameters the
same way: its Newton-Schulz update for the decoder matrices, AdamW for the rest.
"""

from __future__ import annotations

from typing import Any


def param_groups(params: list[Any], low_rank: dict[str, Any]) -> list[dict[str, Any]]:
    """Two groups: the decoder layers' 2-D weights, with the low-rank settings; everything else. The
    optimizer sees parameters, not names: the embedding and output layer are the 2-D weights with
    the vocabulary as a dimension, the largest dimension of all."""
    matrices = [p for p in params if p.dim() == 2]
    vocab = max((max(p.shape) for p in matrices), default=0)
    projected = [p for p in matrices if vocab not in p.shape]
    rest = [p for p in params if not any(p is q for q in projected)]
    return [{"params": projected, **low_rank}, {"params": rest}]


class LowRank:
    """The optimizer, with its projectors' matrices counted as state and the evidence of what it projects."""

    def __init__(self, optimizer: Any, name: str, rank: int):
        self.optimizer, self.name, self.rank = optimizer, name, rank

    def __getattr__(self, attr: str) -> Any:  # step, zero_grad, param_groups, state_dict: the optimizer's
        return getattr(self.optimizer, attr)

    @property
    def state(self) -> dict[Any, dict[str, Any]]:
        """Each parameter's state, its projector's tensors included (kept in a Python object there)."""
        import torch

        out = {}
        for param, state in self.optimizer.state.items():
            projector = state.get("projector")
            extra = {f"projector.{k}": v for k, v in vars(projector).items() if torch.is_tensor(v)} if projector else {}
            out[param] = {**state, **extra}
        return out

    def evidence(self) -> dict[str, Any]:
        projected = self.optimizer.param_groups[0]["params"]
        return {f"{self.name}_projected_params": len(projected), f"{self.name}_rank": self.rank}
