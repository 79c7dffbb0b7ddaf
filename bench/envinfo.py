"""What this machine is and has: GPUs, packages, library versions, git state.

`HostCaps` is read by the runner (parent process) to plan; `provenance()` is read by each worker
and stored on every row, so each number carries the machine and versions that made it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .measure import GIB, nvml_device_handle

# import names of the packages optional techniques need
OPTIONAL_PACKAGES = ("peft", "deepspeed", "liger_kernel", "bitsandbytes", "torchao", "galore_torch", "apollo_torch",
                     "cut_cross_entropy", "unsloth")
VERSIONED = ("torch", "transformers", "peft", "deepspeed", "liger-kernel", "bitsandbytes", "accelerate")
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class HostCaps:
    cuda_devices: int
    packages: frozenset[str]


def host_caps() -> HostCaps:
    import torch  # device_count() asks the driver; it does not create a CUDA context

    installed = frozenset(p for p in OPTIONAL_PACKAGES if importlib.util.find_spec(p) is not None)
    return HostCaps(cuda_devices=torch.cuda.device_count(), packages=installed)


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for dist in VERSIONED:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def git_state() -> tuple[str | None, bool | None]:
    """(sha, dirty). Copies without .git (an offline GPU host) pass BENCH_GIT_SHA / BENCH_GIT_DIRTY."""
    if "BENCH_GIT_SHA" in os.environ:
        return os.environ["BENCH_GIT_SHA"], os.environ.get("BENCH_GIT_DIRTY", "unknown") == "1"
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--", "bench", "matrix.yaml"],
                                cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return sha.stdout.strip(), bool(status.stdout.strip())


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info(cuda_devices: int) -> dict[str, object]:
    """Name, memory and driver of the first visible GPU, read through NVML (no CUDA context)."""
    import torch

    info: dict[str, object] = {"gpu_name": None, "gpu_count": cuda_devices, "gpu_memory_gib": None,
                               "driver": None, "cuda": torch.version.cuda}
    if cuda_devices == 0:
        return info
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = nvml_device_handle(pynvml)
        name = pynvml.nvmlDeviceGetName(handle)
        info["gpu_name"] = name.decode() if isinstance(name, bytes) else name
        info["gpu_memory_gib"] = pynvml.nvmlDeviceGetMemoryInfo(handle).total / GIB
        info["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # no NVML library: GPU fields stay empty rather than failing the run
        pass
    return info


def provenance(host: HostCaps) -> dict[str, object]:
    """The machine, versions and code behind a run; stored on every row."""
    sha, dirty = git_state()
    return {
        **gpu_info(host.cuda_devices),
        "cpu_name": cpu_name(),
        "python": platform.python_version(),
        "python_hash_seed": os.environ.get("PYTHONHASHSEED"),  # bench/hashseed.py pins it
        **{f"{name.replace('-', '_')}_version": v for name, v in versions().items()},
        "git_sha": sha,
        "git_dirty": dirty,
    }
