"""Real ranks to check the fake process group against: a cell's steps on WORLD gloo processes, real CPU tensors.

`bench predict` runs an FSDP2 or DDP cell of N ranks in one process, as rank 0 of torch's fake backend
(bench/predict/fake.py `_fake_process_group`). What that counts is right if N real ranks, running the same steps on
real tensors under the same counter, count the same: `counted_ranks` runs them, each rank a spawned process, and
returns what each counted. tests/test_predict.py and tools/fake_vs_real.py (`--stacks`) compare them with the fake run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

RANK_TIMEOUT_S = 240  # one rank of a two-layer model's cell: seconds on 2 cores


@dataclasses.dataclass(frozen=True)
class RankCount:
    """What one real rank's counter saw."""

    rank: int
    phase_peaks: dict[str, int]  # stage/phase -> peak bytes alive
    at_peak: dict[str, int]  # role -> bytes alive at the peak
    state_gib: float  # optimizer state
    host_peak_bytes: int  # pinned host memory (offload)


_GLOO_COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
                     "reduce_scatter_tensor", "all_reduce", "broadcast")


def collectives_release_their_tensors(dist: Any) -> None:
    """Makes each blocking collective count what a GPU's would, and return only once gloo has let go of
    its tensors.

    Gloo's reduce-scatter reduces a copy of its whole input, made in gloo's worker thread (no dispatch mode
    sees it), then splits that copy into the output on the caller's thread, where the counter met it and
    counted it: a block of the input's size that NCCL never makes, dying whenever the worker dropped its
    work, in the worker's thread, while the step went on allocating. That was the late block that made the
    2-rank comparison flaky under load (+262,656 B in the first backward, CI: the root unit's bf16 input;
    +21,504 B in the first optimizer step, 2026-12-05: its fp32 input outliving backward). So a collective
    runs with the counter's dispatch modes off: its output is written in place into tensors already
    counted, and gloo's own buffers stay uncounted.

    The worker also holds the tensors handed to it until it drops the work, after waking the caller. So
    gloo is handed aliases (`detach`: one more handle on each storage), and the caller waits until every
    alias is gone, so that a tensor the caller then drops dies on the caller's thread, as on a GPU."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    def handles(storages: list) -> list[int]:
        return [torch._C._storage_Use_Count(s._cdata) for s in storages]

    def alias(value: Any) -> Any:
        return value.detach() if isinstance(value, torch.Tensor) else value

    def released(collective: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("async_op"):  # the caller waits on its work and holds its tensors as long
                return collective(*args, **kwargs)
            storages = [a.untyped_storage() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            before = handles(storages)
            with _disable_current_modes():
                work = collective(*(alias(a) for a in args), **{k: alias(v) for k, v in kwargs.items()})
            deadline = time.monotonic() + 5  # our aliases are gone: what still holds one is gloo's worker
            while time.monotonic() < deadline and any(now > then for now, then in zip(handles(storages), before,
                                                                                      strict=True)):
                time.sleep(0.001)
            return work
        return call

    for name in _GLOO_COLLECTIVES:
        if hasattr(dist, name):  # all_gather_single, reduce_scatter_single: not in torch 2.11
            setattr(dist, name, released(getattr(dist, name)))


def _one_rank(rank: int, world: int, port: int, cell: Any, queue: Any) -> None:
    """One rank of a real gloo group: the cell's steps on real CPU tensors under the counter."""
    import torch.distributed as dist

    from bench import distributed
    from bench.predict import fake
    from bench.predict.counter import Workspaces

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    distributed.mesh("cpu")  # made before the counter, as the fake run makes it (a GPU run keeps it on the host)
    import peft  # noqa: F401  # imported before the counter as in the fake run's process: its import makes
    # tensors (peft's default arguments, bitsandbytes' quantization tables) a GPU run keeps on the host
    collectives_release_their_tensors(dist)
    counter, _, state_gib = fake.counted_run(cell, Workspaces(), fake=False)
    queue.put(RankCount(rank, dict(counter.phase_peaks), counter.breakdown(counter.peak), state_gib,
                        counter.host_peak_bytes))
    distributed.shutdown()


def counted_ranks(cell: Any, world: int = 2) -> list[RankCount]:
    """`cell` (a CPU cell, `gpus` set to `world`) on `world` real gloo ranks: each rank's count, by rank. Raises
    RuntimeError naming the ranks that gave none (a rank's step failed: its exception is in the process's stderr)."""
    import multiprocessing
    import queue as queues

    from bench import distributed

    context = multiprocessing.get_context("spawn")  # a fresh interpreter per rank, as a launcher starts them
    found: Any = context.Queue()
    port = distributed.free_port()
    ranks = [context.Process(target=_one_rank, args=(r, world, port, cell, found)) for r in range(world)]
    for process in ranks:
        process.start()
    counts: list[RankCount] = []
    try:
        for _ in ranks:
            counts.append(found.get(timeout=RANK_TIMEOUT_S))
    except queues.Empty:
        pass
    for process in ranks:
        process.join(timeout=60)
        if process.is_alive():  # its peer died in a collective: nothing will wake it
            process.kill()
    missing = sorted(set(range(world)) - {c.rank for c in counts})
    if missing:
        codes = ", ".join(f"rank {r}: exit {ranks[r].exitcode}" for r in missing)
        raise RuntimeError(f"{len(missing)} of {world} gloo ranks counted nothing ({codes})")
    return sorted(counts, key=lambda c: c.rank)
