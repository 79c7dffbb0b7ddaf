"""`bench ask` with several --stack: which of these stacks fit my card, and what each needs.

    python -m bench ask llama-3.1-8b --seq 4096 --stack gc --stack "gc + lora" --stack "gc + qlora"

Each stack is its own answer (`ask.answer`: one fake run on this CPU, beside its record and any
published GPU row of the same settings), shown as one row of a table in the order asked. A row's
figures are the ones the single answer shows; `bench ask` with that stack alone adds the breakdown at
the peak. Below the table, what each record is of: the models and rank counts of its cells, and a mark
on a row whose model or rank count none of them shares (its predictions are then not checked on a GPU).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from . import ask, fit
from .predict import gpus
from .predict import runner as predict_runner

# Of several answers, the one the exit code reports: any stack that fits makes it 0, as one answer would.
VERDICT_ORDER = ("fits", "not judged", "host_oom", "does not fit", "not predicted")
COLUMNS = (("stack", "stack"), ("verdict", "verdict"), ("peak allocated GiB", "peak_allocated_gib"),
           ("peak reserved GiB", "peak_reserved_gib"), ("needs GiB", "need_gib"), ("trainable", "trainable"),
           ("TFLOP a step", "step_tflop"), ("tokens/s", "tokens_per_s"), ("record", "record"),
           ("measured reserved GiB", "measured_gib"), ("measured tokens/s", "measured_tokens_per_s"))
LEFT = ("stack", "verdict")  # the others are figures: right-aligned
LEGEND = (
    "needs: the smallest card the step runs on (the allocator releasing its cache and retrying), else the whole "
    "device's peak; on a card whose context is not measured, torch's alone",
    "TFLOP a step: the matmuls and attention the fake run dispatched, recomputation included (empty where they run "
    "in kernels it cannot count)",
    "tokens/s: predicted, the step's time from its work at this GPU kind's fitted rates (bench/predict/steptime.py; "
    "empty where not predicted: `bench ask` with that stack alone says why)",
    "record: predicted - measured peak reserved over measured, on the published GPU cells (how many) predicted as "
    "this stack was; ?: this model's architecture, one of this stack's techniques or this many GPUs is in none of "
    "them, so how its prediction fares is not measured; *: a miss as large as its worst would not fit",
    "measured: a published GPU run's, on this GPU kind (several: the largest reserved, the least tokens/s)")


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
    figures = {column: f"{p[column]:.2f}" for column in ("peak_allocated_gib", "peak_reserved_gib", "step_tflop")
               if p.get(column) is not None}
    need = fit.predicted_need_gib(p) if p.get("status") == "ok" else None
    ms = ask.predicted_step_ms(a)
    risky = "*" if ask.worst_miss_over_headroom(a) is not None else ""
    return {"stack": a.cell.stack.label, "verdict": a.verdict + risky, **figures,
            "need_gib": "" if need is None else f"{need:.2f}",
            "tokens_per_s": "" if ms is None else f"{ask.tokens_per_s(a, ms):,.0f}",
            "trainable": ask.param_count(p["trainable_params"]).strip() if p.get("trainable_params") else "",
            "record": _record(a), **_measured(a)}


def _record(a: ask.Answer) -> str:
    """How the published GPU cells predicted as this one was fared: their peak reserved errors' range, marked
    "?" where this model's architecture, one of its techniques or this many GPUs is in none of them."""
    r = a.record
    if r is None:
        return ""
    if not r.reserved_errors:
        return "none yet"
    unlike = "?" if ask.unlike_the_record(a.cell, r) else ""
    return f"{min(r.reserved_errors):+.2%} to {max(r.reserved_errors):+.2%} ({len(r.reserved_errors)}){unlike}"


def records_of(found: Stacks) -> list[str]:
    """What each record in the table is of, once per kind: its cells' models and rank counts."""
    kinds = {a.record.kind: a.record for a in found.answers if a.record is not None and a.record.reserved_errors}
    return [f"  {kind}: {_count(len(r.reserved_errors), 'cell')} of {', '.join(r.models) or 'models not recorded'}, "
            f"on {' or '.join(map(str, r.gpus)) or '?'} GPU{'s' if r.gpus != (1,) else ''}" for kind, r in kinds.items()]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _measured(a: ask.Answer) -> dict[str, str]:
    """The published runs on this GPU kind: their peak reserved (the largest) and tokens/s (the least), else how
    they ended (OOM)."""
    rows = [r for r in a.measured if r.get("gpu_name") == a.card.name]
    ok = [r for r in rows if r.get("status") == "ok" and r.get("peak_reserved_gib") is not None]
    if not ok:
        return {"measured_gib": ", ".join(sorted({str(r.get("status")).upper() for r in rows}))}
    speeds = [r["tokens_per_s"] for r in ok if r.get("tokens_per_s")]
    return {"measured_gib": f"{max(r['peak_reserved_gib'] for r in ok):.2f}",
            "measured_tokens_per_s": f"{min(speeds):,.0f}" if speeds else ""}


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

    # the releases of a stack that ran (a skipped one, planned only, records none)
    ran = next((a.predicted for a in found.answers if a.predicted.get("torch_version")), first.predicted)
    lines = [f"{c.model}, seq {c.seq_len}, batch {c.batch_size}, {ask.ranks(c.gpus)}: {card.name}{capacity}",
             f"{len(rows)} stacks predicted on this CPU (fake runs, not measurements), under "
             f"{ask.software(ran)}", "", line({key: title for title, key in COLUMNS}), *map(line, rows), ""]
    lines += [f"{a.cell.stack.label}: {ask.not_predicted(a.predicted)}" for a in found.answers
              if a.predicted.get("status") != "ok"]
    records = records_of(found)
    lines += [*LEGEND, *(["records, of:", *records] if records else []), fits_line(found),
              "each stack alone (bench ask ... --stack S) adds its breakdown at the peak"]
    return "\n".join(lines)


def fits_line(found: Stacks) -> str:
    """Which stacks fit; and which could not be judged (an unmeasured card's context), so that "none" is said
    only of stacks judged not to fit."""
    def of(verdict: str) -> list[str]:
        return [a.cell.stack.label for a in found.answers if a.verdict == verdict]

    fitting, unjudged = of("fits"), of("not judged")
    if not unjudged:
        return f"fits: {', '.join(fitting) or 'none of these'}"
    return f"fits: {', '.join(fitting) or 'none judged to'}; not judged: {', '.join(unjudged)} (see each row's line above)"


def as_json(found: Stacks) -> str:
    return json.dumps({"verdict": found.verdict, "answers": [json.loads(ask.as_json(a)) for a in found.answers]},
                      indent=1)
