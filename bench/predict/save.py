"""A checkpoint save after the last step, predicted: what it adds on the GPU and on the host.

A save computes nothing; it copies. What each save path copies, and where to, is read from its
code (torch 2.11-2.13, safetensors 0.8, transformers 5, DeepSpeed 0.19) and sized from the cell's
own tensors: the fake run's (plain engine, DDP, FSDP2) or the parameter counts the hybrid uses
(ZeRO).

What the host holds at once, besides what training keeps there:

- plain engine (and DDP's rank 0), `full` (torch.save of model and optimizer state): the largest GPU
  storage. torch.save copies one storage to the host (`storage.cpu()`), writes it and drops it
  before the next.
- plain engine, `model` (save_pretrained): every tensor saved (a PEFT model: its adapters).
  safetensors copies all of a file's tensors to the host before it writes, and a transformers 5
  file holds up to 50 GB.
- ZeRO-2, `model` (save_16bit_model): the 16-bit weights. They are views of one flat buffer, which
  torch.save copies whole.
- ZeRO-2, `full` (save_checkpoint): the larger of that flat buffer (the module's file) and the flat
  fp32 partition (the optimizer's file, with Adam's moments, one storage at a time); the partition
  is already on the host where the optimizer is offloaded, and is written in place.
- ZeRO-3, `model`: the whole 16-bit model on rank 0 (`_zero3_consolidated_16bit_state_dict` keeps
  a host copy of each module's gathered weights).
- ZeRO-3, `full`: the largest fp32 sub-group partition (at most about `sub_group_size` elements;
  in place where offloaded); the module's own file holds empty placeholders.
- FSDP2, `full` (torch.distributed.checkpoint): each rank copies its shards to the host one tensor
  at a time, copying up to 10 MB ahead: every rank its largest shard, at once.
- FSDP2, `model` (a full state dict offloaded to the CPU): each parameter is gathered whole on the
  GPU (`full_tensor`), copied to rank 0's host and dropped: the GPU holds the largest parameter
  whole, the host the whole model in the sharded parameters' dtype (fp32 with `precision=mixed`).

tests/test_predict.py checks these sizes against what real saves on the CPU hand torch.save and
safetensors (tests/save_spy.py).

On the GPU a save allocates nothing in these paths but the gathers: ZeRO-3's of one module at a
time, which training gathers every step already (DeepSpeed's estimate keeps room for the largest
layer), and FSDP2's model save, one whole parameter at a time. The save's GPU peak is what is alive
after the last step plus that, and the allocator's cache keeps what training reserved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import measure
from ..cells import Cell
from .counter import MemoryCounter

DCP_COPY_AHEAD_BYTES = 10_000_000  # torch.distributed.checkpoint's FileSystemWriter: per_thread_copy_ahead
BF16_BYTES, FP32_BYTES = 2, 4


@dataclass(frozen=True)
class SaveCost:
    """What a save adds to what the last step left: on the host at once (all ranks), and on the GPU."""

    host_bytes: int
    gpu_bytes: int = 0


def engine_cost(cell: Cell, counter: MemoryCounter, model: Any) -> SaveCost:
    """The save of an engine the fake run ran (plain, DDP's rank 0, FSDP2), from its tensors."""
    shards = [r.nbytes for r in counter.alive_at(counter.steps[-1].event) if r.role in ("weight", "optimizer_state")]
    if "fsdp" in cell.stack.names:
        return _fsdp(cell, shards, model)
    if cell.checkpoint == "full":  # torch.save: one storage at a time
        return SaveCost(max(shards, default=0))
    return SaveCost(sum(t.untyped_storage().nbytes() for t in _exported(model)))


def _fsdp(cell: Cell, shards: list[int], model: Any) -> SaveCost:
    """FSDP2: `full` writes every rank's shards one at a time; `model` gathers each parameter whole
    (the counter counts one rank's shards; a DTensor's numel is the whole parameter's)."""
    if cell.checkpoint == "full":
        largest = max(shards, default=0)
        return SaveCost(cell.gpus * min(largest + DCP_COPY_AHEAD_BYTES, sum(shards)))
    whole = [t.numel() * t.element_size() for t in _state(model)]  # all of it, adapters or not
    return SaveCost(sum(whole), max(whole, default=0))


def _exported(model: Any) -> list[Any]:
    """What save_pretrained writes: a PEFT model's adapters (its trainable tensors), else the state."""
    if hasattr(model, "peft_config"):
        return list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    return _state(model)


def _state(model: Any) -> list[Any]:
    """Every parameter and persistent buffer of the model's state dict, a tied weight once."""
    return list({id(t): t for t in model.state_dict(keep_vars=True).values()}.values())


def zero_host_copy_bytes(cell: Cell, params: list[int], sub_groups: list[int]) -> int:
    """A ZeRO cell's save, from its parameters' sizes in order (`params`, tied ones once; every one
    trains under ZeRO here): bf16 weights, fp32 master partition and Adam's moments per rank. ZeRO-3's
    optimizer `sub_groups`, elements per rank (bench/predict/hybrid.py: `sub_groups`)."""
    bf16_weights = BF16_BYTES * sum(params)
    optimizer_on_host = any(u.name == "offload" and u.opts["optimizer"] for u in cell.stack.uses)
    if cell.checkpoint == "model":
        return bf16_weights  # ZeRO-2: the flat buffer whole; ZeRO-3: gathered onto rank 0's host
    if optimizer_on_host:
        fp32_partition = 0  # written in place from host memory
    elif "zero3" in cell.stack.names:
        fp32_partition = FP32_BYTES * max(sub_groups)
    else:
        fp32_partition = FP32_BYTES * -(-sum(params) // cell.gpus)
    model_file = bf16_weights if "zero2" in cell.stack.names else 0  # ZeRO-3's module file: placeholders
    return max(model_file, fp32_partition)


def columns(host_copy_bytes: int, gpu_allocated_gib: float, reserved_gib: float | None,
            host_before_gib: float) -> dict[str, Any]:
    """The predicted checkpoint_* columns: on the GPU, what the last step left alive plus the save's
    gathers (`gpu_allocated_gib`) within what training reserved; on the host, what was there plus the
    save's copies."""
    copies_gib = host_copy_bytes / measure.GIB
    return {
        "checkpoint_peak_allocated_gib": gpu_allocated_gib,
        "checkpoint_peak_reserved_gib": max(reserved_gib or 0.0, gpu_allocated_gib),
        "checkpoint_host_copies_gib": copies_gib,
        "checkpoint_host_peak_gib": host_before_gib + copies_gib,
    }
