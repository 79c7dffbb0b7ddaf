"""Packing: the same variable-length documents as `padding`, concatenated into full rows of seq_len.

Saves: the padding. Every position is a real token, so useful tokens/s is the whole tokens/s (vs
about (1 + min_doc_frac) / 2 of it with padding) at the same memory per row. position_ids restart
at each document, and transformers turns them into a block-diagonal causal mask, so a document
attends only to itself, and its first token is not predicted from the document before it.
Costs: the block-diagonal mask (a mask keeps sdpa off its fastest kernel, as padding's does); the
last document of a row is cut. Peak memory per row is that of a full row of seq_len.
"""

from __future__ import annotations

from dataclasses import replace

from .base import Options, Phase, Technique, TrainSetup


def _configure(setup: TrainSetup, opts: Options) -> TrainSetup:
    return replace(setup, data="pack", min_doc_frac=opts["min_doc_frac"])


TECHNIQUE = Technique(
    name="packing",
    summary="variable-length documents packed into full rows: no padding, block-diagonal attention",
    phase=Phase.DATA,
    slot="data",
    options={"min_doc_frac": 0.1},
    ranges={"min_doc_frac": "(0, 1]"},
    configure=_configure,
)
