"""One rank of a real gloo group counting one reduce-scatter under the suite's MemoryCounter.

tests/test_predict.py spawns two of these (`count_reduce_scatter`) to check tools/gloo_ranks.py's
`collectives_release_their_tensors`: the counter must see the caller's tensors only, as a GPU run
(NCCL) would, and the input must die on the caller's thread when the caller drops it.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

INPUT_ELEMENTS = 131_136  # fp32: a reduce-scatter input of 524,544 B, as tiny-llama's root unit under fsdp(mixed)


def count_reduce_scatter(rank: int, world: int, port: int, wrapped: bool, queue: Any) -> None:
    """Puts (each record's (op, bytes), whether the input died before the next allocation, on the main thread)."""
    import gloo_ranks
    import torch
    import torch.distributed as dist

    from bench.predict.counter import MemoryCounter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if wrapped:
        gloo_ranks.collectives_release_their_tensors(dist)
    freed_on: list[str] = []
    with MemoryCounter() as counter:
        grads = torch.ones(INPUT_ELEMENTS)
        shard = torch.empty(INPUT_ELEMENTS // world)
        dist.reduce_scatter_single(shard, grads)
        input_record = counter.records[0]
        weakref.finalize(grads.untyped_storage(), lambda: freed_on.append(threading.current_thread().name))
        del grads
        torch.empty(1)  # the next allocation
    died_first = input_record.freed is not None and input_record.freed < counter.records[-1].made
    queue.put((rank, [(r.op, r.nbytes) for r in counter.records], died_first and freed_on == ["MainThread"]))
    dist.destroy_process_group()
