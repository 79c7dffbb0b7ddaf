"""DDP on fake tensors: PyTorch's own DistributedDataParallel, its C++ reducer included, on torch's
fake process group; three things it does by value are set aside.

The reducer allocates its gradient buckets (one flat buffer per `bucket_mb` of gradients) through
the dispatcher, so the counter sees them as a GPU's allocator would; backward copies each gradient
into its bucket (or, with `bucket_view`, the gradients are views of the buckets). What reads values:
- at construction, the ranks compare parameter shapes (`_verify_param_shape_across_processes`): a
  check between ranks, a few bytes; skipped;
- each bucket's all-reduce: on the fake backend it returns no tensor, so a hook returns the bucket
  as it is, as NCCL's all-reduce leaves it, reduced in place (no allocation torch sees);
- at the second step the reducer rebuilds its buckets in the order gradients arrived (and syncs that
  order between ranks by value): skipped, so the buckets keep their first order. The same bytes in
  the same number of buffers, save the first bucket (capped at 1 MiB after a rebuild); the transient
  of the rebuild itself is not modelled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def predicting() -> Iterator[None]:
    """While predicting a DDP cell: no shape check between ranks, no bucket rebuild."""
    from torch._C._distributed_c10d import Reducer
    from torch.nn.parallel import distributed

    verify, rebuild = distributed._verify_param_shape_across_processes, Reducer._rebuild_buckets
    distributed._verify_param_shape_across_processes = lambda *args, **kwargs: None
    Reducer._rebuild_buckets = lambda self: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        distributed._verify_param_shape_across_processes = verify
        Reducer._rebuild_buckets = rebuild  # type: ignore[method-assign]


def reduce_in_place(model: Any) -> None:
    """A DDP model's buckets left as they are, as an in-place all-reduce leaves them (on one rank, or
    a fake group whose all-reduce returns nothing); other models untouched."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model.register_comm_hook(None, noop_hook)
