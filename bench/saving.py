"""Checkpoint saves, as trainers do them, so the suite can measure the save (`checkpoint:` in a matrix).

The failure users meet hours into a run: the save needs memory the training steps did not.
- model: the weights a trainer exports. save_pretrained (a LoRA model saves its adapters only);
  under DeepSpeed, save_16bit_model (ZeRO-3 first gathers the partitioned 16-bit weights).
- full: what resuming needs, model + optimizer state. torch.save of both state dicts; under
  DeepSpeed, save_checkpoint (each rank its partition of fp32 master weights and optimizer state).
FSDP2: full -> torch.distributed.checkpoint, each rank its shards of model and optimizer state;
model -> the full state dict gathered to the CPU (as an export does), written by rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save(model: Any, optimizer: Any, kind: str, directory: Path) -> None:
    import torch
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        _save_fsdp(model, optimizer, kind, directory)
    elif hasattr(model, "save_checkpoint"):  # a DeepSpeedEngine
        if kind == "full":
            model.save_checkpoint(str(directory))
        elif not model.save_16bit_model(str(directory)):
            raise RuntimeError("DeepSpeed did not save the 16-bit model (stage3_gather_16bit_weights_on_model_save?)")
    elif kind == "model":
        model.save_pretrained(directory)
    else:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, directory / "state.pt")


def _save_fsdp(model: Any, optimizer: Any, kind: str, directory: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    if kind == "full":
        dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=str(directory))
        return
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.get_rank() == 0:
        torch.save(full, directory / "model.pt")
