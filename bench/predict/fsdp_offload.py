"""FSDP2's CPU offload (`offload(params=true) + fsdp`: CPUOffloadPolicy) in a fake run.

On a GPU each rank keeps its shards on the host: the sharded parameters in pinned memory, each
sharded gradient copied to pinned memory after its reduce-scatter, and the optimizer's state in
ordinary (pageable) host memory, where the optimizer steps. The device holds only what a layer needs
while it computes: its shards copied over and all-gathered, its gradients until they are reduced.

In a fake run the "device" is the CPU too, so these crossings are no-ops (`.to("cpu")` of a CPU
tensor is itself) and pinning has no fake kernel. `predicting` gives each crossing its GPU meaning
where FSDP makes it (torch 2.11 to 2.13's `FSDPParam`), so the counter sees each rank's device and
its host apart (bench/predict/counter.py's pools):

1. a sharded parameter, made on the host and pinned (`_init_sharded_param`, or `reset_sharded_param`
   when a meta-built shard gets its memory): moved to the pinned pool (FSDP's own pinning is turned
   off: the counter does it);
2. before each all-gather, the shard copied to the device, then cast to the compute dtype
   (`all_gather_inputs`, as FSDP writes it for a plain sharded parameter);
3. after each reduce-scatter, the sharded gradient copied to pinned memory and the device's freed
   (`to_sharded_dtensor` of a gradient);
4. the optimizer's step on the host: its state is pageable host memory (`step_on_host`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from ..cells import Cell


def applies(cell: Cell) -> bool:
    return {"fsdp", "offload"} <= set(cell.stack.names)


@contextlib.contextmanager
def predicting(cell: Cell, counter: Any) -> Iterator[None]:
    """While the cell is counted: FSDP's host crossings as a GPU makes them (see the module's list)."""
    if not applies(cell):
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    originals = {name: FSDPParam.__dict__[name] for name in ("_init_sharded_param", "reset_sharded_param",
                                                             "all_gather_inputs", "to_sharded_dtensor")}
    patched = {"_init_sharded_param": _sharded_on_host(originals["_init_sharded_param"], counter),
               "reset_sharded_param": _made_on_host(originals["reset_sharded_param"], counter),
               "all_gather_inputs": property(_copied_to_device(originals["all_gather_inputs"].fget)),
               "to_sharded_dtensor": _gradient_to_host(originals["to_sharded_dtensor"], counter)}
    for name, replacement in patched.items():
        setattr(FSDPParam, name, replacement)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(FSDPParam, name, original)


def _sharded_on_host(init: Any, counter: Any) -> Any:
    @functools.wraps(init)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        offloaded, self.pin_memory = self.offload_to_cpu, False  # no fake kernel pins
        self.offload_to_cpu = False  # its copy to the host is a no-op here: made below, by the counter
        try:
            init(self, *args, **kwargs)
        finally:
            self.offload_to_cpu = offloaded
        if offloaded and not self._sharded_param_data.is_meta:
            counter.to_pool(self._sharded_param_data, "pinned")
    return wrapped


def _made_on_host(reset: Any, counter: Any) -> Any:
    """A meta-built shard given memory (`to_empty`, bench/deferred.py) is pinned by FSDP when it re-pads it."""
    @functools.wraps(reset)
    def wrapped(self: Any) -> None:
        reset(self)
        if self.offload_to_cpu and not self._sharded_param_data.is_meta:
            counter.to_pool(self._sharded_param_data, "pinned")
    return wrapped


def _copied_to_device(all_gather_inputs: Any) -> Any:
    @functools.wraps(all_gather_inputs)
    def wrapped(self: Any) -> list[Any]:
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState, _to_dtype_if_needed

        extension = hasattr(self._sharded_local_tensor, "fsdp_pre_all_gather")
        if not self.offload_to_cpu or extension or self.sharded_state != ShardedState.SHARDED:
            return all_gather_inputs(self)
        on_device = self._sharded_param_data.clone()  # the host-to-device copy
        return [_to_dtype_if_needed(on_device, self.param_dtype)]
    return wrapped


def _gradient_to_host(to_sharded_dtensor: Any, counter: Any) -> Any:
    @functools.wraps(to_sharded_dtensor)
    def wrapped(self: Any, tensor: Any) -> Any:
        if self.offload_to_cpu:  # only a gradient is made into a DTensor after the parameters are sharded
            with counter.apart("pinned"):
                tensor = tensor.clone()  # the device-to-host copy; the device's dies with FSDP's reference
        return to_sharded_dtensor(self, tensor)
    return wrapped


def step_on_host(engine: Any, counter: Any) -> None:
    """The optimizer steps where its parameters are, on the host: the state it makes is pageable."""
    step = engine.step

    @functools.wraps(step)
    def on_host() -> None:
        with counter.apart("pageable"):
            step()
    engine.step = on_host  # this engine only
