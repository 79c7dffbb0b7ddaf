"""Records CUDA's caching allocator on this GPU as tests/gpu_traces/ keeps it: the random walk of
allocations and frees the GPU tests use (tests/test_gpu.py, ALLOCATOR_TRACE), under
torch.cuda.memory._record_memory_history, every block and segment as the allocator made them.

    python tools/allocator_trace.py OUT.json.gz --streams 3 [--fraction 0.05]

PYTORCH_CUDA_ALLOC_CONF is read from the environment, as torch reads it. The file holds the allocator's
settings, the GPU, the versions, and its device trace: [action, address, bytes, stream] for every
alloc, free_completed, segment_alloc and segment_free, in order. tests/test_allocator.py replays such
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

KEPT = ("alloc", "free_completed", "segment_alloc", "segment_free")
SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size", "garbage_collection_threshold", "expandable_segments")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--fraction", type=float, help="torch.cuda.set_per_process_memory_fraction first")
    args = parser.parse_args()
    from test_gpu import ALLOCATOR_TRACE  # the walk itself, so the recorded trace is the tested one

    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    sys.argv = ["walk", str(args.streams)] + ([] if args.fraction is None else [repr(args.fraction)])
    exec(compile(ALLOCATOR_TRACE, "ALLOCATOR_TRACE", "exec"), {"__name__": "__main__"})  # prints its own figures
    snapshot = torch.cuda.memory._snapshot()
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "streams": args.streams, "fraction": args.fraction,
              "allocator_settings": {k: snapshot["allocator_settings"].get(k) for k in SETTINGS},
              "device_trace": [[e["action"], e["addr"], e["size"], e["stream"]]
                               for e in snapshot["device_traces"][0] if e["action"] in KEPT]}
    with gzip.open(args.out, "wt") as handle:
        json.dump(record, handle, separators=(",", ":"))


if __name__ == "__main__":
    main()
