"""Records CUDA's caching allocator on this GPU as tests/gpu_traces/ keeps it: the random walk of
allocations and frees the GPU tests use (tests/test_gpu.py, ALLOCATOR_TRACE), under
torch.cuda.memory._record_memory_history, every block and segment as the allocator made them.

    python tools/allocator_trace.py OUT.json.gz --streams 3 [--capacity-gib 7]

PYTORCH_CUDA_ALLOC_CONF is read from the environment, as torch reads it. `--capacity-gib` sets the memory
fraction that leaves torch that much of this GPU (as `bench fit` emulates a smaller card; only under a
fraction does garbage_collection_threshold act). The file holds the allocator's
settings, the GPU, the versions, the peak reserved, and its device trace: [action, address, bytes, stream]
for every alloc, free_completed, segment_alloc and segment_free (segment_map and segment_unmap with
expandable segments), in order. tests/test_allocator.py replays such
traces through bench/predict/allocator.py on any CPU, segment by segment.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests")]

KEPT = ("alloc", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap")  # the last two: expandable
SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size", "garbage_collection_threshold", "expandable_segments")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--capacity-gib", type=float, help="a memory fraction that leaves torch this much")
    args = parser.parse_args()
    fraction = None if args.capacity_gib is None else args.capacity_gib * 2**30 / torch.cuda.mem_get_info()[1]
    from test_gpu import ALLOCATOR_TRACE  # the walk itself, so the recorded trace is the tested one

    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    sys.argv = ["walk", str(args.streams)] + ([] if fraction is None else [repr(fraction)])
    exec(compile(ALLOCATOR_TRACE, "ALLOCATOR_TRACE", "exec"), {"__name__": "__main__"})  # prints its own figures
    snapshot = torch.cuda.memory._snapshot()
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "streams": args.streams, "fraction": fraction, "capacity_gib": args.capacity_gib,
              "allocator_settings": {k: snapshot["allocator_settings"].get(k) for k in SETTINGS},
              "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
              "device_trace": [[e["action"], e["addr"], e["size"], e["stream"]]
                               for e in snapshot["device_traces"][0] if e["action"] in KEPT]}
    with gzip.open(args.out, "wt") as handle:
        json.dump(record, handle, separators=(",", ":"))


if __name__ == "__main__":
    main()
