"""What the CUDA caching allocator reserves for a trace of allocations and frees.

A card runs out of memory on what the allocator has *reserved* (its segments, cudaMalloc'ed and
kept), not on what live tensors hold: a freed block stays cached for the next request that fits, and
a block that is too big is split, so reserved memory exceeds allocated by fragmentation. This module
replays the fake run's trace (bench/predict/counter.py: every allocation and free, in order, rounded
to 512 B) through a model of PyTorch's native allocator as c10/cuda/CUDACachingAllocator.cpp has it
in torch 2.9 to 2.13 (the rules below have not changed across those versions), default settings:

- two pools: requests of at most 1 MiB (small) and larger ones (large), one stream;
- a request takes the smallest cached free block of its pool that holds it (best fit; the lowest
  address among equals);
- none: a new segment, 2 MiB for a small request, 20 MiB for one under 10 MiB, else the request
  rounded up to 2 MiB;
- the block is split when the rest is at least 512 B (small pool) or more than 1 MiB (large pool);
- a freed block merges with free neighbours of its segment and returns to its pool (never to CUDA);
- when a new segment would not fit on the card, every fully free segment is released and the
  request retried; if it still does not fit, the allocator raises an OOM.

Not modelled: `expandable_segments` (segments grow in place), `max_split_size_mb`, the garbage
collection threshold, several streams (NCCL, offload copies), CUDA graphs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MIB = 1 << 20
SMALL_REQUEST = 1 * MIB  # kSmallSize: at most this goes to the small pool
SMALL_SEGMENT = 2 * MIB  # kSmallBuffer
LARGE_SEGMENT = 20 * MIB  # kLargeBuffer: the segment of a request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge
MIN_BLOCK = 512  # kMinBlockSize


@dataclass(eq=False)
class Block:
    """A piece of a segment, free (in its pool) or handed out; neighbours within the segment linked."""

    segment: int
    address: int
    size: int
    small: bool
    free: bool = True
    prev: Block | None = None
    next: Block | None = None


@dataclass
class Replay:
    """The allocator's state along a trace: reserved now and at its most, and an OOM if one happened."""

    capacity_bytes: int | None = None  # what torch may reserve on the card; None: unbounded
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    oom_at: int | None = None  # index of the request that could not be served
    samples: list[int] = field(default_factory=list)  # reserved bytes at the positions asked for
    retries: int = 0  # new segments that did not fit until the cache was released (num_alloc_retries)
    segments: dict[int, int] = field(default_factory=dict)  # segment id -> size
    _heads: dict[int, Block] = field(default_factory=dict)  # segment id -> its first block
    _pools: dict[bool, list[tuple[int, int, Block]]] = field(default_factory=lambda: {True: [], False: []})
    _next_address: int = 0
    _segments_made: int = 0

    def malloc(self, nbytes: int) -> Block | None:
        small = nbytes <= SMALL_REQUEST
        block = self._best_fit(nbytes, small) or self._new_segment(nbytes, small)
        if block is None:
            return None
        self._take(block)
        if _should_split(block.size - nbytes, small):
            rest = Block(block.segment, block.address + nbytes, block.size - nbytes, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, nbytes
            self._put(rest)
        block.free = False
        return block

    def free(self, block: Block) -> None:
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._take(neighbour)
                block = self._merge(block, neighbour)
        self._put(block)

    # --- pools ---

    def _best_fit(self, nbytes: int, small: bool) -> Block | None:
        pool = self._pools[small]
        at = bisect.bisect_left(pool, (nbytes, -1))
        return pool[at][2] if at < len(pool) else None

    def _put(self, block: Block) -> None:
        bisect.insort(self._pools[block.small], (block.size, block.address, block))

    def _take(self, block: Block) -> None:
        pool = self._pools[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.address))]

    @staticmethod
    def _merge(block: Block, neighbour: Block) -> Block:
        first, second = (neighbour, block) if neighbour.address < block.address else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        first.free = True
        return first

    # --- segments ---

    def _new_segment(self, nbytes: int, small: bool) -> Block | None:
        size = segment_size(nbytes)
        if not self._fits(size):
            self.retries += 1
            self._release_cached()
            if not self._fits(size):
                return None
        segment, self._segments_made = self._segments_made, self._segments_made + 1
        block = Block(segment, self._next_address, size, small)
        self._next_address += size
        self.segments[segment], self._heads[segment] = size, block
        self.reserved_bytes += size
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self._put(block)
        return block

    def _fits(self, size: int) -> bool:
        return self.capacity_bytes is None or self.reserved_bytes + size <= self.capacity_bytes

    def _release_cached(self) -> None:
        """cudaFree every segment that is one free block (release_cached_blocks)."""
        for segment, head in list(self._heads.items()):
            if head.free and head.next is None and head.size == self.segments[segment]:
                self._take(head)
                self.reserved_bytes -= self.segments.pop(segment)
                del self._heads[segment]


def _should_split(rest: int, small: bool) -> bool:
    """A small block is split down to 512 B; a large one only when more than 1 MiB would be left over."""
    return rest >= MIN_BLOCK if small else rest > SMALL_REQUEST


def segment_size(nbytes: int) -> int:
    """The cudaMalloc a request makes when no cached block holds it (get_allocation_size)."""
    if nbytes <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


def trace(records: Iterable[Any]) -> list[tuple[str, int, int]]:
    """The counter's records (bench/predict/counter.py) as the allocator saw them, in order: each
    allocation and free; a free before an allocation of the same instant (a gradient summed in place
    takes over its operand's block); records that never counted left out."""
    events = []
    for ident, record in enumerate(records):
        if record.made < 0 or record.freed == record.made:
            continue
        events.append((record.made, 1, "malloc", ident, record.nbytes))
        if record.freed is not None:
            events.append((record.freed, 0, "free", ident, record.nbytes))
    return [(kind, ident, nbytes) for _, _, kind, ident, nbytes in sorted(events)]


def positions(records: list[Any], event_counts: list[int]) -> list[int]:
    """For each event count of the counter (e.g. where a step ended), how many trace events precede it."""
    made = sorted(r.made for r in records if r.made >= 0 and r.freed != r.made)
    freed = sorted(r.freed for r in records if r.made >= 0 and r.freed is not None and r.freed != r.made)
    return [bisect.bisect_left(made, end) + bisect.bisect_left(freed, end) for end in event_counts]


def replay(events: Iterable[tuple[str, int, int]], capacity_bytes: int | None = None,
           samples: Iterable[int] = ()) -> Replay:
    """Replays ("malloc" | "free", id, bytes) events in order; stops at the first OOM. `samples`:
    after how many events to read reserved memory (Replay.samples)."""
    state = Replay(capacity_bytes)
    live: dict[int, Block] = {}
    wanted = sorted(samples)
    events = list(events)
    for index, (kind, ident, nbytes) in enumerate(events):
        while wanted and wanted[0] <= index:
            state.samples.append(state.reserved_bytes)
            wanted.pop(0)
        if kind == "free":
            state.free(live.pop(ident))
            continue
        block = state.malloc(nbytes)
        if block is None:
            state.oom_at = index
            break
        live[ident] = block
    state.samples += [state.reserved_bytes] * len(wanted) if state.oom_at is None else []
    return state
