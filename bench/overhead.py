"""Harness overhead: the suite's own rows of baseline cells beside a bare PyTorch loop on the same cells.

For each ok baseline cell of a run (GPU only), `python -m bench.bareloop` runs the same model,
sequence length, batch, steps and seed in a fresh process; the report gives suite / bare ratios of
tokens/s and of peak reserved memory. A ratio of 1.00 means the harness costs nothing measurable.
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
from typing import Any

import pandas as pd

from .envinfo import REPO
from .stacks import BASELINE
from .views import by_cell


def compare_with_bare_loop(frame: pd.DataFrame, only: str | None, timeout_s: float = 600) -> list[dict[str, Any]]:
    cells = by_cell(frame)
    picked = cells[(cells["stack"] == BASELINE) & (cells["status"] == "ok") & (cells["device"] == "cuda")]
    out = []
    for _, row in picked.iterrows():
        if only and not any(fnmatch.fnmatch(row["cell_id"], g) for g in only.split(",")):
            continue
        bare = _bare_loop(row, timeout_s)
        out.append({
            "cell_id": row["cell_id"],
            "suite_tokens_per_s": float(row["tokens_per_s"]),
            "bare_tokens_per_s": bare["tokens_per_s"],
            "tokens_per_s_ratio": float(row["tokens_per_s"]) / bare["tokens_per_s"],
            "suite_peak_reserved_gib": float(row["peak_reserved_gib"]),
            "bare_peak_reserved_gib": bare["peak_reserved_gib"],
            "peak_reserved_ratio": float(row["peak_reserved_gib"]) / bare["peak_reserved_gib"],
        })
    return out


def _bare_loop(row: pd.Series, timeout_s: float) -> dict[str, float]:
    cmd = [sys.executable, "-m", "bench.bareloop", "--model", row["model"], "--seq-len", str(row["seq_len"]),
           "--batch-size", str(row["batch_size"]), "--warmup", str(row["warmup_steps"]),
           "--measure", str(row["measure_steps"]), "--seed", str(row["seed"])]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bare loop failed for {row['cell_id']}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict[str, Any]], frame: pd.DataFrame) -> str:
    first = frame.iloc[0]
    lines = ["# Harness overhead: the suite's worker vs a bare PyTorch loop", "",
             f"Run `{first['run_id']}` on {first['gpu_name']}, torch {first['torch_version']}, transformers "
             f"{first['transformers_version']}. Suite figures: the run's rows (median over repeats); bare loop: "
             "`python -m bench.bareloop` on the same cell, same steps and seed, run afterwards in a fresh process.", "",
             "| cell | suite tok/s | bare tok/s | ratio | suite peak reserved GiB | bare GiB | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['cell_id']}` | {r['suite_tokens_per_s']:.0f} | {r['bare_tokens_per_s']:.0f} | "
                     f"{r['tokens_per_s_ratio']:.3f} | {r['suite_peak_reserved_gib']:.2f} | "
                     f"{r['bare_peak_reserved_gib']:.2f} | {r['peak_reserved_ratio']:.3f} |")
    return "\n".join(lines) + "\n"
