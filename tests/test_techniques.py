"""The catalogue: every technique declares itself fully; on the CPU, each one that can run does,
and proves it applied; each that cannot is skipped with a reason naming the rule."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from bench.techniques import REGISTRY
from conftest import raw_rows, run_bench, write_matrix


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_technique_declares_what_it_saves_and_costs(name: str) -> None:
    t = REGISTRY[name]
    module = importlib.import_module(f"bench.techniques.{name}")
    assert module.__doc__ and len(module.__doc__) > 100, "module docstring: what it saves, what it costs"
    assert t.summary and len(t.summary) <= 110
    for option, allowed in t.choices.items():
        assert t.options[option] in allowed, f"{name}.{option}: default outside its choices"


CATALOGUE = """
matrices:
  cat:
    device: cpu
    models: [tiny-llama]
    seq_lens: [64]
    batch_sizes: [2]
    stacks: [baseline, adamw(impl=foreach), adamw(impl=forloop), adamw8bit, eager_attention, gc + adamw8bit,
             liger, expandable_segments, paged_adamw8bit]
    steps: {warmup: 2, measure: 3}
    timeout_s: 120
"""


@pytest.mark.timeout(600)
def test_catalogue_on_cpu(workdir: Path) -> None:
    pytest.importorskip("bitsandbytes")
    write_matrix(workdir, CATALOGUE)
    proc = run_bench(workdir, "run", "cat", "--run-id", "c", "--prefork", "on")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["stack"]: r for r in raw_rows(workdir, "c").values()}
    losses = {s: json.loads(r["losses_json"]) for s, r in rows.items() if r["status"] == "ok"}
    base = losses["baseline"]

    # Same math, other kernels: the same losses up to bf16 rounding.
    for exact in ("adamw(impl=foreach)", "adamw(impl=forloop)", "eager_attention"):
        assert losses[exact] == pytest.approx(base, rel=1e-2), exact
    assert json.loads(rows["eager_attention"]["evidence_json"]) == {"attn_implementation": "eager"}

    # 8-bit states: less optimizer memory than bf16 AdamW's two bf16 moments, same first loss.
    assert rows["adamw8bit"]["optimizer_state_gib"] < rows["baseline"]["optimizer_state_gib"]
    assert losses["adamw8bit"][0] == pytest.approx(base[0], rel=1e-3)
    assert rows["gc + adamw8bit"]["status"] == "ok"

    for gpu_only in ("liger", "expandable_segments", "paged_adamw8bit"):
        assert rows[gpu_only]["status"] == "skipped"
        assert rows[gpu_only]["skip_reason"] == f"{gpu_only} needs CUDA (this cell runs on cpu)"
