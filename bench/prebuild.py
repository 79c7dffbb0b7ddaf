"""JIT-built ops compiled once, before the first cell, not inside one.

DeepSpeed compiles its Adam kernels (FusedAdam, CPUAdam) the first time a process uses them, under a
file lock in the torch extensions directory. Inside a cell that costs a minute of its timeout, and a
lock left by a build that was killed makes every later build wait forever: each such cell would hang
until its timeout. So the runner builds what its cells need first, in a child process, and refuses to
start (naming the lock) when a stale lock blocks the build.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from .cells import Cell
from .engines import deepspeed

# CPUAdam takes about a minute on an H100 host (1 min 47 s on a 2-core CPU): a build still waiting
# after this is stuck on a lock; a lock older than STALE_LOCK_S belongs to no build that is still running
DEFAULT_BUILD_TIMEOUT_S = 900
STALE_LOCK_S = 900
_BUILD = ("import sys\nfrom deepspeed.accelerator import get_accelerator\n"
          "for name in sys.argv[1:]:\n    get_accelerator().create_op_builder(name).load()\n")


class BuildBlocked(RuntimeError):
    """A build cannot go on: the message names the lock files to delete."""


def ops_needed(cells: Iterable[Cell]) -> tuple[str, ...]:
    return tuple(sorted({name for cell in cells for name in deepspeed.jit_ops(cell)}))


def build(names: tuple[str, ...]) -> str | None:
    """Builds the named DeepSpeed ops; None when built (or already cached), else why not (the cells that
    need them then record their own error). Raises BuildBlocked, before waiting, when an op's build
    lock is stale, and when a build waits past its timeout."""
    if not names:
        return None
    stale = [lock for name in names for lock in _locks(deepspeed.JIT_OP_DIRS[name])
             if time.time() - lock.stat().st_mtime > STALE_LOCK_S]
    if stale:
        raise BuildBlocked(f"DeepSpeed ops {', '.join(names)} cannot be built{_held(stale)}")
    timeout_s = float(os.environ.get("BENCH_BUILD_TIMEOUT_S", DEFAULT_BUILD_TIMEOUT_S))
    try:
        done = subprocess.run([sys.executable, "-c", _BUILD, *names], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        raise BuildBlocked(f"building DeepSpeed ops {', '.join(names)} took over {timeout_s:.0f} s"
                           f"{held_build_locks()}") from err
    if done.returncode != 0:
        return f"building DeepSpeed ops {', '.join(names)} failed:\n" + "\n".join(done.stderr.splitlines()[-15:])
    return None


def extensions_root() -> Path:
    """Where torch builds extensions: $TORCH_EXTENSIONS_DIR/NAME, else ~/.cache/torch_extensions/pyXY_cpu/NAME
    (torch adds the Python and CUDA versions only to its default root)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")


def _locks(op_dir: str = "*") -> list[Path]:
    root = extensions_root()
    return sorted([*root.glob(f"{op_dir}/lock"), *root.glob(f"*/{op_dir}/lock")])


def held_build_locks() -> str:
    """A torch extension build lock left by a build that was killed: every later build of that op
    waits on it forever. Said with the file to delete ('' when none is held)."""
    return _held(_locks())


def _held(locks: list[Path]) -> str:
    if not locks:
        return ""
    return (f"; a torch extension build lock is held ({', '.join(map(str, locks))}): a build killed before it "
            "finished leaves it, and later builds wait on it; delete it if nothing is building")
