"""Pinned host memory as PyTorch's CachingHostAllocator hands it out (read in torch 2.13's
ATen/core/CachingHostAllocator.h; the same in 2.11): what a pinned tensor costs the host.

- Every request is rounded up to the next power of two (with the default `pinned_max_round_threshold`
  and `pinned_max_cached_size`, both unlimited): a 24 MiB activation pins 32 MiB.
- A freed block is cached in the free list of its size and handed to the next request of that size;
  it is never given back to the system while the process lives (nothing in a training step empties
  the host cache). So what the host holds is every block ever created, free or not.

A block freed on a stream becomes reusable once its recorded events complete; this model reuses it at
once, as a step that waits for its copies (the suite's offloads do) finds it.
"""

from __future__ import annotations

from collections import Counter


def block_bytes(nbytes: int) -> int:
    """The block a pinned request of `nbytes` gets: the next power of two (0 for nothing)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


class PinnedHostCache:
    """Blocks by size: created (held by the host for good) and free (cached for reuse)."""

    def __init__(self) -> None:
        self.created_bytes = 0
        self._free: Counter[int] = Counter()  # block size -> cached blocks of it

    def allocate(self, nbytes: int) -> int:
        """A block for the request, from the cache if one of its size is free; returns its size."""
        size = block_bytes(nbytes)
        if self._free[size]:
            self._free[size] -= 1
        else:
            self.created_bytes += size
        return size

    def release(self, size: int) -> None:
        """A block's tensor died: the block is cached, not given back."""
        self._free[size] += 1
