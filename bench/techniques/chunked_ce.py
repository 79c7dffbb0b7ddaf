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

import types
from typing import Any

from .base import Evidence, Options, Phase, Technique

IGNORE = -100


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    causal_lm = next((m for m in model.modules() if hasattr(m, "lm_head") and hasattr(m, "model")), None)
    if causal_lm is None:
        raise RuntimeError("chunked_ce: no causal LM with `model` and `lm_head` found")
    causal_lm.forward = types.MethodType(_chunked_forward(opts["chunks"]), causal_lm)
    return model, {"chunked_ce_chunks": opts["chunks"], "chunked_ce_model": type(causal_lm).__name__}


def _chunked_forward(chunks: int) -> Any:
    def forward(self: Any, input_ids: Any = None, labels: Any = None, attention_mask: Any = None,
                position_ids: Any = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            **kwargs).last_hidden_state
        return CausalLMOutputWithPast(loss=chunked_loss(hidden, self.lm_head, labels, chunks))

    return forward


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
