"""What a device call would carry, against its limit: run here before a GPU window, not there.

    python3 tools/offline-gpu/travel_size.py [--limit-mib 64] [CARRY ...]

A lent GPU (this project's `device` tool) copies the working tree to the host for each call: the tracked
files, the untracked files git does not ignore, `shared/` where the checkout has one, and the ignored paths
named in `carry`, 64 MiB in all. Past it the call is refused, after the session has waited for a window, so
the check belongs here. The tracked tree grows with every published table (29 MiB on 2026-11-29, 42 MiB on
2026-12-02) and the offline wheels about 12 MiB, so the margin shrinks a little each session.

Prints each part's size, the total and what is left; exits 1 when over the limit, naming the largest tracked
folders (what a smaller tree would come from) and the carried paths (what could be carried in another call).
Default carry: the GPU window's (`.gpu/whl`, `.gpu/setup.sh`, DeepSpeed's source archive, `results/raw`).
Exits 2, naming it, outside a git checkout.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

MIB = 2**20
WINDOW_CARRY = (".gpu/whl", ".gpu/setup.sh", ".gpu/deepspeed-0.19.8.tar.gz", "results/raw")


def _git_files(root: Path, *args: str) -> list[Path]:
    """Files `git ls-files ARGS` names under `root` that exist (a file deleted but not yet committed stays home)."""
    listed = subprocess.run(["git", "ls-files", "-z", *args], cwd=root, capture_output=True, check=True).stdout
    paths = (root / name for name in listed.decode().split("\0") if name)
    return [path for path in paths if path.is_file() and not path.is_symlink()]


def _files_under(path: Path) -> list[Path]:
    """Every plain file at or below `path` (a file alone, a folder's whole tree; nothing when absent)."""
    if path.is_file():
        return [path]
    return [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()] if path.is_dir() else []


def _bytes(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files)


def travel_parts(root: Path, carry: list[str]) -> dict[str, int]:
    """Bytes per part of what a call from `root` carrying `carry` would copy, in the device tool's terms."""
    parts = {"tracked": _bytes(_git_files(root)),
             "untracked, not ignored": _bytes(_git_files(root, "--others", "--exclude-standard"))}
    if (root / "shared").exists():
        parts["shared/"] = _bytes(_files_under(root / "shared"))
    for path in carry:
        parts[f"carry {path}"] = _bytes(_files_under(root / path))
    return parts


def largest_tracked_folders(root: Path, depth: int = 2, top: int = 5) -> list[tuple[str, int]]:
    """The tracked folders, `depth` levels down, that hold the most bytes."""
    sizes: Counter[str] = Counter()
    for path in _git_files(root):
        sizes["/".join(path.relative_to(root).parts[:depth])] += path.stat().st_size
    return sizes.most_common(top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("carry", nargs="*", default=list(WINDOW_CARRY), help="ignored paths the call carries")
    parser.add_argument("--limit-mib", type=float, default=64.0, help="what a call may carry (default 64)")
    args = parser.parse_args(argv)
    found = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if found.returncode != 0:  # a device call copies a git checkout: nothing to size elsewhere
        print(f"travel_size: not in a git checkout ({Path.cwd()})", file=sys.stderr)
        return 2
    root = Path(found.stdout.strip())
    parts = travel_parts(root, args.carry)
    for name, size in parts.items():
        print(f"{size / MIB:8.1f} MiB  {name}")
    total_mib = sum(parts.values()) / MIB
    print(f"{total_mib:8.1f} MiB  in all, of {args.limit_mib:g} MiB: {args.limit_mib - total_mib:.1f} MiB left")
    if total_mib <= args.limit_mib:
        return 0
    print("over the limit: the call would be refused. Largest tracked folders:", file=sys.stderr)
    for folder, size in largest_tracked_folders(root):
        print(f"{size / MIB:8.1f} MiB  {folder}", file=sys.stderr)
    print("carry less in one call (each path above is a `carry` entry) or make the tracked tree smaller",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
