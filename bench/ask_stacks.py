"""`bench ask` with several --stack: which of these stacks fit my card, and what each needs.

    python -m bench ask llama-3.1-8b --seq 4096 --stack gc --stack "gc + lora" --stack "gc + qlora"

Each stack is its own answer (`ask.answer`: one fake run on this CPU, beside its record and any
published GPU row of the same settings), shown as one row of a table in the order asked. A row's
figures are the ones the single answer shows; `bench ask` with that stack alone adds the breakdown at
the peak and what its record is of (the models and ranks of its cells).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from . import ask, fit
from .predict import gpus
from .predict import report as predict_report
from .predict import runner as predict_runner

# Of several answers, the one the exit code reports: any stack that fits makes it 0, as one answer would.
VERDICT_ORDER = ("fits", "not judged", "host_oom", "does not fit", "not predicted")
COLUMNS = (("stack", "stack"), ("verdict", "verdict"), ("peak allocated GiB", "peak_allocated_gib"),
           ("peak reserved GiB", "peak_reserved_gib"), ("needs GiB", "need_gib"), ("trainable", "trainable"),
           ("record", "record"), ("measured reserved GiB", "measured_gib"))
LEFT = ("stack", "verdict")  # the others are figures: right-aligned


@dataclass(frozen=True)
class Stacks:
    answers: tuple[ask.Answer, ...]  # one per stack, in the order asked

    @property
    def verdict(self) -> str:
        """The best of the answers' verdicts (VERDICT_ORDER): what the exit code says."""
        return min((a.verdict for a in self.answers), key=VERDICT_ORDER.index)


def answers(question: ask.Question, stacks: list[str], card: gpus.GpuKind, host_memory_gib: float | None,
            results_dir: Path, report: Callable[[str], None] = lambda line: None, jobs: int = 1,
            model_files: tuple[Path, ...] = ()) -> Stacks:
    """Each stack asked about on the card, one fake run each; `report` gets a line as each is answered.
    With jobs > 1, the fake runs go to that many processes (each registering `model_files`, the config.json
    files asked about), so stacks are answered side by side."""
    def one(stack: str, pool: Executor | None) -> ask.Answer:
        found = ask.answer(replace(question, stack=stack), card, host_memory_gib, results_dir, pool)
        report(f"{found.cell.stack.label}: {found.verdict}{ask.verdict_detail(found)}")
        return ask.with_record(found, results_dir)

    if jobs == 1:
        return Stacks(tuple(one(stack, None) for stack in stacks))
    with predict_runner.spawned_pool(jobs, model_files) as pool, ThreadPoolExecutor(jobs) as threads:
        return Stacks(tuple(threads.map(lambda stack: one(stack, pool), stacks)))


def row(a: ask.Answer) -> dict[str, str]:
    """One answer's figures as the table shows them ("" where not known)."""
    p = a.predicted
    figures = {column: f"{p[column]:.2f}" for column in ("peak_allocated_gib", "peak_reserved_gib")
               if p.get(column) is not None}
    need = fit.predicted_need_gib(p) if p.get("status") == "ok" else None
    risky = "*" if ask.worst_miss_over_headroom(a) is not None else ""
    return {"stack": a.cell.stack.label, "verdict": a.verdict + risky, **figures,
            "need_gib": "" if need is None else f"{need:.2f}",
            "trainable": ask.param_count(p["trainable_params"]).strip() if p.get("trainable_params") else "",
            "record": _record(a.record), "measured_gib": _measured(a)}


def _record(r: predict_report.Record | None) -> str:
    """How the published GPU cells predicted as this one was fared: their peak reserved errors' range."""
    if r is None:
        return ""
    if not r.reserved_errors:
        return "none yet"
    return f"{min(r.reserved_errors):+.2%} to {max(r.reserved_errors):+.2%} ({len(r.reserved_errors)})"


def _measured(a: ask.Answer) -> str:
    """The published runs' peak reserved on this GPU kind (their max), else how they ended (OOM), else ""."""
    rows = [r for r in a.measured if r.get("gpu_name") == a.card.name]
    reserved = [r["peak_reserved_gib"] for r in rows if r.get("status") == "ok" and r.get("peak_reserved_gib") is not None]
    if reserved:
        return f"{max(reserved):.2f}"
    return ", ".join(sorted({str(r.get("status")).upper() for r in rows}))


def text(found: Stacks) -> str:
    """The answers as one table, what "needs" means on this card, and which stacks fit."""
    first = found.answers[0]
    c, card = first.cell, first.card
    capacity = f" ({card.memory_gib:.2f} GiB)" if card.memory_gib is not None else ""
    rows = [row(a) for a in found.answers]
    widths = {key: max(len(title), *(len(r.get(key, "")) for r in rows)) for title, key in COLUMNS}

    def line(cells: dict[str, str]) -> str:
        return "  ".join(cells.get(key, "").ljust(widths[key]) if key in LEFT else cells.get(key, "").rjust(widths[key])
                         for _, key in COLUMNS).rstrip()

    lines = [f"{c.model}, seq {c.seq_len}, batch {c.batch_size}, {ask.ranks(c.gpus)}: {card.name}{capacity}",
             f"{len(rows)} stacks predicted on this CPU (fake runs, not measurements), under "
             f"{ask.software(first.predicted)}", "", line({key: title for title, key in COLUMNS}), *map(line, rows), ""]
    lines += [f"{a.cell.stack.label}: {ask.not_predicted(a.predicted)}" for a in found.answers
              if a.predicted.get("status") != "ok"]
    fitting = [a.cell.stack.label for a in found.answers if a.verdict == "fits"]
    lines += ["needs: the smallest card the step runs on (the allocator releasing its cache and retrying), else the "
              "whole device's peak; on a card whose context is not measured, torch's alone. record: predicted - "
              "measured peak reserved over measured, on the published GPU cells (how many) predicted as this "
              "stack was; *: a miss as large as its worst would not fit. measured reserved: a published GPU run's, "
              "on this GPU kind",
              f"fits: {', '.join(fitting) if fitting else 'none of these'}",
              "each stack alone (bench ask ... --stack S) adds its breakdown at the peak and what its record is of "
              "(models, ranks)"]
    return "\n".join(lines)


def as_json(found: Stacks) -> str:
    return json.dumps({"verdict": found.verdict, "answers": [json.loads(ask.as_json(a)) for a in found.answers]},
                      indent=1)
