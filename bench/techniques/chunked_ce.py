"""Chunked cross-entropy: the loss computed over chunks of tokens, each chunk's logits recomputed in
backward, so the full (tokens x vocabulary) logits never exist (torchtune's chunked output loss, with
each chunk checkpointed).

Saves: the logits and their fp32 copies. At a 128k vocabulary one 4k-token row's logits are 1 GiB in
bf16 and 2 GiB in fp32, and the loss's backward holds several such tensors at once: on Llama-3.2-3B
that is the largest temporary of the step. With `chunks` pieces only one chunk's logits live at a
time, in forward and again in backward. Costs: the lm_head matmul runs twice (forward, then again in
backward); small chunks use the GPU less well. Exact: the same mean over the same tokens, summed in
another order, so the losses must track the baseline's. Acts on the innermost causal LM (through
LoRA wrappers); Liger's fused linear cross-entropy does the same job in a Triton kernel.
"""

from __future__ import annotations

import functools
from typing import Any

from ._loss_head import IGNORE, replace_loss
from .base import Evidence, Options, Phase, Technique


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    causal_lm = replace_loss(model, "chunked_ce", functools.partial(chunked_loss, chunks=opts["chunks"]))
    return model, {"chunked_ce_chunks": opts["chunks"], "chunked_ce_model": causal_lm}


def chunked_loss(hidden: Any, lm_head: Any, labels: Any, chunks: int) -> Any:
    """The mean next-token cross-entropy over the positions whose (shifted) label is not ignored, as
    transformers computes it, one checkpointed chunk of positions at a time."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    targets = F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)  # position t predicts token t + 1
    flat = hidden.reshape(-1, hidden.shape[-1])
    total = hidden.new_zeros((), dtype=torch.float32)
    for part, wanted in zip(flat.chunk(chunks), targets.chunk(chunks), strict=True):
        total = total + checkpoint(_chunk_loss, part, wanted, lm_head, use_reentrant=False)
    return total / (targets != IGNORE).sum()


def _chunk_loss(part: Any, wanted: Any, lm_head: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(lm_head(part).float(), wanted, ignore_index=IGNORE, reduction="sum")


TECHNIQUE = Technique(
    name="chunked_ce",
    summary="cross-entropy over checkpointed chunks of tokens: the full logits never exist; lm_head runs twice",
    phase=Phase.PATCH,
    options={"chunks": 8},
    ranges={"chunks": "[1, inf)"},
    conflicts=("liger",),
    apply=_apply,
)
