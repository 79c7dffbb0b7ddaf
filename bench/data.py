"""Seeded synthetic token batches: every cell with the same seed sees the same tokens.

Memory and speed do not depend on token values; fixed tokens make the first losses of two stacks
comparable, which is how a technique that claims to be exact is checked.
"""

from __future__ import annotations

from typing import Any


def token_batches(vocab_size: int, batch_size: int, seq_len: int, steps: int, seed: int, device: str) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    batches = torch.randint(0, vocab_size, (steps, batch_size, seq_len), generator=gen)
    return [b.to(device) for b in batches]
