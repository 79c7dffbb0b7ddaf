"""Trains tiny-llama two steps under a ZeRO stack on the CPU (one gloo rank) and prints the largest
single allocation DeepSpeed made, counted by a MemoryCounter over real tensors, and what the build made
after it (deepspeed.initialize's last allocations: their bytes, in order, and whether the build freed each).

`python tests/zero_bucket.py STACK [SUB_GROUP]` prints {"largest_bytes": N, "built_after_largest": [[bytes, freed],
...], "built": [["malloc" | "free", bytes], ...]}, the last every allocation and free of the build in order. SUB_GROUP:
ZeRO-3's optimizer `sub_group_size` in elements (tools/hybrid_check.py --sub-group), else DeepSpeed's default.
tests/test_predict.py compares the largest with the gradient bucket the hybrid prediction
(bench/predict/hybrid.py) counts, and what follows it with the hybrid's trace. A process of its own, since
DeepSpeed's communication state is global.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from bench import distributed, spec, trainer
from bench.cells import make_cell
from bench.predict.counter import MemoryCounter
from bench.stacks import parse_stack

REPO = Path(__file__).resolve().parents[1]


def main(stack: str, sub_group: int | None = None) -> None:
    os.environ.update(distributed.SINGLE_RANK_ENV)
    if sub_group is not None:
        sys.path.insert(0, str(REPO / "tools"))
        from hybrid_check import _limit_sub_groups

        _limit_sub_groups(sub_group)
    cell = make_cell(spec.get(REPO / "matrix.yaml", "smoke"), "cpu", "tiny-llama", 64, 2, parse_stack(stack))
    with MemoryCounter() as counter:
        job = trainer.build(cell)
        for batch in job.batches()[:2]:
            job.step(batch)
    largest = max(counter.records, key=lambda record: record.nbytes)
    build_ends = max(record.made for record in counter.records if record.where == "build")
    after = [[r.nbytes, r.freed is not None and r.freed <= build_ends] for r in counter.records
             if r.where == "build" and r.made > largest.made and r.nbytes]  # not a parameter's empty placeholder
    events = sorted([(r.made, "malloc", r.nbytes) for r in counter.records if r.where == "build" and r.nbytes]
                    + [(r.freed, "free", r.nbytes) for r in counter.records
                       if r.where == "build" and r.nbytes and r.freed is not None and r.freed <= build_ends])
    print(json.dumps({"largest_bytes": largest.nbytes, "built_after_largest": after,
                      "built": [[kind, nbytes] for _, kind, nbytes in events]}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
