"""Activation offloading: the tensors autograd saves for backward are copied to host memory during
forward and brought back when backward needs them (`torch.autograd.graph.saved_tensors_hooks`, as
`save_on_cpu(pin_memory=True)` does).

Saves: activation memory on the GPU: what forward keeps for backward lives in pinned host RAM instead
(with gc: the checkpointed layers' inputs). Costs: every saved tensor crosses PCIe twice per step,
synchronously here (torchtune's variant overlaps the copies on a side stream), and host RAM (pinned)
of the same size: read host_rss_peak_gib and tokens/s. Exact: the same values come back, so the losses
must track the baseline's. Evidence: the bytes offloaded in the last step. Predicted: the host copies are
pinned, and `bench predict` counts pinned memory as the host's (its host_peak_gib), not the GPU's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .base import Evidence, Options, Phase, Technique


@contextlib.contextmanager
def _offloaded(cell: Any, opts: Options, evidence: Evidence) -> Iterator[None]:
    import torch

    pin = cell.device == "cuda"
    moved = {"bytes": 0, "tensors": 0}

    def pack(tensor: Any) -> Any:
        if tensor.numel() * tensor.element_size() < opts["min_bytes"]:
            return tensor  # small tensors stay: a copy costs more than it saves
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        host.copy_(tensor)
        moved["bytes"] += host.numel() * host.element_size()
        moved["tensors"] += 1
        return (tensor.device, host)

    def unpack(packed: Any) -> Any:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        # copy=True: a fresh device tensor, as a GPU always makes one (in a fake run, where the "device"
        # is the CPU too, the copy is what the predictor counts)
        return host.to(device, non_blocking=pin, copy=True)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
    evidence["activation_offload_gib"] = moved["bytes"] / 2**30  # per micro-batch, the last one's
    evidence["activation_offload_tensors"] = moved["tensors"]


TECHNIQUE = Technique(
    name="activation_offload",
    summary="saved activations copied to pinned host RAM in forward, back in backward: PCIe traffic for GPU memory",
    phase=Phase.PATCH,
    options={"min_bytes": 1 << 20},
    ranges={"min_bytes": "[0, inf)"},
    around_step=_offloaded,
)
