"""`bench ask`: will one training setup fit? One cell — a model, a sequence length, a batch per GPU,
a technique stack, a card — predicted on this CPU by `bench predict`'s fake run, beside what a
published GPU run measured for the same settings, where one did.

    python -m bench ask llama-3.1-8b --seq 4096 --batch 2 --stack "gc + lora"
    python -m bench ask path/to/Qwen3-8B/config.json --seq 8192 --stack "gc + lora" --gpu-memory-gib 24
    python -m bench ask llama-3.1-8b --largest seq --stack "gc + qlora" --gpu-memory-gib 24

`--largest batch` (at --seq) or `--largest seq` (at --batch) asks the question the other way round:
the largest size whose verdict on the card is "fits", searched as `bench fit --predict` searches a
budget (interpolated between the sizes predicted), a few fake runs.

The card is a GPU kind (--gpu), its memory as measured or --gpu-memory-gib. Whether the whole device fits
needs what lives outside torch's allocator (the CUDA context): measured on the H100 and the H200; for
another card, --outside-torch-gib gives yours (the answer says it is yours), else the answer says how
much of it the step leaves room for.

A model is a registry name (bench/model_configs) or any config.json transformers can build (a hub
model's, downloaded alone: no weights are needed). Nothing is written under results/: the answer is
printed, or with --json the predicted row and the measured rows as JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from . import envinfo, fit, models, results, spec
from .cells import Cell
from .predict import gpus, steptime
from .predict import report as predict_report
from .predict import runner as predict_runner

# What a caller's exit code says (the CLI returns it): the verdict on the card and the host.
EXIT_CODES = {"fits": 0, "not judged": 0, "does not fit": 1, "host_oom": 1, "not predicted": 3}


@dataclass(frozen=True)
class Question:
    model: str  # a registry name (models.register_file adds a config file's)
    seq_len: int
    batch_size: int  # per GPU
    stack: str = "baseline"
    gpus: int = 1
    checkpoint: str = "none"  # none | model | full: a save after the last step


@dataclass(frozen=True)
class Answer:
    cell: Cell
    card: gpus.GpuKind  # with the capacity asked for, if any
    predicted: dict[str, Any]  # the prediction's columns; status ok | unsupported | skipped | error
    measured: tuple[dict[str, Any], ...]  # published GPU rows of the same settings, any status
    record: predict_report.Record | None = None  # how predictions made as this one is fared on published GPU cells

    @property
    def verdict(self) -> str:
        """fits | does not fit | host_oom (the device fits, the host's RAM does not) | not judged (no
        card capacity, or nothing known of what lives outside torch on it) | not predicted."""
        p = self.predicted
        if p.get("status") != "ok":
            return "not predicted"
        if p.get("fits") is False or self.torch_alone_exceeds_card:
            return "does not fit"
        if p.get("host_fits") is False:
            return "host_oom"
        return "fits" if p.get("fits") else "not judged"

    @property
    def torch_alone_exceeds_card(self) -> bool:
        """What torch needs alone is above the card, whatever lives outside it: the allocator's smallest capacity,
        releasing its cache and retrying (`least_torch_gib`), else peak allocated (a row from before it)."""
        memory, p = self.card.memory_gib, self.predicted
        needed = p.get("least_torch_gib", p.get("peak_allocated_gib"))
        return memory is not None and needed is not None and needed > memory


def cell_for(question: Question) -> tuple[Cell, str | None]:
    """The question as a cell, planned as `bench predict` plans a GPU host's (same id as a matrix cell
    of the same settings and steps), with the reason the plan would skip it, if any."""
    matrix = spec.from_mapping("ask", {
        "device": "cuda", "models": [question.model], "seq_lens": [question.seq_len],
        "batch_sizes": [question.batch_size], "stacks": [question.stack], "gpus": [question.gpus],
        "checkpoint": question.checkpoint,
    })
    (planned,) = predict_runner.plan(matrix, None)
    return planned.cell, planned.skip_reason


def answer(question: Question, card: gpus.GpuKind, host_memory_gib: float | None, results_dir: Path,
           pool: Executor | None = None) -> Answer:
    """Predicts the cell on fake tensors (seconds to a minute on a CPU; in one of `pool`'s processes, if
    given) and finds its measured rows."""
    cell, skip_reason = cell_for(question)
    if skip_reason is not None:
        predicted: dict[str, Any] = {"status": "skipped", "skip_reason": skip_reason}
    else:
        releases = envinfo.versions()
        predicted = {"prediction_method": predict_runner.METHOD,
                     **{f"{library}_version": releases[library] for library in predict_report.SOFTWARE},
                     **predict_runner.fake_run(pool, cell, card)}  # a hybrid's says its method
        predicted.update(predict_runner.judged(predicted, card.memory_gib, host_memory_gib))
    return Answer(cell, card, predicted, tuple(measured_rows(results_dir, cell)))


def with_record(a: Answer, results_dir: Path) -> Answer:
    """The answer with the record of the published GPU cells predicted as it was (a few seconds: every
    published table is read), where it was predicted."""
    p = a.predicted
    if p.get("status") != "ok":
        return a
    offload = p.get("host_peak_gib") is not None
    return replace(a, record=predict_report.record(results_dir, str(p["prediction_method"]), a.cell.gpus, offload))


def measured_rows(results_dir: Path, cell: Cell) -> list[dict[str, Any]]:
    """Every published GPU row with the cell's settings — model, sequence, batch, stack, ranks, save —
    whatever the matrix, its steps or the run; a budget-capped fit probe is not the same cell."""
    found = []
    for path in sorted(results_dir.glob("*/runs/*.parquet")):
        frame = results.read_parquet(path)
        same = frame[(frame["device"] == "cuda") & (frame["model"] == cell.model) & (frame["seq_len"] == cell.seq_len)
                     & (frame["batch_size"] == cell.batch_size) & (frame["stack"] == cell.stack.label)
                     & (frame["gpus"].fillna(1) == cell.gpus) & (frame["checkpoint"].fillna("none") == cell.checkpoint)
                     & frame["budget_gib"].isna()]
        found += [_plain(row) for row in same.to_dict("records")]
    return found


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """A parquet row with its missing values as None (JSON-able, and `is None` means missing)."""
    return {k: None if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA else v
            for k, v in row.items()}


def text(a: Answer) -> str:
    """The answer for a person: the prediction, labelled as one, the verdict, and any measurement."""
    c, p = a.cell, a.predicted
    on = ranks(c.gpus)
    capacity = f" ({a.card.memory_gib:.2f} GiB)" if a.card.memory_gib is not None else ""
    lines = [f"{c.model}, seq {c.seq_len}, batch {c.batch_size}, stack {c.stack.label}, {on}: "
             f"{a.card.name}{capacity}", f"cell {c.cell_id}"]
    if p["status"] == "ok":
        lines += _predicted_lines(a)
    else:
        lines.append(not_predicted(p))
    lines.append(f"verdict: {a.verdict}{verdict_detail(a)}")
    lines += _record_lines(a)
    by_run: dict[str, list[dict[str, Any]]] = {}
    for row in a.measured:
        by_run.setdefault(row["run_id"], []).append(row)
    lines += [_measured_line(rows) for rows in by_run.values()] or ["measured: no published GPU run has this cell"]
    if p["status"] == "ok" and any(software(row) != software(p) for row in a.measured):
        lines.append("  measured under other releases than predicted here: the fake run runs the step's own code, "
                     "so it follows the releases it runs on (results/PREDICTION.md, By software)")
    return "\n".join(lines)


def _record_lines(a: Answer) -> list[str]:
    """The record of predictions made as this one is, and where the verdict is "fits", whether a miss as
    large as their worst under-prediction of peak reserved would take more than the card has to spare."""
    r = a.record
    if r is None:
        return []
    if not r.reserved_errors:
        return [f"  its kind's record: no published GPU cell predicted as this one ({r.kind}) checks it yet"]
    low, high = min(r.reserved_errors), max(r.reserved_errors)
    of_models = f"{', '.join(r.models)}; " if r.models else ""
    line = (f"  its kind's record: peak reserved predicted {low:+.2%} to {high:+.2%} of measured on the "
            f"{len(r.reserved_errors)} published GPU cells predicted as this one ({r.kind}; {of_models}"
            "results/PREDICTION.md)")
    if r.reserved_errors_before_run:
        before = r.reserved_errors_before_run
        line += (f"; predicted before a GPU ran them, by the methods of the time: {min(before):+.2%} to "
                 f"{max(before):+.2%} on {len(before)}")
    miss_gib = worst_miss_over_headroom(a)
    if miss_gib is not None:
        line += (f"; a miss as large as its worst would need {miss_gib:.2f} GiB more here, over the "
                 f"{a.predicted['headroom_gib']:.2f} GiB to spare: measure before relying on it")
    return [line, *unlike_the_record(a.cell, r)]


def worst_miss_over_headroom(a: Answer) -> float | None:
    """Where the verdict is "fits" but its record's worst under-prediction of peak reserved, repeated here,
    would take more than the card has to spare: that miss, GiB."""
    headroom, errors = a.predicted.get("headroom_gib"), a.record.reserved_errors if a.record else ()
    if a.verdict != "fits" or headroom is None or not errors or min(errors) >= 0:
        return None
    low = min(errors)
    miss_gib = float(a.predicted["peak_reserved_gib"]) * -low / (1 + low)  # measured = predicted / (1 + error)
    return miss_gib if miss_gib > headroom else None


def unlike_the_record(cell: Cell, r: predict_report.Record) -> list[str]:
    """A line for each way no cell of the record is like this one, so that the record says little of how
    it is predicted: another architecture (its config's model_type: other ops, a mixture of experts' grouped
    matmuls, another attention), another number of ranks (other collectives and buffers), a technique none of
    them used (its own ops: an optimizer's step, a kernel's wrapper)."""
    lines = []
    kinds = {models.get(name).hf_fields["model_type"] for name in r.models if name in models.registry()}
    mine = models.get(cell.model).hf_fields["model_type"]
    if kinds and mine not in kinds:
        lines.append(f"  none of those cells has this model's architecture (model_type {mine}; theirs: "
                     f"{', '.join(sorted(kinds))}): how predictions of it fare on a GPU is not measured yet")
    if r.gpus and cell.gpus not in r.gpus:
        lines.append(f"  none of those cells ran on {cell.gpus} GPUs (theirs: {', '.join(map(str, r.gpus))}): how "
                     "predictions at this many ranks fare is not measured yet")
    unmeasured = [name for name in cell.stack.names if name not in r.techniques]
    if r.techniques and unmeasured:
        lines.append(f"  none of those cells used {' or '.join(unmeasured)}: how predictions of "
                     f"{'its' if len(unmeasured) == 1 else 'their'} own ops fare on a GPU is not measured yet")
    return lines


def param_count(count: int) -> str:
    """A parameter count, aligned with the GiB figures above it."""
    return f"{count / 1e9:8.2f} B" if count >= 1e9 else f"{count / 1e6:8.1f} M"


def ranks(count: int) -> str:
    return f"{count} GPUs (per GPU)" if count > 1 else "1 GPU"


def not_predicted(p: dict[str, Any]) -> str:
    why = p.get("unsupported_reason") or p.get("skip_reason") or p.get("error") or ""
    return f"not predicted ({p['status']}): {str(why).strip().splitlines()[-1] if why else ''}"


def software(row: dict[str, Any]) -> str:
    return predict_report.software_label(row)


def _predicted_lines(a: Answer) -> list[str]:
    p = a.predicted
    op = f", {p['peak_op']}" if p.get("peak_op") else ""
    lines = [f"predicted on this CPU under {software(p)} ({p.get('prediction_method', predict_runner.METHOD)}, "
             f"{p['predict_s']:.1f} s): a prediction, not a measurement",
             f"  peak allocated  {p['peak_allocated_gib']:8.2f} GiB  in {p['peak_phase']}{op}",
             f"  peak reserved   {p['peak_reserved_gib']:8.2f} GiB  what the caching allocator holds"]
    if p.get("device_peak_gib") is not None:
        lines.append(f"  whole device    {p['device_peak_gib']:8.2f} GiB  + {a.card.outside_torch_gib:.2f} GiB outside "
                     f"torch (CUDA context), {_context_source(a.card)}")
    paged_gib = _paged_state_gib(p, a.card)
    if paged_gib:
        lines.append(f"  paged state     {paged_gib:8.2f} GiB  a paged optimizer's state in CUDA managed memory, counted as "
                     "resident on the card: bitsandbytes may page it out to host RAM to make room (slower steps, "
                     "not predicted)")
    if p.get("least_card_gib") is not None:
        lines.append(f"  smallest card   {p['least_card_gib']:8.2f} GiB  on which the step still runs: the allocator "
                     "releasing its cache and retrying (each a device synchronisation) where a segment does not fit"
                     f"{_under_a_fraction(a.cell)}")
    hybrid = str(p.get("prediction_method", "")).startswith("hybrid")
    if hybrid:  # no per-role breakdown: the model states are counted beside the fake run, not in it
        lines.append(f"  at the peak     DeepSpeed's model states as its engine makes them (its bucket "
                     f"{p.get('buckets_gib') or 0:.2f} GiB) + the fake run's other bytes, without its engine")
    else:
        at_peak = [(role, p.get(column)) for role, column in _AT_PEAK]
        lines.append("  at the peak     " + " · ".join(f"{role} {v or 0:.2f}" for role, v in at_peak) + " GiB")
    if p.get("trainable_params"):  # what the stack trains: LoRA on a mixture of experts adapts every expert
        lines.append(f"  trainable       {param_count(p['trainable_params'])} parameters, each with its gradient and "
                     "optimizer state")
    if p.get("step_tflop") is not None:
        lines.append(f"  compute         {p['step_tflop']:8.2f} TFLOP a step: the matmuls and attention the fake run "
                     "dispatched, recomputation included")
    lines += _compiled_lines(p)
    lines.append(_step_time_line(a))
    if p.get("host_peak_gib") is not None:
        held = "DeepSpeed's offloaded states (pinned and pageable)" if hybrid else "offload's pinned copies"
        lines.append(f"  host RAM        {predict_runner.host_needed_gib(p):8.2f} GiB  {held} and worker processes")
    return lines


def _compiled_lines(p: dict[str, Any]) -> list[str]:
    """For a stack with torch.compile: the graphs dynamo made in the fake run (the technique's evidence, as a GPU
    run records it), and what it saved for backward; where it made none, that it compiled nothing."""
    evidence = json.loads(p.get("evidence_json") or "{}")
    graphs = evidence.get("compile_graphs")
    if graphs is None:
        return []
    if graphs == 0:
        return ["  compiled        nothing: dynamo ran the layers eagerly under these releases (the fake run runs "
                "dynamo as a GPU run does), so the step is eager's"]
    saved = evidence.get("saved_for_backward_gib")
    return [f"  compiled        {graphs} graph{'s' if graphs > 1 else ''} (dynamo)"
            + (f", {saved:.2f} GiB saved for backward outside checkpointed layers" if saved is not None else "")]


def predicted_step_ms(a: Answer) -> float | None:
    """The step time predicted at the card's fitted rates (bench/predict/steptime.py), ms; None where not."""
    if a.predicted.get("status") != "ok":
        return None
    return steptime.predicted_ms(a.predicted, a.card.key, a.cell.stack, a.cell.gpus)


