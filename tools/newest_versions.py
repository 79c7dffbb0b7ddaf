"""A version set of the newest releases pip installs today, for the nightly regression gates.

    python tools/newest_versions.py versions/nightly.txt

Writes a constraints file (`make versions-env VERSIONS=nightly`) pinning, for each library whose release can change
training memory (PINNED: the ones the committed sets pin), the version pip installs when asked for all of them today
(a dry run of pip's resolver: nothing is installed), so a nightly gate tests what a user installing today gets, not a
set frozen on the day it was written (`latest-2026-11` is transformers 5.23.0). That is each library's newest final
release on PyPI (read from PyPI's JSON API; pre-releases, development releases and releases whose every file is yanked
passed over) unless pip cannot install it: on 2026-12-02 transformers 5.25.0 required `kernels>=0.19.1`, which PyPI
did not have, so pip installed transformers 5.24.0, and a set pinning 5.25.0 would have failed the gate's install
instead of gating a release. A newest release passed over is named in the file with pip's reason. Prints the set;
exit 2 where PyPI cannot be read, a library has no final release or pip resolves none of the set.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
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


def read_pypi(name: str) -> dict[str, list[dict[str, Any]]]:
    with urllib.request.urlopen(PYPI_JSON.format(name=name), timeout=30) as response:
        return json.load(response)["releases"]


class PipRefused(Exception):
    """pip's resolver found no set of releases to install; the message is pip's last error line."""


def pip_resolves(requirements: list[str], pip_args: tuple[str, ...] = ()) -> dict[str, str]:
    """What pip would install for `requirements` together, by canonical name -> public version (a local label such
    as `+cpu` dropped: `torch==2.15.0` matches it). A dry run with a report: nothing is installed or downloaded beyond
    the metadata pip reads to resolve."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--report", str(report), *pip_args, *requirements]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            errors = [line for line in run.stderr.splitlines() if line.startswith("ERROR:")]
            raise PipRefused(errors[-1].removeprefix("ERROR:").strip() if errors else run.stderr.strip()[-300:])
        installs = json.loads(report.read_text())["install"]
    return {canonicalize_name(item["metadata"]["name"]): Version(item["metadata"]["version"]).public
            for item in installs}


def why_not(name: str, version: str, pip_args: tuple[str, ...] = ()) -> str:
    """pip's reason for not installing `name==version` (alone, or beside the rest of the set)."""
    try:
        pip_resolves([f"{name}=={version}"], pip_args)
    except PipRefused as refused:
        return str(refused)
    return "it installs alone, but not beside the newest of the other libraries: pip chose an older one"


def constraints(chosen: dict[str, str], day: dt.date, passed_over: dict[str, tuple[str, str]] | None = None) -> str:
    """The constraints file: a header, one line per passed-over newest release (version, pip's reason), the pins."""
    lines = [f"# Newest releases pip installs together on {day.isoformat()} (tools/newest_versions.py)."]
    lines += [f"# {name} {version} is on PyPI but not installed: {reason}"
              for name, (version, reason) in (passed_over or {}).items()]
    return "\n".join([*lines, *(f"{name}=={version}" for name, version in chosen.items())]) + "\n"


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
    try:
        resolved = pip_resolves(list(PINNED))
    except PipRefused as refused:
        print(f"newest_versions: pip installs no set of {', '.join(PINNED)}: {refused}", file=sys.stderr)
        return 2
    chosen = {name: resolved[canonicalize_name(name)] for name in PINNED}
    passed_over = {name: (newest[name], why_not(name, newest[name]))
                   for name in PINNED if Version(chosen[name]) < Version(newest[name])}
    text = constraints(chosen, dt.datetime.now(dt.UTC).date(), passed_over)
    args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
