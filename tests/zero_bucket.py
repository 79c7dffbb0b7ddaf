"""Trains tiny-llama two steps under a ZeRO stack on the CPU (one gloo rank) and prints the largest
single allocation DeepSpeed made, counted by a MemoryCounter over real tensors, and what the build made
after it (deepspeed.initialize's last allocations: their bytes, in order, and whether the build freed each).

`python tests/zero_bucket.py STACK` prints {"largest_bytes": N, "built_after_largest": [[bytes, freed], ...]}.
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


def main(stack: str) -> None:
    os.environ.update(distributed.SINGLE_RANK_ENV)
    cell = make_cell(spec.get(REPO / "matrix.yaml", "smoke"), "cpu", "tiny-llama", 64, 2, parse_stack(stack))
    with MemoryCounter() as counter:
        job = trainer.build(cell)
        for batch in job.batches()[:2]:
            job.step(batch)
    largest = max(counter.records, key=lambda record: record.nbytes)
    build_ends = max(record.made for record in counter.records if record.where == "build")
    after = [[r.nbytes, r.freed is not None and r.freed <= build_ends] for r in counter.records
             if r.where == "build" and r.made > largest.made and r.nbytes]  # not a parameter's empty placeholder
    print(json.dumps({"largest_bytes": largest.nbytes, "built_after_largest": after}))


if __name__ == "__main__":
    main(sys.argv[1])
