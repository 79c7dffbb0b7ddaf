"""The fit frontier: under a memory budget, the largest batch (and at batch 1, the longest sequence)
with which a stack still trains.

Search over a finite ascending list of candidate sizes (batches 1..max_batch; sequence lengths in
steps of seq_step up to max_seq), assuming that what fits at size s fits at every smaller size.
What is already known narrows the interval before any probe: earlier probes of the same search (a
resumed run), the result at a smaller budget (what fits there fits here) and at a larger one (what
OOMs there OOMs here). Measured searches bisect: at most ceil(log2(n + 1)) probes for n unknown
candidates. A guess (the predicted frontier, on a GPU) is probed first, with its neighbour: a right
guess settles a search in two probes.

A predicted search also knows what each probed size *needs* (GiB), whatever the budget: memory grows
nearly linearly with batch and sequence length, so it interpolates where the need crosses the budget
(regula falsi on the candidates), from every size already predicted, at this budget or another. Where
the line is right, the size it names and the next one settle the search. Two interpolation steps
that do not halve the interval (a need far from linear) are followed by a bisection step, so a
search costs at most three times bisection's bound. Where needs rise with the size it finds the
boundary bisection finds; where they do not (the allocator's fragmentation can make a larger cell
reserve less), any search's boundary is one of several, and the summary says what it saw
(`not_monotone`).

Probes: measured (MeasuredProbes: each a cell of its own, run by the runner in a fresh process,
recorded as a row) or predicted (PredictedProbes, `bench fit --predict`: each cell's fake run, once
whatever the budget). Both sides of the boundary (largest size that fit, smallest that did not) are rows.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import pandas as pd

from . import results, runner
from .cells import Cell, PlannedCell, make_cell, resolve_device, skip_reason
from .envinfo import OPTIONAL_PACKAGES, HostCaps
from .predict import runner as predict_runner
from .predict.runner import PredictOptions
from .spec import MatrixSpec
from .stacks import Stack


@dataclass(frozen=True)
class Frontier:
    largest_ok: int | None  # largest size that trained (None: not even the smallest)
    smallest_oom: int | None  # smallest size that ran out of memory (None: none did, up to the max)
    probes: tuple[int, ...]  # sizes this search ran, in order (known results are not re-run)
    stopped: str = ""  # why the search stopped early: a probe that neither fit nor OOMed


@dataclass(frozen=True)
class Needs:
    """What a size needs (GiB), where already known without a probe, against the budget searched: the
    search interpolates where the need crosses the budget."""

    of: Callable[[int], float | None]  # size -> GiB, or None where not known
    budget_gib: float


def search(sizes: Sequence[int], probe: Callable[[int], str], known_ok: int | None = None,
           known_oom: int | None = None, guess: int | None = None, too_big: tuple[str, ...] = ("oom",),
           needs: Needs | None = None) -> Frontier:
    """The boundary among `sizes` (ascending). probe(size) -> a cell status: "ok" fits, one of `too_big`
    ("oom"; a predicted "host_oom" too) does not; anything else (error, timeout, a measured host_oom,
    unsupported) stops the search and is reported.
    `guess` (e.g. the predicted largest size that fits) is probed first, then its neighbour across
    the boundary: a right guess settles the search in two probes, a wrong one still narrows it.
    `needs`: the next size is interpolated where known needs cross the budget, else bisected."""
    lo = max((i for i, s in enumerate(sizes) if known_ok is not None and s <= known_ok), default=-1)
    hi = min((i for i, s in enumerate(sizes) if known_oom is not None and s >= known_oom), default=len(sizes))
    first = max((i for i, s in enumerate(sizes) if s <= guess), default=-1) if guess is not None else None
    pending = [first, first + 1] if first is not None else []
    probes: list[int] = []
    widths: list[int] = []  # the interval's width before each interpolation step of the current run of them
    while hi - lo > 1:
        pending = [i for i in pending if lo < i < hi]
        bisect_next = len(widths) > 1 and 2 * (hi - lo) > widths[-2]  # two interpolations did not halve it
        widths = [] if bisect_next else widths
        interpolated = None if pending or bisect_next or needs is None else _interpolated(sizes, lo, hi, needs)
        mid = pending.pop(0) if pending else interpolated if interpolated is not None else (lo + hi) // 2
        probes.append(sizes[mid])
        status, width = probe(sizes[mid]), hi - lo
        if status == "ok":
            lo = mid
        elif status in too_big:
            hi = mid
            if mid == first:  # the guess was too large: the size below it next
                pending = [mid - 1]
        else:
            return Frontier(_at(sizes, lo), _at(sizes, hi), tuple(probes), f"{status} at {sizes[mid]}")
        widths = [*widths, width] if interpolated is not None else []
    return Frontier(_at(sizes, lo), _at(sizes, hi), tuple(probes))


def _interpolated(sizes: Sequence[int], lo: int, hi: int, needs: Needs) -> int | None:
    """The index, strictly inside (lo, hi), of the largest size whose need the straight line through two
    known needs puts within the budget: the last known within it and the first beyond it, else the two
    nearest the boundary on one side. None where fewer than two needs are known or they do not rise."""
    known = [(s, n) for s in sizes if (n := needs.of(s)) is not None]
    within = [p for p in known if p[1] <= needs.budget_gib]
    beyond = [p for p in known if p[1] > needs.budget_gib]
    line = (within[-1:] + beyond[:1] if within and beyond else within[-2:] if len(within) > 1 else beyond[:2])
    if len(line) < 2 or line[1][0] <= line[0][0] or line[1][1] <= line[0][1]:
        return None
    (s0, n0), (s1, n1) = line
    crossing = s0 + (needs.budget_gib - n0) * (s1 - s0) / (n1 - n0)
    index = max((i for i, s in enumerate(sizes) if s <= crossing), default=lo)
    return min(max(index, lo + 1), hi - 1)


def _at(sizes: Sequence[int], index: int) -> int | None:
    return sizes[index] if 0 <= index < len(sizes) else None


def max_probes(n_unknown: int) -> int:
    """The most probes a bisection over n unknown candidates runs: ceil(log2(n + 1)). An interpolating
    search (needs given) runs at most three times that."""
    return max(n_unknown, 0).bit_length()


# --- Running searches: each probe a cell, measured (a fresh process through the runner) or predicted ---

@dataclass(frozen=True)
class FitPlan:
    budgets_gib: tuple[float, ...]
    max_batch: int = 64
    seq_step: int = 1024  # sequence-length candidates at batch 1: seq_step, 2 * seq_step, ...
    max_seq: int = 32768


class Probes(Protocol):
    """How a probe cell is tried. `rows` holds the row of every cell tried (a resumed run's too)."""

    rows: dict[str, dict[str, Any]]
    too_big: tuple[str, ...]  # statuses that bound a search as an OOM does (search's too_big)

    def run(self, cell: Cell) -> None:
        """Makes the cell's row in `rows` (a run now, unless its run is already known)."""
        ...

    def run_key(self, cell: Cell) -> str:
        """Probes of cells with one key are one run (a prediction serves every budget; a measurement, one)."""
        ...

    def need_gib(self, cell: Cell) -> float | None:
        """What the cell needs, whatever its budget, if known without a run (None: the search bisects)."""
        ...

    def fits(self, cell: Cell) -> bool | None:
        """Whether the cell runs within its budget, if known without a run (None: not known)."""
        ...


@dataclass
class MeasuredProbes:
    """Each probe a real cell: a fresh process through the runner, into `opts.run_id`."""

    matrix: MatrixSpec
    host: HostCaps
    opts: runner.RunOptions
    provenance: dict[str, Any]
    progress: runner.Progress
    # A measured host_oom (a process killed by the kernel) stops the search: it is costly, and what it
    # needed is not known
    too_big: tuple[str, ...] = ("oom",)

    def __post_init__(self) -> None:
        self.rows = results.read_raw(self.opts.results_dir / "raw" / self.opts.run_id)  # a resumed run's probes

    def run(self, cell: Cell) -> None:
        reason = skip_reason(cell, self.matrix, self.host)
        self.rows.update(runner.run([PlannedCell(cell, reason)], self.opts, self.provenance, self.progress))

    def run_key(self, cell: Cell) -> str:
        return cell.row_key  # a run under this budget's cap

    def need_gib(self, cell: Cell) -> float | None:
        return None  # a measured peak depends on the budget's cap, and an OOM's is not known: bisect

    def fits(self, cell: Cell) -> bool | None:
        return None  # only a run under this budget's cap says


def predicted_need_gib(row: dict[str, Any]) -> float:
    """The card a predicted cell needs, as a measured probe meets its budget (the allocator capped there,
    releasing its cache and retrying before it fails): the least card its trace runs on (a ZeRO hybrid's
    too, from hybrid/6); where that is not predicted (an older row), the device peak (reserved + the
    context). Where the GPU kind's context is not measured, what torch alone needs (least_torch_gib, else
    peak allocated): a lower bound, the card's context not in it."""
    for column in ("least_card_gib", "device_peak_gib", "least_torch_gib"):
        value = row.get(column)
        if value is not None and not pd.isna(value):
            return float(value)
    return float(row["peak_allocated_gib"])


def runs_within(row: dict[str, Any], budget_gib: float | None) -> bool:
    """Whether a predicted cell runs within the budget: the replay within it, where the prediction made one
    (fits_budgets_json: the allocator can run within a budget and not within a larger one, Llama-3.2-3B
    gc + offload(params=True) + zero3 at seq 2048, batch 16, within 59-62 GiB but not 63-68), else
    whether the least card it runs on is within it."""
    if budget_gib is None:
        return True
    replayed = json.loads(row.get("fits_budgets_json") or "{}").get(f"{budget_gib:g}")
    return bool(replayed) if replayed is not None else predicted_need_gib(row) <= budget_gib


@dataclass
class PredictedProbes:
    """Each probe a prediction (bench predict's fake run, one per cell whatever the budget): a cell
    "fits" a budget when it needs no more (predicted_need_gib). The caller holds the run's lock
    (results.run_lock); with a `pool`, fake runs go to its processes, so searches run side by side."""

    matrix: MatrixSpec
    opts: PredictOptions
    provenance: dict[str, Any]
    report: Callable[[Cell, dict[str, Any]], None]
    pool: Executor | None = None
    # A predicted host_oom costs nothing and grows with the cell like an OOM: the search bisects on it
    too_big: tuple[str, ...] = ("oom", "host_oom")

    def __post_init__(self) -> None:
        self.raw_dir = self.opts.results_dir / "raw" / self.opts.run_id
        self.predicted = results.read_raw(self.raw_dir, results.PREDICTED)
        self.rows: dict[str, dict[str, Any]] = {}
        self.host = HostCaps(cuda_devices=1, packages=frozenset(OPTIONAL_PACKAGES))  # as a GPU host plans
        self.probed: set[str] = set()  # the cells this process's searches probed: all they may know (`_known`)

    def run(self, cell: Cell) -> None:
        plain = dataclasses.replace(cell, budget_gib=None)
        self.probed.add(plain.cell_id)
        if plain.cell_id not in self.predicted:
            planned = PlannedCell(plain, skip_reason(plain, self.matrix, self.host))
            found = predict_runner.predicted_in(self.pool, planned, self.opts.card)
            self.predicted[plain.cell_id] = predict_runner.record(plain, found, self.opts, self.provenance,
                                                                  self.raw_dir, self.report)
        found = self.predicted[plain.cell_id]
        status = found["status"]
        if status == "ok" and self._host_runs_out(found):
            status = "host_oom"  # --host-memory-gib: the host runs out, whatever the GPU's budget
        elif status == "ok":
            status = "ok" if runs_within(found, cell.budget_gib) else "oom"
        self.rows[cell.row_key] = found | {"status": status, "budget_gib": cell.budget_gib}

    def run_key(self, cell: Cell) -> str:
        return dataclasses.replace(cell, budget_gib=None).cell_id  # one fake run, whatever the budget

    def need_gib(self, cell: Cell) -> float | None:
        """The card the cell needs, where a search probed it and the host holds it (else None)."""
        found = self._known(cell)
        return None if found is None else predicted_need_gib(found)

    def fits(self, cell: Cell) -> bool | None:
        """As a probe of the cell would say (`run`), where a search probed it and the host holds it."""
        found = self._known(cell)
        return None if found is None else runs_within(found, cell.budget_gib)

    def _known(self, cell: Cell) -> dict[str, Any] | None:
        """The cell's prediction where a search of this process probed it, it ran and the host holds it. Not
        one a resumed run finds on disk before a search asks for it: that spares its fake run, not its probe,
        so a resumed search goes (its probes, its frontier) as one never stopped."""
        key = self.run_key(cell)
        found = self.predicted.get(key) if key in self.probed else None
        if found is None or found["status"] != "ok" or self._host_runs_out(found):
            return None
        return found

    def _host_runs_out(self, found: dict[str, Any]) -> bool:
        host_gib, limit_gib = predict_runner.host_needed_gib(found), self.opts.host_memory_gib
        return host_gib is not None and limit_gib is not None and host_gib > limit_gib


Hints = dict[tuple[str, str, str, int, float], int]  # (model, stack, axis, fixed size, budget) -> a guessed largest_ok


@dataclass
class FrontierRun:
    """The searches of one `bench fit` run, each probe tried by `probes`; `hints` (a predicted
    frontier) start each bisection at the predicted boundary."""

    matrix: MatrixSpec
    host: HostCaps
    plan: FitPlan
    probes: Probes
    hints: Hints = dataclasses.field(default_factory=dict)

    @property
    def rows(self) -> dict[str, dict[str, Any]]:
        return self.probes.rows

    def all(self, jobs: int = 1) -> list[dict[str, Any]]:
        """Per model x stack: the batch frontier at each of the matrix's sequence lengths, then the
        sequence frontier at batch 1, each over the budgets. One summary row per search. With jobs > 1,
        that many model x stack searches at once (their probes must be able to run side by side)."""
        pairs = [(model, stack) for model in self.matrix.models for stack in self.matrix.stacks]
        with ThreadPoolExecutor(max_workers=jobs) as threads:
            return [row for rows in threads.map(lambda pair: self.of_stack(*pair), pairs) for row in rows]

    def of_stack(self, model: str, stack: Stack) -> list[dict[str, Any]]:
        """The stack's searches in a fixed order; `ran` holds the runs (Probes.run_key) they took, so each search
        counts as run the probes no search before it took (`probes_run`), however many times the run resumed."""
        out: list[dict[str, Any]] = []
        ran: set[str] = set()
        for seq in self.matrix.seq_lens:
            out += self.over_budgets(model, stack, "batch", seq, ran)
        return out + self.over_budgets(model, stack, "seq", 1, ran)

    def over_budgets(self, model: str, stack: Stack, axis: str, fixed: int, ran: set[str]) -> list[dict[str, Any]]:
        plan = self.plan
        sizes = (list(range(1, plan.max_batch + 1)) if axis == "batch"
                 else list(range(plan.seq_step, plan.max_seq + 1, plan.seq_step)))
        out, known_ok = [], None
        for budget in sorted(plan.budgets_gib):  # what fits under a smaller budget fits under this one
            def cell_for(size: int, budget: float = budget) -> Cell:
                seq, batch = (fixed, size) if axis == "batch" else (size, fixed)
                device = resolve_device(self.matrix, self.host)
                return make_cell(self.matrix, device, model, seq, batch, stack, budget_gib=budget)

            def probe(size: int, cell_for: Callable[[int], Cell] = cell_for) -> str:
                return self.probe(cell_for(size))

            def need_gib(size: int, cell_for: Callable[[int], Cell] = cell_for) -> float | None:
                return self.probes.need_gib(cell_for(size))

            guess = self.hints.get((model, stack.label, axis, fixed, budget))
            needs = Needs(need_gib, budget)
            found = search(sizes, probe, known_ok=known_ok, guess=guess, too_big=self.probes.too_big, needs=needs)
            known_ok = found.largest_ok
            runs = {self.probes.run_key(cell_for(size)) for size in found.probes}
            out.append(self.summary(model, stack, budget, axis, fixed, found, sizes, len(runs - ran), cell_for))
            ran |= runs
        return out

    def measured(self, cell_for: Callable[..., Cell], size: int, budget: float) -> tuple[dict[str, Any], float | None]:
        """The row of `size` under this budget, or, when the size was known to fit from a smaller
        budget and not probed here, under the largest smaller budget that ran it."""
        for b in sorted((x for x in self.plan.budgets_gib if x <= budget), reverse=True):
            row = self.rows.get(cell_for(size, b).row_key)
            if row is not None:
                return row, b
        return {}, None

    def not_monotone(self, sizes: list[int], budget: float, cell_for: Callable[[int], Cell]) -> str:
        """Sizes seen not to fit below one seen to fit, under this budget: every size predicted (at any
        budget), as a probe of it would say, and every probe measured at this one. What each needs is shown
        where it says the same (a prediction's replay within the budget can say otherwise: `runs_within`)."""
        fits, needs = {}, {}
        for size in sizes:
            cell = cell_for(size)
            known, need = self.probes.fits(cell), self.probes.need_gib(cell)
            status = self.rows.get(cell.row_key, {}).get("status")
            if known is not None:
                fits[size] = known
            elif status == "ok" or status in self.probes.too_big:
                fits[size] = status == "ok"
            if need is not None and fits.get(size) == (need <= budget):
                needs[size] = need
        return not_monotone_text(fits, needs)

    def probe(self, cell: Cell) -> str:
        if cell.row_key not in self.rows:  # a resumed search re-uses what it has
            self.probes.run(cell)
        return self.rows[cell.row_key]["status"]

    def summary(self, model: str, stack: Stack, budget: float, axis: str, fixed: int, found: Frontier,
                sizes: list[int], probes_run: int, cell_for: Callable[[int], Cell]) -> dict[str, Any]:
        best, measured_under = self.measured(cell_for, found.largest_ok, budget) if found.largest_ok else ({}, None)
        return {
            "model": model, "stack": stack.label, "budget_gib": budget, "axis": axis,
            "seq_len": fixed if axis == "batch" else found.largest_ok,
            "batch_size": found.largest_ok if axis == "batch" else fixed,
            "largest_ok": found.largest_ok, "smallest_oom": found.smallest_oom, "candidates_max": sizes[-1],
            "candidates_step": sizes[1] - sizes[0] if len(sizes) > 1 else None,  # --seq-step on the seq axis
            "smallest_oom_status": (self.rows.get(cell_for(found.smallest_oom).row_key, {}).get("status")
                                    if found.smallest_oom else None),  # oom, or host_oom: the host's RAM
            "probes": len(found.probes), "probes_run": probes_run, "stopped": found.stopped,
            "probe_wall_s": sum(self.rows[cell_for(s).row_key].get("wall_s") or 0 for s in found.probes),
            "measured_under_gib": measured_under,  # budget of the row the figures below come from
            "not_monotone": self.not_monotone(sizes, budget, cell_for),
            **{k: best.get(k) for k in ("tokens_per_s", "peak_allocated_gib", "peak_reserved_gib", "nvml_peak_gib",
                                        "allocator_cap_gib", "device_peak_gib", "least_card_gib",
                                        "least_torch_gib", "step_ms")},  # step_ms: a prediction's
        }


def not_monotone_text(fits: dict[int, bool], needs: dict[int, float]) -> str:
    """Where a size known not to fit lies below one known to fit ("" where none does): the search
    assumes the opposite, so its boundary is one of several."""
    largest_ok = max((s for s, ok in fits.items() if ok), default=0)
    below = sorted(s for s, ok in fits.items() if not ok and s < largest_ok)

    def said(size: int) -> str:
        return f"{size} ({needs[size]:.2f} GiB)" if size in needs else str(size)

    return f"{', '.join(map(said, below))} not fitting, below {said(largest_ok)} fitting" if below else ""
