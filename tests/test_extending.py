"""Adding a technique is adding one file: in a copy of the suite, a new file in bench/techniques/ is
found by the planner, its rules refuse a bad stack, and a run applies it, including a hook that acts
during the step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO

NEW_TECHNIQUE = '''
"""Counts what autograd saves for backward outside checkpointed regions (a test of the step hook).

Saves: nothing; it only observes. Costs: a Python call per saved tensor. Under `gc`, each decoder
layer's intermediates are saved by the checkpoint's own hooks, so far fewer bytes reach this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .base import Evidence, Options, Phase, Technique


@contextlib.contextmanager
def _count(cell: Any, opts: Options, evidence: Evidence) -> Iterator[None]:
    import torch

    def pack(tensor: Any) -> Any:
        evidence["saved_bytes"] = evidence.get("saved_bytes", 0) + tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


def _validate(names: frozenset[str], opts: Options) -> str | None:
    return None if opts["every"] >= 1 else "every must be at least 1"


TECHNIQUE = Technique(
    name="saved_bytes",
    summary="test: counts the bytes autograd saves for backward",
    phase=Phase.PATCH,
    options={"every": 1},
    around_step=_count,
    validate=_validate,
)
'''

MATRIX = """
matrices:
  ext:
    device: cpu
    models: [tiny-llama]
    seq_lens: [32]
    batch_sizes: [2]
    stacks: [baseline, saved_bytes, gc + saved_bytes]
    steps: {warmup: 1, measure: 2}
    timeout_s: 120
"""


def _suite_copy(root: Path) -> Path:
    shutil.copytree(REPO / "bench", root / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "bench" / "techniques" / "saved_bytes.py").write_text(NEW_TECHNIQUE.lstrip())
    (root / "matrix.yaml").write_text(textwrap.dedent(MATRIX))
    (root / "bad.yaml").write_text(textwrap.dedent(MATRIX).replace("gc + saved_bytes", "saved_bytes(every=0)"))
    return root


def _bench(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-m", "bench", "--results-dir", str(root / "results"), *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_technique_added_as_one_file_is_found_validated_and_applied(tmp_path: Path) -> None:
    root = _suite_copy(tmp_path)

    listed = _bench(root, "list", "ext")
    assert listed.returncode == 0, listed.stderr
    assert "tiny-llama_s32_b2_gc+saved_bytes_" in listed.stdout

    refused = _bench(root, "--matrix-file", str(root / "bad.yaml"), "list", "ext")
    assert refused.returncode == 2
    assert "saved_bytes(every=0): every must be at least 1" in refused.stderr

    ran = _bench(root, "run", "ext", "--run-id", "e")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    rows = {}
    for path in (root / "results" / "raw" / "e").glob("*.json"):
        row = json.loads(path.read_text())
        rows[row["stack"]] = row
    assert {r["status"] for r in rows.values()} == {"ok"}, [r["error"] for r in rows.values()]
    saved = {stack: json.loads(rows[stack]["evidence_json"])["saved_bytes"] for stack in ("saved_bytes", "gc + saved_bytes")}
    # Observing changes nothing: the same losses, bit for bit.
    assert rows["saved_bytes"]["losses_json"] == rows["baseline"]["losses_json"]
    # Under gc the layers' intermediates went to the checkpoint's own hooks.
    assert saved["gc + saved_bytes"] < 0.75 * saved["saved_bytes"]  # tiny-llama: logits dominate what is left
    assert saved["saved_bytes"] > 3 * 2 * 32 * 64 * 2  # more than one bf16 hidden state per step
