"""The GPUs a prediction is for: what a fake run cannot see but a card adds.

To allocated memory: cuBLAS workspaces, whose size PyTorch chooses by compute capability. To the
device's whole use: what lives outside torch's allocator (the CUDA context, cuBLAS and kernel
modules), measured once per GPU kind from published rows (NVML peak − peak reserved), and the card's
capacity as NVML reported it. A kind without such rows predicts allocated and reserved memory, but
not whether the whole device fits (or pass --gpu-memory-gib).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class GpuKind:
    key: str  # what --gpu takes
    name: str  # as NVML names it (what measured rows record in gpu_name)
    compute_capability: tuple[int, int]
    memory_gib: float | None = None  # total memory as NVML reported it on a measured run, GiB; None: not measured yet
    outside_torch_gib: float | None = None  # NVML peak − peak reserved on a measured run (the context), GiB
    # The budgets `bench fit --predict` searches on this card, GiB: each prediction says whether its step runs
    # within each (fits_budgets_json), since running within one does not promise running within a larger one
    budgets_gib: tuple[float, ...] = ()
    # Streaming multiprocessors (the datasheet's; torch's multi_processor_count on the GPU, a GPU test checks): kernels
    # whose choice of path depends on how many waves a shape makes ask it (bitsandbytes' 4-bit matmul: bnb.py)
    multiprocessors: int | None = None

    @property
    def cublas_workspace_bytes(self) -> int:
        """PyTorch's default cuBLAS workspace per handle (CUBLAS_WORKSPACE_CONFIG unset): 32 MiB from
        compute capability 9.0 (Hopper) on, else 4096 KiB x 2 + 16 KiB x 8."""
        return 32 * MIB if self.compute_capability >= (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


# Card memory only where a measured row recorded it (else pass --gpu-memory-gib).
GPUS = {g.key: g for g in (
    # gpu_memory_gib of the published H100 runs; outside torch: the median over the 56 ok cells of
    # llama3b-h100-20261122 (driver 580, CUDA 13.0, torch 2.11; 0.733 to 0.749 but for one liger cell)
    GpuKind("h100", "NVIDIA H100 80GB HBM3", (9, 0), 79.647, 0.749, multiprocessors=132),
    # the published H200 run's (llama3b-h200-20261127: driver 580, CUDA 13.0, torch 2.11; 0.730 to 0.746 over
    # its 15 ok cells but for the paged optimizer's): the H100's context, within 3 MiB
    GpuKind("h200", "NVIDIA H200", (9, 0), 140.401, 0.746, multiprocessors=132),
    GpuKind("a100", "NVIDIA A100", (8, 0), multiprocessors=108),
    GpuKind("l40s", "NVIDIA L40S", (8, 9), multiprocessors=142),
    GpuKind("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9), multiprocessors=128),
)}


def get(key: str) -> GpuKind:
    try:
        return GPUS[key]
    except KeyError:
        raise KeyError(f"unknown GPU kind {key!r}; known: {', '.join(GPUS)}") from None
