"""The caching allocator's segments when a cell's steps end: measured and predicted, and how alike.

Peak reserved is one number; the segments behind it say why. Each is one cudaMalloc the allocator
kept: 2 MiB ones for small requests, 20 MiB ones for medium requests, and a large request's own size
rounded up to 2 MiB. The worker reads them from `torch.cuda.memory_snapshot()` once its measured steps
have run (before any checkpoint save); the predictor from its replay of the fake run's trace through
the allocator's model (bench/predict/allocator.py) at the same point. Both become `segments_json`:
per pool, how many segments of each size. Without a release (`torch.cuda.empty_cache()`, a retry on a
full card) the allocator never gives a segment back, so these are the segments that made the peak.

`matched_share` compares two such lists segment by segment: the share of reserved bytes held by
segments that the other side has too, of the same pool and size.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

POOLS = ("large", "small")  # the snapshot's segment_type; requests of at most 1 MiB go to "small"


def to_json(segments: Iterable[tuple[str, int]]) -> str:
    """(pool, size in bytes) of each segment as `segments_json`: {pool: [[size, count], ...]}, largest first."""
    counts = Counter(segments)
    unknown = {pool for pool, _ in counts} - set(POOLS)
    if unknown:
        raise ValueError(f"segments: unknown pool(s) {sorted(unknown)} (expected {POOLS})")
    return json.dumps({pool: sorted(([size, n] for (p, size), n in counts.items() if p == pool), reverse=True)
                       for pool in POOLS})


def from_snapshot(snapshot: Any, device: int) -> str:
    """`segments_json` of `torch.cuda.memory_snapshot()` (or `torch.cuda.memory._snapshot()["segments"]`):
    every segment the allocator holds on `device`, of every stream."""
    segments = snapshot["segments"] if isinstance(snapshot, dict) else snapshot
    return to_json((s["segment_type"], int(s["total_size"])) for s in segments if s.get("device", device) == device)


def counts(segments_json: str) -> Counter[tuple[str, int]]:
    """{(pool, size): how many} of a `segments_json`."""
    return Counter({(pool, int(size)): int(n) for pool, rows in json.loads(segments_json).items()
                    for size, n in rows})


def total_bytes(segments_json: str) -> int:
    """What the segments reserve together."""
    return sum(size * n for (_, size), n in counts(segments_json).items())


def matched_share(measured_json: str, predicted_json: str) -> float:
    """Bytes in segments both sides hold (same pool, same size, as many as the fewer side has), over the
    larger side's reserved bytes: 1.0 when the two lists are the same, 0.0 when no segment matches."""
    measured, predicted = counts(measured_json), counts(predicted_json)
    both = sum(size * n for (_, size), n in (measured & predicted).items())
    larger = max(total_bytes(measured_json), total_bytes(predicted_json))
    return both / larger if larger else 1.0
