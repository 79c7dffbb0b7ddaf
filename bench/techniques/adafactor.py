"""torch's Adafactor (`torch.optim.Adafactor`): the second moment factored, and no first moment.

Saves: optimizer state. AdamW keeps two moments the size of every parameter (4 B/param in pure bf16);
Adafactor keeps, for each weight matrix, the running mean of its squared gradient per row and per column
(a 3072 x 8192 projection: 11,264 values, not 2 x 25.2 M), and a whole second moment only for vectors
(the norms): a few KiB a layer. Costs: its step reads two norms of each parameter back to the host (two
device synchronisations a parameter), and rebuilds each matrix's second moment from its factors at the
weight's full size: `impl=foreach` (torch's choice on a GPU) rebuilds every matrix at once, a temporary at
the optimizer step the size of all the weights (2 B/param in pure bf16, about what AdamW's second moment
holds); `forloop` one matrix at a time. Not exact: no momentum, and a step relative to each weight's norm
(`lr` caps it), so the losses leave AdamW's after the first step.
Predicted: the step runs on fake tensors, its reads of a number answered (bench/predict/adafactor.py).
"""

from __future__ import annotations

from typing import Any

from ._evidenced import Evidenced
from .base import Options, Phase, Technique, TrainSetup


def make(params: list[Any], setup: TrainSetup, opts: Options) -> Evidenced:
    import torch

    foreach = opts["impl"] == "foreach"  # pinned, as AdamW's is: torch's default depends on the device
    factored = sum(p.dim() > 1 for p in params)  # a row and a column each; the others a whole second moment
    return Evidenced(torch.optim.Adafactor(params, lr=setup.lr, foreach=foreach),
                     {"adafactor_impl": opts["impl"], "adafactor_factored_params": factored,
                      "adafactor_vector_params": len(params) - factored})


TECHNIQUE = Technique(
    name="adafactor",
    summary="torch Adafactor: 2nd moment factored by row and column, no 1st: ~0 B/param of state; foreach: step temps",
    phase=Phase.OPTIMIZER,
    slot="optimizer",
    options={"impl": "foreach"},
    choices={"impl": ("foreach", "forloop")},
    # DeepSpeed owns the optimizer; on FSDP2's sharded parameters torch's step fails (torch 2.13: no sharding
    # propagation for squaring a norm of a DTensor shard)
    conflicts=("zero2", "zero3", "fsdp"),
    make_optimizer=make,
)
