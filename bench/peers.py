"""Figures other projects publish, quoted beside ours where a matrix measures the same thing.

Quoted as published (their numbers, their setup, their page), never mixed into our tables: a board
shows them in a section of their own, next to what our matrix measured or predicted for the same
question. Each entry says where it was read and when.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedFrontier:
    """A published "longest sequence at batch 1 per GPU memory size" table."""

    matrix: str  # our matrix that answers the same question
    source: str  # who published it
    url: str
    read_on: str  # the date the page was read (the page itself carries no date)
    setup: str  # their setup, in their words (abridged)
    columns: tuple[str, ...]  # the recipes their table compares
    rows: tuple[tuple[int, tuple[int | None, ...]], ...]  # (card memory in GB, longest context per recipe; None = OOM)


UNSLOTH_LLAMA31_8B = PublishedFrontier(
    matrix="unsloth8b",
    source="Unsloth",
    url="https://docs.unsloth.ai/basics/unsloth-benchmarks (also unsloth.ai/blog/llama3-3, December 2024)",
    read_on="2026-11-23",
    setup="Llama 3.1 (8B) Instruct, 4-bit QLoRA on all linear layers (q, k, v, o, gate, up, down), rank 32, "
          "batch size 1, sequences padded to the maximum length",
    columns=("Unsloth", "Hugging Face + FA2"),
    rows=((8, (2972, None)), (12, (21848, 932)), (16, (40724, 2551)), (24, (78475, 5789)),
          (40, (153977, 12264)), (48, (191728, 15502)), (80, (342733, 28454))),
)

FRONTIERS = {f.matrix: f for f in (UNSLOTH_LLAMA31_8B,)}