def tokens_per_s(a: Answer, step_ms: float) -> float:
    """The positions a step of this cell trains, over its time."""
    return steptime.tokens_per_s(a.cell.batch_size, a.cell.seq_len, step_ms)


def _step_time_line(a: Answer) -> str:
    """The predicted step time and tokens/s, or why there is none."""
    ms = predicted_step_ms(a)
    rates = steptime.RATES.get(a.card.key)
    if ms is None:
        why = (f"no {a.card.name} has measured steps to fit its rates on" if rates is None else
               steptime.row_unsupported_reason(a.predicted, a.cell.stack, a.cell.gpus, rates)
               or "the step's work was not counted")
        return f"  step time       not predicted: {why}"
    work = steptime.cell_work(a.predicted, a.cell.stack)
    assert rates is not None and work is not None  # else predicted_ms is None
    eight_bit = (f"; bitsandbytes' 8-bit optimizer step at its own rate a parameter, fitted on "
                 f"{rates.optimizer_8bit_cells} cells, each left out predicted {rates.optimizer_8bit_left_out}"
                 if work.optimizer_8bit_params else "")
    sides = f"device {steptime.device_ms(work, rates):.0f} ms, host {steptime.host_ms(work, rates):.0f}"
    return (f"  step time       {ms:8.0f} ms    {tokens_per_s(a, ms):,.0f} tokens/s, {steptime.bound(work, rates)}-bound "
            f"({sides}): the step's ops, kernels, FLOPs and bytes at this GPU kind's rates, fitted on {rates.cells} "
            f"measured cells; each left out of the fit was predicted {rates.left_out}{eight_bit} (results/PREDICTION.md, "
            "Step time)")


