"""What the CUDA caching allocator reserves for a trace of allocations and frees.

A card runs out of memory on what the allocator has *reserved* (its segments, cudaMalloc'ed and
kept), not on what live tensors hold: a freed block stays cached for the next request that fits, and
a block that is too big is split, so reserved memory exceeds allocated by fragmentation. This module
replays the fake run's trace (bench/predict/counter.py: every allocation and free, in order, rounded
to 512 B) through a model of PyTorch's native allocator as c10/cuda/CUDACachingAllocator.cpp has it
in torch 2.9 to 2.13 (the rules below have not changed across those versions), default settings:

- two pools: requests of at most 1 MiB (small) and larger ones (large);
- every block belongs to the stream it was first allocated on ("once freed, blocks can be
  re-allocated on the same stream, but not on any other stream", the allocator's own header): a
  request takes only its own stream's cached blocks, so a free block of one stream is reserved
  memory no other stream can use (FSDP2 allocates its all-gather and reduce-scatter buffers on
  streams of their own);
- a request takes the smallest cached free block of its pool and stream that holds it (best fit;
  the lowest address among equals). Where CUDA puts a segment decides which of two equal blocks
  is taken, so the model places its segments as CUDA did in the allocator's own snapshots (an H200,
  CUDA 13: tests/gpu_traces/), segment for segment: in the lowest gap between earlier segments that
  holds it, at the gap's start; else below them all. A segment of 32 MiB or more starts on a 32 MiB
  boundary, a smaller one on 2 MiB. A released segment's range is a gap again (not seen yet). The
  published H100 cells agree: their 56 llama3b cells replayed with this placement have peak reserved
  within 0.009% of the GPU's (median; 5 over 1%), with ascending addresses 0.054% (9 over 1%), though
  `gc + adamw8bit` at s2048 b2 takes a cached 1 GB block under this one (-3.97%) that it does not under
  ascending addresses (-0.09%) (`tools/placement_check.py llama3b`; torch 2.11.0, transformers 5.17.0);
- none: a new segment, 2 MiB for a small request, 20 MiB for one under 10 MiB, else the request
  rounded up to 2 MiB;
- the block is split when the rest is at least 512 B (small pool) or more than 1 MiB (large pool);
- a freed block merges with free neighbours of its segment and returns to its pool (never to CUDA);
- when a new segment would not fit on the card, every fully free segment is released and the
  request retried; if it still does not fit, the allocator raises an OOM;
- `torch.cuda.empty_cache()` (a "release" event) releases every fully free segment too.

The settings of PYTORCH_CUDA_ALLOC_CONF the model replays are a `Settings`; its defaults are torch's.

With `max_split_size_mb:N` (Settings.max_split_bytes; torch's default is no limit) blocks of N MiB or
more are "oversize":

- a request under N MiB is never served from an oversize block, and an oversize request only from one
  less than 20 MiB larger than itself (max_non_split_rounding_size at its default): then a new
  segment is made;
- a request of N MiB or more never splits the block it takes;
- before releasing the whole cache to retry a new segment that does not fit, the allocator releases
  the smallest oversize cached block at least as large as the request (and N), or failing one, the
  largest oversize blocks until as much is released (release_available_cached_blocks).

With `garbage_collection_threshold:F` (Settings.gc_threshold; read from CUDACachingAllocator.cpp at commit
001074d, the same call sites in every copy found), and only under a memory fraction
(`torch.cuda.set_per_process_memory_fraction`: `fraction=True`, the capacity being its allowance; torch
runs the collection only when a fraction is set), a request no cached block holds first checks whether
reserved exceeds F of the allowance; if so, the allocator releases whole free segments of the large
pool (of every stream) that have waited longest for reuse, and again, until reserved is back under F
(garbage_collect_cached_blocks):

- a block's age is the number of large-pool requests since it was last put back free (pool.
  get_free_blocks_call_count less its gc_count_base);
- each round releases every whole free segment at least as old as the average of them all.

With `expandable_segments:True` (ExpandableReplay) each pool of each stream is one virtual address
range whose physical pages are mapped on demand, in pages of 2 MiB (small pool) or 20 MiB (large pool):

- a request still takes the best-fitting free mapped block first, but a free block just before unmapped
  space counts as large as it could grow: it is taken only when no other free block holds the request
  (get_free_block walks on from the best fit while the next block could grow less). A plain best fit
  reserved 2.3% less than CUDA on the recorded walk (tests/gpu_traces/), this rule the same;
- none: the lowest-addressed run of free and unmapped space that holds it (starting at a free block
  just before an unmapped one, so the new pages extend it) gets pages mapped until it does;
- any block is split when at least 512 B would be left over (both pools);
- freed blocks merge with free mapped neighbours and stay mapped (reserved);
- when mapping would exceed the card, every whole free page is unmapped and the request retried.

A trace's events are ("malloc" | "free" | "release", id, bytes) with the stream as an optional fourth
element (0, the default stream, when absent). Frees take effect at once: the model assumes no
`record_stream` (FSDP2 keeps a buffer alive until the other stream is done with it instead).

The collection and `max_split_size_mb` combine (the collection first, then a new segment, then the oversize
release, then the whole cache). Not modelled: `max_non_split_rounding_mb` other than its default,
`record_stream`'s deferred frees, CUDA graphs, expandable segments with either other setting.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

MIB = 1 << 20
SMALL_REQUEST = 1 * MIB  # kSmallSize: at most this goes to the small pool
SMALL_SEGMENT = 2 * MIB  # kSmallBuffer
LARGE_SEGMENT = 20 * MIB  # kLargeBuffer: the segment of a request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge
MIN_BLOCK = 512  # kMinBlockSize
VA_LARGE_ALIGN = 32 * MIB  # CUDA starts a segment this large or larger on such a boundary (seen, not documented)


@dataclass(frozen=True)
class Settings:
    """PYTORCH_CUDA_ALLOC_CONF as the model replays it; the defaults are torch's."""

    expandable: bool = False  # expandable_segments:True (ExpandableReplay)
    max_split_bytes: int | None = None  # max_split_size_mb: blocks this large are never split; None: no limit
    gc_threshold: float | None = None  # garbage_collection_threshold: acts only under a memory fraction

    def __post_init__(self) -> None:
        if self.expandable and (self.max_split_bytes is not None or self.gc_threshold is not None):
            raise ValueError("max_split_size_mb and garbage_collection_threshold are not modelled with "
                             "expandable_segments")


