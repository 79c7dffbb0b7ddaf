"""A version set of the newest releases on PyPI, for the nightly regression gates.

    python tools/newest_versions.py versions/nightly.txt

Writes a constraints file (`make versions-env VERSIONS=nightly`) pinning the newest final release of each library
whose release can change training memory (PINNED: the ones the committed sets pin), read from PyPI's JSON API;
pre-releases, development releases and releases whose every file is yanked are passed over. So a nightly gate
tests what a user installing today gets, not a set frozen on the day it was written (`latest-2026-11` is
transformers 5.23.0). Prints the set; exit 2 where PyPI cannot be read or a library has no final release.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

PINNED = ("torch", "transformers", "peft", "liger-kernel", "bitsandbytes")
PYPI_JSON = "https://pypi.org/pypi/{name}/json"


def newest_release(releases: dict[str, list[dict[str, Any]]]) -> str | None:
    """The highest final version among a PyPI project's `releases` (version -> its files) with a file not yanked."""
    final = []
    for text, files in releases.items():
        try:
            version = Version(text)
        except InvalidVersion:
            continue  # a legacy version string pip would not pick either
        if not (version.is_prerelease or version.is_devrelease) and any(not f.get("yanked") for f in files):
            final.append(version)
    return str(max(final)) if final else None


def constraints(newest: dict[str, str], day: dt.date) -> str:
    lines = [f"# Newest releases on PyPI on {day.isoformat()} (tools/newest_versions.py)."]
    return "\n".join([*lines, *(f"{name}=={version}" for name, version in newest.items())]) + "\n"


def read_pypi(name: str) -> dict[str, list[dict[str, Any]]]:
    with urllib.request.urlopen(PYPI_JSON.format(name=name), timeout=30) as response:
        return json.load(response)["releases"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the constraints file written, e.g. versions/nightly.txt")
    args = parser.parse_args()
    newest = {}
    for name in PINNED:
        try:
            version = newest_release(read_pypi(name))
        except OSError as err:
            print(f"newest_versions: cannot read {name}'s releases from PyPI: {err}", file=sys.stderr)
            return 2
        if version is None:
            print(f"newest_versions: {name} has no final release on PyPI", file=sys.stderr)
            return 2
        newest[name] = version
    text = constraints(newest, dt.datetime.now(dt.UTC).date())
    args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