def _paged_state_gib(p: dict[str, Any], card: gpus.GpuKind) -> float:
    """CUDA managed memory in the prediction: the whole device's peak less peak reserved and what lives
    outside torch (bench/predict/fake.py adds it there); 0 where none or not known."""
    if p.get("device_peak_gib") is None or card.outside_torch_gib is None:
        return 0.0
    managed_gib = p["device_peak_gib"] - p["peak_reserved_gib"] - card.outside_torch_gib
    return managed_gib if managed_gib > 0.005 else 0.0  # float noise of the sum is not paged state


_AT_PEAK = (("weights", "at_peak_weights_gib"), ("gradients", "at_peak_gradients_gib"),
            ("optimizer state", "at_peak_optimizer_state_gib"), ("activations", "at_peak_activations_gib"),
            ("temporaries", "at_peak_temporaries_gib"), ("inputs", "at_peak_inputs_gib"),
            ("workspace", "at_peak_workspace_gib"))


def _under_a_fraction(cell: Cell) -> str:
    """The smallest card is bisected under a memory fraction, as `bench fit` emulates a budget; the garbage
    collection threshold acts only under one (bench/techniques/garbage_collection_threshold.py), so for
    its stacks the smallest card holds only where the training script sets a fraction too."""
    if "garbage_collection_threshold" not in cell.stack.names:
        return ""
    return (", and only under a memory fraction (torch.cuda.set_per_process_memory_fraction), without which "
            "the garbage collection threshold does nothing")


