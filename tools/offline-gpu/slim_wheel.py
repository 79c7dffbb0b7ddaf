"""Drop the files a wheel ships for platforms the GPU host is not, so the wheels fit what a device call carries.

    python3 tools/offline-gpu/slim_wheel.py WHEEL REGEX

Removes every member whose path matches REGEX, and its line in the wheel's RECORD (so the installed
RECORD lists only what was installed), rewriting WHEEL in place. bitsandbytes 0.50.2 ships one library
per CUDA, ROCm and XPU release (123 MiB unpacked, 41 MiB packed); the GPU image's torch is 2.11.0+cu130,
which loads libbitsandbytes_cuda130.so. With that one and the CPU one alone the wheel is 3.4 MiB, and .gpu/whl
(49 -> 10 MiB) travels beside the tracked tree within a call's 64 MiB.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path


def slim(wheel: Path, pattern: re.Pattern[str]) -> int:
    """Rewrites `wheel` without the members `pattern` matches; returns how many were dropped."""
    slimmed = wheel.with_suffix(".slim")
    dropped = 0
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as target:
        for member in source.infolist():
            if pattern.search(member.filename):
                dropped += 1
                continue
            data = source.read(member.filename)
            if member.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not pattern.search(line.split(",")[0])).encode()
            target.writestr(member, data)
    slimmed.replace(wheel)
    return dropped


if __name__ == "__main__":
    wheel, regex = Path(sys.argv[1]), re.compile(sys.argv[2])
    print(f"{wheel.name}: dropped {slim(wheel, regex)} files; now {wheel.stat().st_size / 2**20:.1f} MiB")
