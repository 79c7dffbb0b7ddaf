"""Ranks: who this process is in a cell, and the process group engines need.

A cell with `gpus: N > 1` runs under torchrun, one process per rank; torchrun sets RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. A one-GPU cell is a world of one: engines
still get a process group (DeepSpeed and FSDP2 need one), on a free local port.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket

# A world of one; DeepSpeed looks for these (and for MPI without them) when it is imported.
SINGLE_RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def init(cuda: bool) -> None:
    """The default process group (nccl on GPUs, gloo on the CPU), once per process."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for key, value in SINGLE_RANK_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if cuda:
        torch.cuda.set_device(local_rank())
    dist.init_process_group("nccl" if cuda else "gloo")


_MESHES: dict[str, object] = {}


def mesh(device_type: str):
    """The 1-D device mesh of every rank of the default group, made once per device type. A fake run
    (bench predict) makes it before its tensors turn fake: the mesh's rank table is real data."""
    from torch.distributed.device_mesh import init_device_mesh

    if device_type not in _MESHES:
        _MESHES[device_type] = init_device_mesh(device_type, (world_size_of_group(),))
    return _MESHES[device_type]


def world_size_of_group() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else world_size()


def shutdown() -> None:
    import torch.distributed as dist

    _MESHES.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG): a killed runner, or a killed
    torchrun, leaves nothing running on the GPU. Not Linux (no libc.so.6): nothing happens."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