def _context_source(card: gpus.GpuKind) -> str:
    """Whether the memory outside torch is the kind's measured figure or the asker's (--outside-torch-gib)."""
    measured = gpus.GPUS.get(card.key)
    if measured is not None and measured.outside_torch_gib == card.outside_torch_gib:
        return "measured on this GPU kind"
    return "as given (--outside-torch-gib), not measured here"


def verdict_detail(a: Answer) -> str:
    p = a.predicted
    if a.verdict == "fits" and p.get("headroom_gib") is not None:
        return f", {p['headroom_gib']:.2f} GiB to spare on the card"
    if a.verdict == "does not fit" and p.get("least_card_gib") is not None:
        return f": the smallest card it runs on has {p['least_card_gib']:.2f} GiB{_under_a_fraction(a.cell)}"
    if a.verdict == "does not fit" and p.get("device_peak_gib") is not None:
        return f": the whole device would need {p['device_peak_gib']:.2f} GiB"
    if a.verdict == "does not fit" and p.get("least_torch_gib") is not None:
        return (f": torch alone needs {p['least_torch_gib']:.2f} GiB, its allocator releasing its cache and retrying, "
                "before the CUDA context")
    if a.verdict == "does not fit":
        return f": live tensors alone peak at {p['peak_allocated_gib']:.2f} GiB"
    if a.verdict == "host_oom":
        return (f": the host needs {predict_runner.host_needed_gib(p):.2f} GiB of RAM, more than its "
                f"{p['host_memory_gib']:g} GiB")
    if a.verdict == "not judged" and p.get("status") == "ok":
        if a.card.memory_gib is None:
            return " (this GPU kind's capacity is not measured: pass --gpu-memory-gib)"
        needed = p.get("least_torch_gib", p["peak_reserved_gib"])
        h100 = gpus.GPUS["h100"]
        return (f": it fits if the CUDA context and libraries take under {a.card.memory_gib - needed:.2f} GiB of the card, "
                f"not measured on this GPU kind ({h100.outside_torch_gib:.2f} GiB on an H100); torch needs "
                f"{needed:.2f} GiB" + (", its allocator releasing its cache and retrying" if "least_torch_gib" in p
                                       and needed < p["peak_reserved_gib"] else ""))
    return ""


