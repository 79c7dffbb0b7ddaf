"""Cut cross-entropy (Apple's `cut-cross-entropy`): the loss computed from the last hidden states and
the output layer's weight without the logits ever written to memory.

Saves: the (tokens x vocabulary) logits, their fp32 copy and their gradient. Its forward kernel
computes each token's log-sum-exp over vocabulary blocks held on chip, and keeps only that (fp32 per
token) and the average logit per vocabulary entry (fp32 per entry); its backward recomputes the
logit blocks and writes the two gradients straight into the hidden states' and the weight's. At a
128k vocabulary one 4k-token row's fp32 logits alone are 2 GiB. Costs: the logits are computed
twice (forward, and again in backward); gradient filtering (`filter_eps`, the package's default)
skips vocabulary blocks whose softmax is below bf16's resolution, so the gradient is close to exact,
not bit-exact. Acts on the innermost causal LM, as `chunked_ce` does; Liger's fused linear
cross-entropy is the same idea in another kernel.

`impl=cce` runs the Triton kernels (CUDA; hidden states in bf16 or fp16). `impl=torch_compile` is
the package's own fallback: the plain logits and loss, compiled as one graph; it runs anywhere, and
is what the CPU tests run.
Predicted: `impl=cce`'s Python wrappers on fake tensors, kernel launches no-ops (bench/predict/cce.py);
`impl=torch_compile` as any compiled code, inductor's code for the CPU run on fake tensors
(bench/predict/compiled.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ._loss_head import IGNORE, replace_loss
from .base import Evidence, Options, Phase, Technique

if TYPE_CHECKING:
    from ..cells import Cell


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    from importlib import metadata

    causal_lm = replace_loss(model, "cce", functools.partial(cut_loss, impl=opts["impl"]))
    return model, {"cce_impl": opts["impl"], "cce_model": causal_lm,
                   "cce_version": metadata.version("cut-cross-entropy")}


def cut_loss(hidden: Any, lm_head: Any, labels: Any, impl: str) -> Any:
    """The mean next-token cross-entropy over the labels not ignored (transformers' loss), by
    cut-cross-entropy. Under autocast the hidden states and the weight are cast to its dtype first,
    as autocast casts a linear layer's operands (the kernel's backward takes half precision only)."""
    import torch
    from cut_cross_entropy import linear_cross_entropy

    weight = lm_head.weight
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return linear_cross_entropy(hidden, weight, labels, ignore_index=IGNORE, shift=True, impl=impl)


def _check_cell(cell: Cell, opts: Options) -> str | None:
    if opts["impl"] == "cce" and cell.device != "cuda":
        return "cce(impl=cce) runs Triton kernels on CUDA; cce(impl=torch_compile) runs on any device"
    return None


TECHNIQUE = Technique(
    name="cce",
    summary="cut cross-entropy (Apple): the loss without logits in memory, computed block by block on chip",
    phase=Phase.PATCH,
    options={"impl": "cce"},
    choices={"impl": ("cce", "torch_compile")},
    packages=("cut_cross_entropy",),
    conflicts=("liger", "chunked_ce"),
    compiles_forward=True,
    check_cell=_check_cell,
    apply=_apply,
)
