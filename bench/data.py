"""Seeded synthetic batches: every cell with the same seed sees the same tokens.

Memory and speed do not depend on token values; fixed tokens make the first losses of two stacks
comparable, which is how a technique that claims to be exact is checked.

Three layouts of the same kind of data (`TrainSetup.data`):
- full: every row is one sequence of exactly seq_len tokens (the suite's default; no padding).
- pad: every row is one document of variable length (uniform in [min_doc_frac * seq_len, seq_len]),
  right-padded to seq_len with an attention mask; padding positions are not useful tokens.
- dynpad: the pad layout, but each batch padded only to its own longest document (what a collator
  with `padding="longest"` does), so batch shapes change from step to step; documents in drawn order
  (shuffled) or sorted by length across the run (ascending: every batch at least as long as the last).
- pack: documents of the same length distribution concatenated into rows of seq_len (the last one
  of a row cut), with position_ids restarting at each document, which transformers turns into a
  block-diagonal causal mask: a document attends only to itself; every position is a useful token.

Multi-rank cells: the global batch (batch_size * world rows) is drawn once and rank r takes its
rows, so a cell on 2 ranks at batch 1 sees the tokens of a 1-rank cell at batch 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IGNORE = -100  # label positions the loss skips


@dataclass(frozen=True)
class Batch:
    input_ids: Any  # (rows, seq_len) int64
    labels: Any  # same shape, IGNORE where nothing is predicted
    attention_mask: Any | None = None  # pad only: 1 for real tokens
    position_ids: Any | None = None  # pack only: restart at 0 at each document

    @property
    def useful_tokens(self) -> int:
        """Non-padding positions."""
        return int(self.attention_mask.sum()) if self.attention_mask is not None else self.input_ids.numel()

    def model_inputs(self) -> dict[str, Any]:
        given = {"input_ids": self.input_ids, "labels": self.labels, "attention_mask": self.attention_mask,
                 "position_ids": self.position_ids}
        return {k: v for k, v in given.items() if v is not None}

    def chunk(self, parts: int) -> list[Batch]:
        """Micro-batches along rows (gradient accumulation)."""
        def split(t: Any) -> list[Any]:
            return list(t.chunk(parts)) if t is not None else [None] * parts

        columns = zip(split(self.input_ids), split(self.labels), split(self.attention_mask),
                      split(self.position_ids), strict=True)
        return [Batch(*c) for c in columns]


def batches(layout: str, vocab_size: int, batch_size: int, seq_len: int, steps: int, seed: int, device: str,
            min_doc_frac: float = 0.1, rank: int = 0, world: int = 1, order: str = "shuffled") -> list[Batch]:
    """`steps` batches of this rank's `batch_size` rows, in the given layout (full | pad | dynpad | pack)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = batch_size * world
    if layout == "full":  # drawn in one call, as the suite always has: published first losses stay comparable
        tokens = torch.randint(0, vocab_size, (steps, rows, seq_len), generator=gen)
        whole = [Batch(t, t) for t in tokens]
    elif layout == "dynpad":
        whole = _dynamically_padded(gen, vocab_size, rows, seq_len, steps, min_doc_frac, order)
    else:
        make = _padded if layout == "pad" else _packed
        whole = [make(gen, vocab_size, rows, seq_len, min_doc_frac) for _ in range(steps)]
    mine = slice(rank * batch_size, (rank + 1) * batch_size)
    return [Batch(*(t[mine].to(device) if t is not None else None
                    for t in (b.input_ids, b.labels, b.attention_mask, b.position_ids))) for b in whole]


def _doc_length(gen: Any, seq_len: int, min_doc_frac: float) -> int:
    """Uniform in [min_doc_frac * seq_len, seq_len]."""
    import torch

    return int(torch.randint(max(1, int(min_doc_frac * seq_len)), seq_len + 1, (1,), generator=gen))


def _padded(gen: Any, vocab_size: int, rows: int, seq_len: int, min_doc_frac: float) -> Batch:
    import torch

    lengths = torch.tensor([_doc_length(gen, seq_len, min_doc_frac) for _ in range(rows)])
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    tokens = torch.randint(0, vocab_size, (rows, seq_len), generator=gen) * mask  # padding token id 0
    return Batch(tokens, tokens.masked_fill(mask == 0, IGNORE), attention_mask=mask)


def _dynamically_padded(gen: Any, vocab_size: int, rows: int, seq_len: int, steps: int, min_doc_frac: float,
                        order: str) -> list[Batch]:
    """Each step's global batch padded to its longest document (ranks share that length)."""
    import torch

    lengths = torch.randint(max(1, int(min_doc_frac * seq_len)), seq_len + 1, (steps, rows), generator=gen)
    if order == "sorted":
        lengths = lengths.flatten().sort().values.view(steps, rows)
    out = []
    for step_lengths in lengths:
        width = int(step_lengths.max())
        mask = (torch.arange(width)[None, :] < step_lengths[:, None]).long()
        tokens = torch.randint(0, vocab_size, (rows, width), generator=gen) * mask  # padding token id 0
        out.append(Batch(tokens, tokens.masked_fill(mask == 0, IGNORE), attention_mask=mask))
    return out


def _packed(gen: Any, vocab_size: int, rows: int, seq_len: int, min_doc_frac: float) -> Batch:
    import torch

    positions = torch.stack([_row_positions(gen, seq_len, min_doc_frac) for _ in range(rows)])
    tokens = torch.randint(0, vocab_size, (rows, seq_len), generator=gen)
    labels = tokens.masked_fill(positions == 0, IGNORE)  # a document's first token is not predicted from the one before
    return Batch(tokens, labels, position_ids=positions)


def _row_positions(gen: Any, seq_len: int, min_doc_frac: float) -> Any:
    """Position ids of one packed row: documents back to back, the last one cut at seq_len."""
    import torch

    parts, filled = [], 0
    while filled < seq_len:
        n = min(_doc_length(gen, seq_len, min_doc_frac), seq_len - filled)
        parts.append(torch.arange(n))
        filled += n
    return torch.cat(parts)