def _measured_line(rows: list[dict[str, Any]]) -> str:
    """One run's rows of the cell (its repeats): the first's figures, and the spread of peak reserved."""
    row = rows[0]
    figures = ", ".join(f"{label} {row[column]:.2f} GiB" for label, column in (
        ("peak allocated", "peak_allocated_gib"), ("reserved", "peak_reserved_gib"), ("device (NVML)", "nvml_peak_gib"))
        if row.get(column) is not None)
    if row["status"] == "ok" and row.get("tokens_per_s") and row.get("step_ms_p50"):
        figures += f"; {row['tokens_per_s']:,.0f} tokens/s, step {row['step_ms_p50']:.0f} ms (median)"
    reserved = [r["peak_reserved_gib"] for r in rows if r.get("peak_reserved_gib") is not None]
    repeats = ""
    if len(rows) > 1 and reserved:
        repeats = f"; {len(rows)} repeats, reserved {min(reserved):.2f} to {max(reserved):.2f} GiB"
    why = row.get("skip_reason") or (row.get("error") if row["status"] != "ok" else None)
    why = f" ({str(why).strip().splitlines()[-1]})" if why else ""
    since_fixed = predict_report.MEASURED_UNDER_OLD_CODE.get((str(row.get("run_id")), str(row.get("cell_id"))))
    since_fixed = f"\n  under the suite's code as it was, since fixed: {since_fixed}" if since_fixed else ""
    return (f"measured: {row['status']}{why} on {row.get('gpu_name') or 'a GPU'}, run {row['run_id']} "
            f"({software(row)}){': ' + figures if figures else ''}{repeats}{since_fixed}")


