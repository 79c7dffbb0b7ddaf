"""Padding: variable-length documents, one per row, right-padded to seq_len with an attention mask.

What most fine-tuning recipes do by default. Saves nothing: it is the reference that packing is
measured against. Costs: every padding position is computed and stored like a real token (the
GPU's time and activation memory spent on nothing: read useful_tokens_per_s next to tokens_per_s),
and the attention mask keeps sdpa off its fastest mask-free kernel. Documents are uniform in
[min_doc_frac * seq_len, seq_len] tokens, so about (1 + min_doc_frac) / 2 of positions are useful.
"""

from __future__ import annotations

from dataclasses import replace

from .base import Options, Phase, Technique, TrainSetup


def _configure(setup: TrainSetup, opts: Options) -> TrainSetup:
    return replace(setup, data="pad", min_doc_frac=opts["min_doc_frac"])


TECHNIQUE = Technique(
    name="padding",
    summary="variable-length documents padded to seq_len: padding costs time and memory like real tokens",
    phase=Phase.DATA,
    slot="data",
    options={"min_doc_frac": 0.1},
    ranges={"min_doc_frac": "(0, 1]"},
    configure=_configure,
)