@dataclass(eq=False)
class Block:
    """A piece of a segment, free (in its pool) or handed out; neighbours within the segment linked."""

    segment: int
    address: int
    size: int
    small: bool
    stream: int = 0
    free: bool = True
    gc_base: int = 0  # large-pool requests made when the block was last put back free (gc_count_base)
    prev: Block | None = None
    next: Block | None = None


@dataclass
class Replay:
    """The allocator's state along a trace: reserved now and at its most, and an OOM if one happened."""

    capacity_bytes: int | None = None  # what torch may reserve on the card; None: unbounded
    settings: Settings = Settings()
    fraction: bool = False  # the capacity is a memory fraction's allowance, not the card's end
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    # the blocks handed out, as torch's allocated_bytes counts them: a block not split keeps its tail
    # (a large one up to 1 MiB past the request), so this exceeds the requests' sum
    allocated_bytes: int = 0
    peak_allocated_bytes: int = 0
    oom_at: int | None = None  # index of the request that could not be served
    samples: list[int] = field(default_factory=list)  # reserved bytes at the positions asked for
    made: list[tuple[int, int]] = field(default_factory=list)  # (request's event index, bytes) where reserved grew
    retries: int = 0  # new segments that did not fit until the cache was released (num_alloc_retries)
    segments: dict[int, int] = field(default_factory=dict)  # segment id -> size
    _heads: dict[int, Block] = field(default_factory=dict)  # segment id -> its first block
    # (stream, small pool?) -> its free blocks, sorted by (size, address)
    _pools: dict[tuple[int, bool], list[tuple[int, int, Block]]] = field(default_factory=lambda: defaultdict(list))
    _ranges: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of every segment, by address
    _segments_made: int = 0
    _large_requests: int = 0  # the large pool's get_free_blocks_call_count: the clock of blocks' ages

    def malloc(self, nbytes: int, stream: int = 0) -> Block | None:
        small = nbytes <= SMALL_REQUEST
        self._large_requests += not small
        block = self._best_fit(nbytes, small, stream)
        if block is None:
            self._collect_garbage()
            block = self._new_segment(nbytes, small, stream)
        if block is None:
            return None
        self._take(block)
        if _should_split(block.size - nbytes, small) and (small or not self._oversize(nbytes)):
            rest = Block(block.segment, block.address + nbytes, block.size - nbytes, small, stream,
                         prev=block, next=block.next)
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

    def _best_fit(self, nbytes: int, small: bool, stream: int) -> Block | None:
        pool = self._pools[stream, small]
        at = bisect.bisect_left(pool, (nbytes, -1))
        if at == len(pool):
            return None
        block = pool[at][2]
        if self._oversize(block.size) and (not self._oversize(nbytes) or block.size >= nbytes + LARGE_SEGMENT):
            return None  # get_free_block refuses an oversize block to a smaller request, or one it would waste
        return block

    def _oversize(self, nbytes: int) -> bool:
        limit = self.settings.max_split_bytes
        return limit is not None and nbytes >= limit

    def _put(self, block: Block) -> None:
        block.gc_base = self._large_requests
        bisect.insort(self._pools[block.stream, block.small], (block.size, block.address, block))

    def _take(self, block: Block) -> None:
        pool = self._pools[block.stream, block.small]
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

    def _new_segment(self, nbytes: int, small: bool, stream: int) -> Block | None:
        size = segment_size(nbytes)
        if not self._fits(size) and not (self._release_oversize(nbytes, small, stream) and self._fits(size)):
            self.retries += 1
            self._release_cached()
            if not self._fits(size):
                return None
        segment, self._segments_made = self._segments_made, self._segments_made + 1
        block = Block(segment, self._place(size), size, small, stream)
        self.segments[segment], self._heads[segment] = size, block
        self.reserved_bytes += size
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self._put(block)
        return block

    def _place(self, size: int) -> int:
        """The address CUDA gives a new segment of `size` bytes (see the module's text)."""
        align = VA_LARGE_ALIGN if size >= VA_LARGE_ALIGN else SMALL_SEGMENT
        start = None
        for (_, gap_start), (gap_end, _) in zip(self._ranges, self._ranges[1:], strict=False):
            aligned = -(-gap_start // align) * align
            if aligned + size <= gap_end:
                start = aligned
                break
        if start is None:
            lowest = self._ranges[0][0] if self._ranges else 1 << 62
            start = (lowest - size) // align * align
        bisect.insort(self._ranges, (start, start + size))
        return start

    def _fits(self, size: int) -> bool:
        return self.capacity_bytes is None or self.reserved_bytes + size <= self.capacity_bytes

    def release(self) -> None:
        """torch.cuda.empty_cache()."""
        self._release_cached()

    def held_segments(self) -> list[tuple[str, int]]:
        """(pool, size) of every segment held now, as torch.cuda.memory_snapshot() names the pools."""
        return [("small" if self._heads[segment].small else "large", size) for segment, size in self.segments.items()]

    def _release_cached(self) -> None:
        """cudaFree every segment that is one free block, of every stream (release_cached_blocks)."""
        for segment, head in list(self._heads.items()):
            if head.free and head.next is None and head.size == self.segments[segment]:
                self._release(head)

    def _release_oversize(self, nbytes: int, small: bool, stream: int) -> bool:
        """release_available_cached_blocks (only with max_split_size_mb): the smallest free oversize block of
        the request's pool and stream that is at least as large as the request, else the largest ones until
        as much is released; whether enough was. A free oversize block is always a whole segment: only an
        oversize request takes one, and it never splits it."""
        if self.settings.max_split_bytes is None:
            return False
        pool = self._pools[stream, small]
        need = max(nbytes, self.settings.max_split_bytes)
        at = bisect.bisect_left(pool, (need, -1))
        if at < len(pool):
            self._release(pool[at][2])
            return True
        released = 0
        while pool and released < need and self._oversize(pool[-1][0]):
            released += pool[-1][0]
            self._release(pool[-1][2])
        return released >= need

    def _collect_garbage(self) -> None:
        """garbage_collect_cached_blocks (only with garbage_collection_threshold, under a memory fraction):
        while reserved exceeds the threshold's share of the allowance, release every whole free segment of
        the large pool at least as old as their average age; each round recomputes the average."""
        threshold = self.settings.gc_threshold
        if threshold is None or not self.fraction or self.capacity_bytes is None:
            return
        limit = int(threshold * self.capacity_bytes)
        target, reclaimed = self.reserved_bytes - limit, 0
        whole = [head for head in self._heads.values() if not head.small and head.free and head.next is None]
        while whole and reclaimed < target:
            ages = [self._large_requests - head.gc_base for head in whole]
            average = sum(ages) / len(whole)
            for head, age in zip(whole, ages, strict=True):
                if age >= average:
                    reclaimed += head.size
                    self._release(head)
            whole = [head for head, age in zip(whole, ages, strict=True) if age < average]

    def _release(self, head: Block) -> None:
        """cudaFree a segment held as one free block."""
        self._take(head)
        self._ranges.remove((head.address, head.address + self.segments[head.segment]))
        self.reserved_bytes -= self.segments.pop(head.segment)
        del self._heads[head.segment]


@dataclass(eq=False)
class Span:
    """A piece of an expandable segment's address range: handed out, free (mapped), or unmapped."""

    address: int
    size: int
    state: str  # allocated | free | unmapped


@dataclass
class ExpandableReplay:
    """The allocator with expandable segments: one growing address range per pool (see above)."""

    capacity_bytes: int | None = None
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    allocated_bytes: int = 0  # as Replay's (here every block is split down to its request)
    peak_allocated_bytes: int = 0
    oom_at: int | None = None
    samples: list[int] = field(default_factory=list)
    made: list[tuple[int, int]] = field(default_factory=list)  # as Replay's: where mapping grew reserved
    retries: int = 0
    # (stream, small pool?) -> its address range, in pieces (one expandable segment per stream and pool)
    _spans: dict[tuple[int, bool], list[Span]] = field(default_factory=lambda: defaultdict(
        lambda: [Span(0, 1 << 60, "unmapped")]))

    def malloc(self, nbytes: int, stream: int = 0) -> Span | None:
        small = nbytes <= SMALL_REQUEST
        spans = self._spans[stream, small]
        found = self._best_fit(spans, nbytes) or self._map_for(spans, nbytes, small)
        if found is None:
            self.retries += 1
            self._unmap_free_pages()
            found = self._map_for(spans, nbytes, small)
            if found is None:
                return None
        at = spans.index(found)
        if found.size - nbytes >= MIN_BLOCK:  # both pools split down to 512 B
            spans.insert(at + 1, Span(found.address + nbytes, found.size - nbytes, "free"))
            found.size = nbytes
        found.state = "allocated"
        return found

    def free(self, span: Span) -> None:
        for spans in self._spans.values():
            if span in spans:
                span.state = "free"
                _merge_around(spans, spans.index(span))
                return

    @staticmethod
    def _best_fit(spans: list[Span], nbytes: int) -> Span | None:
        """The smallest free block that holds the request, where a block before unmapped space counts as
        large as it could grow (get_free_block): from the best fit on, the next larger block is taken
        while it could grow less, so a block at the mapped end is kept for growing."""
        grows_to = {id(s): s.size + (spans[i + 1].size if i + 1 < len(spans) and spans[i + 1].state == "unmapped" else 0)
                    for i, s in enumerate(spans) if s.state == "free"}
        fits = sorted((s for s in spans if s.state == "free" and s.size >= nbytes), key=lambda s: (s.size, s.address))
        at = 0
        while at + 1 < len(fits) and grows_to[id(fits[at + 1])] < grows_to[id(fits[at])]:
            at += 1
        return fits[at] if fits else None

    def _map_for(self, spans: list[Span], nbytes: int, small: bool) -> Span | None:
        """Maps pages after the lowest run of free + unmapped space that holds the request; the run,
        merged into one free block, or None if the pages do not fit on the card."""
        page = SMALL_SEGMENT if small else LARGE_SEGMENT
        for i, span in enumerate(spans):
            if span.state != "unmapped":
                continue
            start = i - 1 if i > 0 and spans[i - 1].state == "free" else i
            have = spans[start].size if start < i else 0
            need_pages = -(-max(nbytes - have, 0) // page) * page
            if need_pages > span.size:
                continue  # a hole too small: look further (the last span never is)
            if self.capacity_bytes is not None and self.reserved_bytes + need_pages > self.capacity_bytes:
                return None
            self.reserved_bytes += need_pages
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
            if need_pages < span.size:
                spans.insert(i + 1, Span(span.address + need_pages, span.size - need_pages, "unmapped"))
            span.size, span.state = need_pages, "free"
            return spans[_merge_around(spans, i)]
        return None

    def release(self) -> None:
        """torch.cuda.empty_cache()."""
        self._unmap_free_pages()

    def _unmap_free_pages(self) -> None:
        """release_cached_blocks: every whole page inside a free block is unmapped."""
        for (_, small), spans in self._spans.items():
            page = SMALL_SEGMENT if small else LARGE_SEGMENT
            for span in [s for s in spans if s.state == "free"]:
                begin = -(-span.address // page) * page
                end = (span.address + span.size) // page * page
                if end <= begin:
                    continue
                self.reserved_bytes -= end - begin
                at = spans.index(span)
                pieces = [Span(span.address, begin - span.address, "free"), Span(begin, end - begin, "unmapped"),
                          Span(end, span.address + span.size - end, "free")]
                spans[at:at + 1] = [p for p in pieces if p.size > 0]
            for i in range(len(spans) - 1, 0, -1):
                if spans[i].state == spans[i - 1].state == "unmapped":
                    spans[i - 1].size += spans.pop(i).size


def _merge_around(spans: list[Span], at: int) -> int:
    """Merges the free span at `at` with free neighbours; returns the merged span's index."""
    if at + 1 < len(spans) and spans[at + 1].state == "free" and spans[at].state == "free":
        spans[at].size += spans.pop(at + 1).size
    if at > 0 and spans[at - 1].state == "free" and spans[at].state == "free":
        spans[at - 1].size += spans.pop(at).size
        at -= 1
    return at


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


def record_events(records: Iterable[Any], kept: Callable[[Any], bool] | None = None
                  ) -> list[tuple[tuple[int, int], tuple[str, int, int, int]]]:
    """The counter's records (bench/predict/counter.py) as allocations and frees, each keyed by (the
    counter's event index, 0 a free | 1 an allocation: a free before an allocation of the same instant),
    in the records' order, unsorted; records that never counted, or `kept` refuses, left out. A gradient
    summed in place (`Record.takes_over`) neither frees its operand nor allocates: it keeps the operand's
    block, freed under the operand's id when the sum dies (a free and a new allocation would let the
    allocator merge the block and place the sum elsewhere; the H200's traces keep it)."""
    records = list(records)
    keep = [r.made >= 0 and r.freed != r.made and (kept is None or kept(r)) for r in records]
    continues = [r.takes_over is not None and keep[i] and keep[r.takes_over] for i, r in enumerate(records)]
    taken = {r.takes_over for i, r in enumerate(records) if continues[i]}
    block_of: dict[int, int] = {}  # a record continuing another's block -> the record that allocated it
    out = []
    for ident, record in enumerate(records):
        if not keep[ident]:
            continue
        if continues[ident]:  # the same block: no free, no allocation, as on the GPU
            block_of[ident] = block_of.get(record.takes_over, record.takes_over)
        else:
            out.append(((record.made, 1), ("malloc", ident, record.nbytes, record.stream)))
        if record.freed is not None and ident not in taken:
            out.append(((record.freed, 0), ("free", block_of.get(ident, ident), record.nbytes, record.stream)))
    return out


def trace(records: Iterable[Any], releases: Iterable[int] = ()) -> list[tuple[str, int, int, int]]:
    """The counter's records as the allocator saw them, in order (`record_events`), with the stream each
    block was allocated on. `releases`: the counter's event counts at which the cache was emptied
    (torch.cuda.empty_cache), a "release" event each."""
    events = [((at, -1), ("release", -1, 0, 0)) for at in releases] + record_events(records)
    return [event for _, event in sorted(events, key=lambda item: (*item[0], item[1][0], item[1][1]))]


@dataclass(frozen=True)
class DeviceTrace:
    """CUDA's own record of what its allocator did (torch.cuda.memory._snapshot()["device_traces"], kept as
    [action, address, bytes, stream] rows by tools/allocator_trace.py and tools/cell_trace.py)."""

    events: list[tuple[str, int, int, int]]  # its allocations and frees, as `replay` takes them
    made: list[tuple[int, int, int]]  # each segment made (or pages mapped): (the event it was made for, address, bytes)
    released: list[tuple[int, int]]  # each segment released (or pages unmapped): (address, bytes)
    peak_reserved_bytes: int


def from_device_trace(rows: Iterable[list[Any]]) -> DeviceTrace:
    """Reads a device trace from the allocator's start; streams numbered 0, 1, ... as they appear. The trace
    gives each request's own size: rounded up to 512 B here, as the allocator rounds it (round_size) and the
    fake run's trace is. A free of a block the trace never allocated means it lost its start (the
    recorder's ring buffer was too short)."""
    events: list[tuple[str, int, int, int]] = []
    made: list[tuple[int, int, int]] = []
    released: list[tuple[int, int]] = []
    live: dict[int, int] = {}  # address -> the event that allocated the block there
    streams: dict[int, int] = {}
    reserved = peak = 0
    for action, address, nbytes, stream in rows:
        if action in ("segment_alloc", "segment_map"):
            made.append((len(events), address, nbytes))
            reserved += nbytes
            peak = max(peak, reserved)
        elif action in ("segment_free", "segment_unmap"):
            released.append((address, nbytes))
            reserved -= nbytes
        elif action == "alloc":
            live[address] = len(events)
            events.append(("malloc", len(events), _rounded(nbytes), streams.setdefault(stream, len(streams))))
        elif action == "free_completed":
            if address not in live:
                raise ValueError(f"the device trace frees {nbytes} B at {address:#x} it never allocated: it "
                                 "does not start at the allocator's start")
            events.append(("free", live.pop(address), _rounded(nbytes), streams[stream]))
    return DeviceTrace(events, made, released, peak)


def _rounded(nbytes: int) -> int:
    """A request as the allocator serves it: a multiple of 512 B, at least 512 (round_size)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def positions(records: list[Any], event_counts: list[int], releases: Iterable[int] = ()) -> list[int]:
    """For each event count of the counter (e.g. where a step ended), how many trace events precede it."""
    made = sorted(r.made for r in records if r.made >= 0 and r.freed != r.made)
    freed = sorted(r.freed for r in records if r.made >= 0 and r.freed is not None and r.freed != r.made)
    released = sorted(releases)
    return [bisect.bisect_left(made, end) + bisect.bisect_left(freed, end) + bisect.bisect_right(released, end)
            for end in event_counts]


def least_capacity(events: list[tuple[Any, ...]], unbounded_bytes: int, settings: Settings = Settings(),
                   resolution_bytes: int = SMALL_SEGMENT, runs_within_bytes: int | None = None) -> int:
    """The smallest capacity, a multiple of `resolution_bytes`, within which the trace runs to its end:
    the allocator releasing its cache and retrying where a new segment does not fit, under
    torch.cuda.set_per_process_memory_fraction as `bench fit` emulates a smaller card (the same as a
    card just big enough, but that a garbage collection threshold acts only under a fraction). A
    bisection between nothing and `unbounded_bytes`, what the trace reserves with no bound (always
    enough), or `runs_within_bytes` where the trace runs within that smaller capacity (the card's, where
    the cell fits it after retries). The bisection takes a trace that runs within a capacity to run
    within any larger one, which the allocator does not promise (a smaller card releases its cache
    sooner, and may fragment less), so the answer is a capacity the replay ran within, at the boundary
    the bisection found; starting from a capacity known to run keeps it at or under that one."""
    high = -(-unbounded_bytes // resolution_bytes)  # in resolution units: `low` never runs, `high` does
    if runs_within_bytes is not None and runs_within_bytes // resolution_bytes < high:
        within = runs_within_bytes // resolution_bytes
        if replay(events, within * resolution_bytes, settings=settings, fraction=True).oom_at is None:
            high = within
    low = 0
    while high - low > 1:
        middle = (low + high) // 2
        ran = replay(events, middle * resolution_bytes, settings=settings, fraction=True)
        low, high = (low, middle) if ran.oom_at is None else (middle, high)
    return high * resolution_bytes


def replay(events: Iterable[tuple[Any, ...]], capacity_bytes: int | None = None,
           samples: Iterable[int] = (), settings: Settings = Settings(),
           fraction: bool = False) -> Replay | ExpandableReplay:
    """Replays ("malloc" | "free" | "release", id, bytes[, stream]) events in order; stops at the first
    OOM. `samples`: after how many events to read reserved memory (Replay.samples). `settings`: the
    allocator's (with expandable segments, an ExpandableReplay). `fraction`: the capacity is a memory
    fraction's allowance rather than the card's end (only a garbage collection threshold tells them
    apart)."""
    state: Replay | ExpandableReplay = (ExpandableReplay(capacity_bytes) if settings.expandable
                                        else Replay(capacity_bytes, settings, fraction))
    live: dict[int, Any] = {}
    wanted = sorted(samples)
    events = list(events)
    for index, (kind, ident, nbytes, *stream) in enumerate(events):
        while wanted and wanted[0] <= index:
            state.samples.append(state.reserved_bytes)
            wanted.pop(0)
        if nbytes == 0 and kind != "release":  # an empty tensor: CUDA's allocator returns a null pointer, no block
            continue
        if kind == "free":
            block, size = live.pop(ident)
            state.allocated_bytes -= size
            state.free(block)
            continue
        if kind == "release":
            state.release()
            continue
        before = state.reserved_bytes
        block = state.malloc(nbytes, *stream)
        if block is None:
            state.oom_at = index
            break
        live[ident] = block, block.size  # its size as handed out: freeing merges it with its neighbours
        state.allocated_bytes += block.size
        state.peak_allocated_bytes = max(state.peak_allocated_bytes, state.allocated_bytes)
        if state.reserved_bytes > before:  # a segment made (or pages mapped) for this request
            state.made.append((index, state.reserved_bytes - before))
    state.samples += [state.reserved_bytes] * len(wanted) if state.oom_at is None else []
    return state