# --- The question the other way round: the largest batch or sequence length that fits the card ---

# A verdict as the fit search reads a probe's status: what fits, what bounds the search, what stops it.
SEARCH_STATUS = {"fits": "ok", "does not fit": "oom", "host_oom": "host_oom"}


@dataclass(frozen=True)
class Largest:
    question: Question  # the settings held fixed (on the searched axis: the smallest candidate)
    axis: str  # batch | seq
    frontier: fit.Frontier
    answers: dict[int, Answer]  # size -> the answer predicted for it (every size probed)

    @property
    def verdict(self) -> str:
        """fits (some size does) | does not fit (not even the smallest) | not predicted (the search stopped)."""
        if self.frontier.stopped:
            return "not predicted"
        return "fits" if self.frontier.largest_ok is not None else "does not fit"


def largest(question: Question, axis: str, sizes: list[int], card: gpus.GpuKind, host_memory_gib: float | None,
            results_dir: Path, report: Callable[[str], None] = lambda line: None) -> Largest:
    """The largest of `sizes` (batch sizes, or sequence lengths) whose answer on the card is "fits";
    `report` gets a line as each size is answered."""
    answers: dict[int, Answer] = {}

    def asked(size: int) -> Question:
        return replace(question, batch_size=size) if axis == "batch" else replace(question, seq_len=size)

    def probe(size: int) -> str:
        answers[size] = answer(asked(size), card, host_memory_gib, results_dir)
        report(f"{axis} {size}: {answers[size].verdict}{verdict_detail(answers[size])}")
        return SEARCH_STATUS.get(answers[size].verdict) or str(answers[size].predicted.get("status"))

    def need_gib(size: int) -> float | None:
        return _need_gib(answers[size]) if size in answers else None

    assert card.memory_gib is not None, "a search needs the card's capacity"
    frontier = fit.search(sizes, probe, too_big=("oom", "host_oom"), needs=fit.Needs(need_gib, card.memory_gib))
    return Largest(question, axis, frontier, answers)


