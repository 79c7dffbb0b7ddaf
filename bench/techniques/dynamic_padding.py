"""Dynamic padding: each batch padded to its own longest document, not to seq_len.

What a collator with `padding="longest"` does (Hugging Face's default data collators, llama-recipes'
padding mode). Saves: padding positions up to the longest document of each batch, so a batch of
short documents costs a short step. Costs: batch shapes change from step to step, and PyTorch's
caching allocator keeps what the longest batch so far reserved: reserved memory climbs in stairs as
longer batches arrive, to that of a full seq_len batch (read `step_trace_json`; `expandable_segments`
and packing are the fixes to compare). `order=sorted` sorts documents by length over the run
(ascending), the staircase at its clearest; `shuffled` keeps them in drawn order. Documents are
uniform in [min_doc_frac * seq_len, seq_len] tokens, as with `padding` and `packing`.
"""

from __future__ import annotations

from dataclasses import replace

from .base import Options, Phase, Technique, TrainSetup


def _configure(setup: TrainSetup, opts: Options) -> TrainSetup:
    return replace(setup, data="dynpad", min_doc_frac=opts["min_doc_frac"], doc_order=opts["order"])


TECHNIQUE = Technique(
    name="dynamic_padding",
    summary="each batch padded to its longest document: shapes vary, the allocator's cache climbs in stairs",
    phase=Phase.DATA,
    slot="data",
    options={"min_doc_frac": 0.1, "order": "shuffled"},
    choices={"order": ("shuffled", "sorted")},
    ranges={"min_doc_frac": "(0, 1]"},
    configure=_configure,
)
