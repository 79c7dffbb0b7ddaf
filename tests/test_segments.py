"""Segments, measured and predicted (bench/segments.py), on lists whose answer is known by hand."""

from __future__ import annotations

import json

import pytest

from bench import segments
from bench.predict import allocator

MIB = 1 << 20


def test_segments_json_counts_each_pool_and_size_largest_first() -> None:
    made = segments.to_json([("large", 20 * MIB), ("small", 2 * MIB), ("large", 102 * MIB), ("large", 20 * MIB)])
    assert json.loads(made) == {"large": [[102 * MIB, 1], [20 * MIB, 2]], "small": [[2 * MIB, 1]]}
    assert segments.total_bytes(made) == (102 + 40 + 2) * MIB
    with pytest.raises(ValueError, match="unknown pool"):
        segments.to_json([("huge", MIB)])


def test_a_snapshot_gives_the_segments_of_its_device() -> None:
    snapshot = [{"device": 0, "segment_type": "large", "total_size": 20 * MIB, "blocks": []},
                {"device": 0, "segment_type": "small", "total_size": 2 * MIB, "blocks": []},
                {"device": 1, "segment_type": "large", "total_size": 64 * MIB, "blocks": []}]
    assert segments.counts(segments.from_snapshot(snapshot, 0)) == {("large", 20 * MIB): 1, ("small", 2 * MIB): 1}
    assert segments.from_snapshot({"segments": snapshot}, 1) == segments.to_json([("large", 64 * MIB)])


def test_matched_share_is_the_bytes_in_segments_both_hold_over_the_larger_side() -> None:
    gpu = segments.to_json([("large", 100 * MIB), ("large", 20 * MIB), ("large", 20 * MIB), ("small", 2 * MIB)])
    assert segments.matched_share(gpu, gpu) == 1.0
    # one 20 MiB segment fewer, and a 2 MiB one in the large pool instead of the small: 120 of 142 MiB
    predicted = segments.to_json([("large", 100 * MIB), ("large", 20 * MIB), ("large", 2 * MIB)])
    assert segments.matched_share(gpu, predicted) == pytest.approx(120 / 142)
    assert segments.matched_share(gpu, segments.to_json([("large", 98 * MIB)])) == 0.0


def test_the_replay_holds_the_segments_made_less_those_released() -> None:
    events = [("malloc", 0, 12 * MIB), ("malloc", 1, 5 * MIB), ("malloc", 2, MIB // 2), ("free", 0, 12 * MIB),
              ("release", -1, 0),  # the free 12 MiB segment goes back to CUDA; the 20 MiB one holds a block
              ("malloc", 3, 5 * MIB)]  # into the 20 MiB segment's rest
    state = allocator.replay(events)
    held = segments.to_json(state.held_segments())
    assert segments.counts(held) == {("large", 20 * MIB): 1, ("small", 2 * MIB): 1}
    assert segments.total_bytes(held) == state.reserved_bytes