def _need_gib(a: Answer) -> float | None:
    """The card a size needs (its smallest card, else its device peak), where the device was judged."""
    return fit.predicted_need_gib(a.predicted) if a.verdict in ("fits", "does not fit") else None


def largest_text(found: Largest) -> str:
    q, f, first = found.question, found.frontier, next(iter(found.answers.values()))
    fixed = f"seq {q.seq_len}" if found.axis == "batch" else f"batch {q.batch_size}"
    lines = [f"{q.model}, {fixed}, stack {first.cell.stack.label}, {ranks(q.gpus)}: {first.card.name} "
             f"({first.card.memory_gib:.2f} GiB)"]
    if found.verdict == "not predicted":
        lines.append(f"the search stopped at {f.stopped.split(' at ')[-1]}: "
                     + not_predicted(found.answers[f.probes[-1]].predicted))
    else:
        beyond = (f"{found.axis} {f.smallest_oom} does not fit" if f.smallest_oom is not None
                  else "the largest searched")
        lines.append(f"largest {found.axis} that fits (predicted, not measured): {f.largest_ok or 'none'}, "
                     f"{beyond}")
    for size in sorted(x for x in (f.largest_ok, f.smallest_oom) if x is not None):
        p = found.answers[size].predicted
        figures = [f"{label} {p[column]:.2f} GiB" for label, column in (
            ("peak allocated", "peak_allocated_gib"), ("whole device", "device_peak_gib"),
            ("smallest card", "least_card_gib")) if p.get(column) is not None]
        ms = predicted_step_ms(found.answers[size])
        if ms is not None and size == f.largest_ok:  # what the answer costs: the one size that is trained at
            figures.append(f"{tokens_per_s(found.answers[size], ms):,.0f} tokens/s (step {ms:.0f} ms)")
        lines.append(f"  {found.axis} {size}: {found.answers[size].verdict}, " + ", ".join(figures))
    needs = {size: need for size, a in found.answers.items() if (need := _need_gib(a)) is not None}
    seen = fit.not_monotone_text({size: a.verdict == "fits" for size, a in found.answers.items()
                                  if a.verdict in SEARCH_STATUS}, needs)
    if seen:
        lines.append(f"  not monotone: {seen}; a size below the smallest that does not fit is the safer choice")
    seconds = sum(a.predicted.get("predict_s") or 0 for a in found.answers.values())
    lines.append(f"searched {len(f.probes)} size{'s' if len(f.probes) > 1 else ''} ({', '.join(map(str, f.probes))}): "
                 "fake runs on this CPU, "
                 f"{seconds / 60:.1f} min, under {software(first.predicted)}")
    return "\n".join(lines)


def largest_json(found: Largest) -> str:
    f = found.frontier
    return json.dumps({"axis": found.axis, "verdict": found.verdict, "largest_ok": f.largest_ok,
                       "smallest_not_fitting": f.smallest_oom, "stopped": f.stopped or None, "probes": list(f.probes),
                       "predicted": {str(size): _plain(a.predicted) for size, a in found.answers.items()}},
                      default=str, indent=1)


def as_json(a: Answer) -> str:
    return json.dumps({"cell_id": a.cell.cell_id, "verdict": a.verdict, "gpu": a.card.key,
                       "gpu_memory_gib": a.card.memory_gib, "outside_torch_gib": a.card.outside_torch_gib,
                       "predicted": _plain(a.predicted),
                       "measured": list(a.measured),
                       "record": None if a.record is None else {
                           "kind": a.record.kind, "reserved_errors": list(a.record.reserved_errors),
                           "reserved_errors_before_run": list(a.record.reserved_errors_before_run),
                           "models": list(a.record.models), "gpus": list(a.record.gpus)}},
                      default=str, indent=1)
