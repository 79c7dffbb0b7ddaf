"""One row from the rows of a multi-GPU cell's ranks (torchrun: one process, one row per rank).

- memory: per GPU, the max over ranks (what must fit on each card); each rank's own figures are
  kept in per_rank_json. Stage times (build, first step, warm-up): the slowest rank's.
- throughput: all ranks together: tokens of every rank over the slowest rank's measured time;
  tokens_per_s_per_gpu divides it by the rank count. Step-time percentiles are rank 0's.
- losses: the mean over ranks of each step's loss: the loss of the global batch, comparable with a
  one-GPU cell of the same global batch (exactly so where ranks see equal token counts: not with padding).
- status: ok only if every rank is ok; else a failed rank's status, error and OOM phase: the first
  rank that ran out of memory if one did (the others then fail in collectives, "connection closed
  by peer"), else the first that failed. A rank with no row was stopped by torchrun after another failed.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from .results import MEMORY_COLUMNS, STAGE_TIME_COLUMNS

PER_RANK = ("peak_allocated_gib", "peak_reserved_gib", "nvml_peak_gib", "host_rss_peak_gib", "measured_s", "status")


def merge(base: dict[str, Any], by_rank: dict[int, dict[str, Any]], world: int) -> dict[str, Any]:
    """The cell's row: `base` (what the runner knows) with the ranks' measurements merged in."""
    rows = [by_rank.get(r) for r in range(world)]
    present = [r for r in rows if r is not None]
    if not present:
        return base | {"status": "error", "error": "no rank wrote a row"}
    row = base | (rows[0] or present[0])
    for col in (*MEMORY_COLUMNS, *STAGE_TIME_COLUMNS):  # what each card must hold; the slowest rank's time
        values = [r[col] for r in present if r.get(col) is not None]
        row[col] = max(values) if values else None
    held = [r["context_before_cell"] for r in present if r.get("context_before_cell") is not None]
    row["context_before_cell"] = any(held) if held else None  # any rank's context was in its GPU's figures
    row["per_rank_json"] = json.dumps([{k: r.get(k) for k in PER_RANK} if r else None for r in rows])
    failed = [(i, r) for i, r in enumerate(rows) if r is not None and r["status"] != "ok"]
    failed.sort(key=lambda found: found[1]["status"] != "oom")  # an OOM is the cause, not its echo
    missing = [i for i, r in enumerate(rows) if r is None]
    if failed or missing:
        i, bad = failed[0] if failed else (missing[0], None)
        note = f"ranks without a row: {missing}" if missing else ""  # stopped by torchrun, or killed on timeout
        if bad is None:
            return row | {"status": "error", "error": note}
        return row | {"status": bad["status"], "oom_phase": bad.get("oom_phase"),
                      "error": f"rank {i}: {bad.get('error') or ''}" + (f"\n{note}" if note else "")}
    return row | _throughput(present, base["measure_steps"]) | {"losses_json": _mean_losses(present)}


def _throughput(rows: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    slowest_s = max(r["measured_s"] for r in rows)
    tokens_per_step = sum(r["tokens_per_step"] for r in rows)
    useful_per_step = sum(r["useful_tokens_per_step"] for r in rows)
    return {
        "tokens_per_step": tokens_per_step,
        "useful_tokens_per_step": useful_per_step,
        "measured_s": slowest_s,
        "tokens_per_s": tokens_per_step * steps / slowest_s,
        "useful_tokens_per_s": useful_per_step * steps / slowest_s,
        "tokens_per_s_per_gpu": tokens_per_step * steps / slowest_s / len(rows),
    }


def _mean_losses(rows: list[dict[str, Any]]) -> str:
    per_rank = [json.loads(r["losses_json"]) for r in rows]
    return json.dumps([round(statistics.fmean(step), 6) for step in zip(*per_rank, strict=True)])
