"""Cells: one (model, sequence length, batch size, stack, GPU count) of a matrix, with a stable id.

A plan is every cell of a matrix in run order, each either runnable or skipped with the reason.
Run order groups (model, seq_len, stack) and walks batch sizes upwards, so that an OOM at batch b
can prune the larger batches of its group.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from . import models
from .envinfo import HostCaps
from .results import row_key
from .spec import MatrixSpec, SpecError
from .stacks import Stack, Use

CELL_SCHEMA = 1  # bump when the meaning of a cell's fields changes: every cell id changes with it


@dataclass(frozen=True)
class Cell:
    matrix: str
    model: str
    seq_len: int
    batch_size: int
    stack: Stack
    device: str  # cpu | cuda (resolved)
    warmup_steps: int
    measure_steps: int
    seed: int
    timeout_s: float
    repeat: int = 0  # k-th run of the same cell in a fresh process; not part of cell_id
    budget_gib: float | None = None  # emulated memory budget (bench fit); None: the whole card
    checkpoint: str = "none"  # none | model | full: a measured checkpoint save after the last step
    gpus: int = 1  # ranks (one process and one GPU each); batch_size is per rank

    @property
    def group(self) -> Group:
        """Cells that differ only in batch size: the unit of OOM pruning."""
        return (self.model, self.seq_len, self.stack.label, self.budget_gib, self.gpus)

    @property
    def cell_id(self) -> str:
        """Readable and stable: the same settings give the same id on any machine, any day."""
        key = {
            "schema": CELL_SCHEMA,
            "model": models.get(self.model).config_json,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "stack": [[u.name, [[k, v] for k, v in u.options if not _added_at_default(u, k, v)]] for u in self.stack.uses],
            "device": self.device,
            "steps": [self.warmup_steps, self.measure_steps],
            "seed": self.seed,
        }
        budget = ""
        if self.budget_gib is not None:  # only then: ids of cells without a budget stay as published
            key["budget_gib"] = self.budget_gib
            budget = f"_m{self.budget_gib:g}g"
        if self.checkpoint != "none":  # likewise
            key["checkpoint"] = self.checkpoint
        gpus = ""
        if self.gpus != 1:  # likewise
            key["gpus"] = self.gpus
            gpus = f"_g{self.gpus}"
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
        stack_slug = re.sub(r"[^A-Za-z0-9+._-]+", "-", self.stack.label.replace(" ", "")).strip("-")
        return f"{self.model}_s{self.seq_len}_b{self.batch_size}{gpus}_{stack_slug}{budget}_{digest}"

    @property
    def row_key(self) -> str:
        """Names the row (and its raw file): the cell id, with `.rK` for repeats after the first."""
        return row_key(self.cell_id, self.repeat)

    def to_json(self) -> dict[str, Any]:
        """Every field, plus the cell id and the stack's label; `from_json` reads it back."""
        return {
            "cell_id": self.cell_id,
            "repeat": self.repeat,
            "matrix": self.matrix,
            "model": self.model,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "stack": self.stack.label,
            "stack_uses": [[u.name, dict(u.options)] for u in self.stack.uses],
            "device": self.device,
            "warmup_steps": self.warmup_steps,
            "measure_steps": self.measure_steps,
            "seed": self.seed,
            "timeout_s": self.timeout_s,
            "budget_gib": self.budget_gib,
            "checkpoint": self.checkpoint,
            "gpus": self.gpus,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Cell:
        """The cell `to_json` wrote (the runner -> worker handoff), options exactly as resolved."""
        stack = Stack(tuple(Use(name, tuple(sorted(opts.items()))) for name, opts in data["stack_uses"]))
        fields = {k: data[k] for k in ("matrix", "model", "seq_len", "batch_size", "device", "warmup_steps",
                                       "measure_steps", "seed", "timeout_s", "repeat", "budget_gib", "checkpoint", "gpus")}
        cell = cls(stack=stack, **fields)
        if cell.cell_id != data["cell_id"]:
            raise ValueError(f"cell {data['cell_id']} read back as {cell.cell_id}: the handoff lost a setting")
        return cell


Group = tuple[str, int, str, float | None, int]  # (model, seq_len, stack label, budget_gib, gpus): Cell.group


@dataclass(frozen=True)
class PlannedCell:
    cell: Cell
    skip_reason: str | None  # None: it will run


def resolve_device(matrix: MatrixSpec, host: HostCaps) -> str:
    if matrix.device == "auto":
        return "cuda" if host.cuda_devices > 0 else "cpu"
    return matrix.device


def make_cell(matrix: MatrixSpec, device: str, model: str, seq_len: int, batch_size: int, stack: Stack,
              gpus: int = 1, repeat: int = 0, budget_gib: float | None = None) -> Cell:
    """A cell of this matrix: the matrix's steps, seed, timeout and checkpoint, the given coordinates."""
    return Cell(matrix=matrix.name, model=model, seq_len=seq_len, batch_size=batch_size, stack=stack, device=device,
                warmup_steps=matrix.warmup_steps, measure_steps=matrix.measure_steps, seed=matrix.seed,
                timeout_s=matrix.timeout_s, repeat=repeat, budget_gib=budget_gib, checkpoint=matrix.checkpoint,
                gpus=gpus)


def expand(matrix: MatrixSpec, host: HostCaps, repeats: int | None = None) -> list[Cell]:
    """Every cell in run order; with repeats, each cell's repeats run back to back."""
    device = resolve_device(matrix, host)
    cells = [
        make_cell(matrix, device, model, seq, batch, stack, gpus=gpus, repeat=repeat)
        for model in matrix.models
        for gpus in matrix.gpus
        for seq in matrix.seq_lens
        for stack in matrix.stacks
        for batch in sorted(matrix.batch_sizes)
        for repeat in range(repeats or matrix.repeats)
    ]
    ids = [c.row_key for c in cells]
    duplicated = {i for i in ids if ids.count(i) > 1}
    if duplicated:  # e.g. "gc+lora" and "lora + gc" listed twice
        raise SpecError(f"matrix {matrix.name}: the same cell is listed twice: {sorted(duplicated)[0]}")
    return cells


def matching(planned: list[PlannedCell], only: str | None, matrix: str) -> list[PlannedCell]:
    """The planned cells whose id matches one of the comma-separated globs (all if None); globs that
    match nothing are bad input."""
    if not only:
        return planned
    found = [pc for pc in planned if any(fnmatch.fnmatch(pc.cell.cell_id, g) for g in only.split(","))]
    if not found:
        raise SpecError(f"--only {only!r} matches no cell of matrix {matrix!r} (`python -m bench list {matrix}`)")
    return found


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (1-based, "3/8"): one host's part of a matrix, so that a scheduler's
    job array (Slurm or any other) fills the matrix in parallel, each shard under its own run id,
    and `bench report --run-id 'RUN-shard*' --into RUN` merges them by cell id."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        found = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not found or not 1 <= int(found.group(1)) <= int(found.group(2)):
            raise SpecError(f"--shard {text!r}: give I/N with 1 <= I <= N, e.g. 3/8")
        return cls(int(found.group(1)), int(found.group(2)))

    @property
    def label(self) -> str:
        return f"shard{self.index}of{self.count}"

    def select(self, planned: list[PlannedCell]) -> list[PlannedCell]:
        """This shard's cells. A cell's group (the cells that differ only in batch size, and their
        repeats) stays whole, so an OOM still prunes the group's larger batches; groups are dealt
        round the shards in the order of a hash of each, so each shard gets as many groups (±1) and a
        mix of models, lengths and stacks. Every shard of a run must plan from the same matrix."""
        groups = sorted({pc.cell.group for pc in planned}, key=_group_digest)
        mine = {g for i, g in enumerate(groups) if i % self.count == self.index - 1}
        return [pc for pc in planned if pc.cell.group in mine]


def _group_digest(group: Group) -> str:
    return hashlib.sha1(json.dumps([str(v) for v in group]).encode()).hexdigest()


def _added_at_default(use: Use, key: str, value: Any) -> bool:
    """An option added after the technique's cells were published, at its default: not in the cell id."""
    return key in use.technique.added_options and value == use.technique.options[key]


def plan(matrix: MatrixSpec, host: HostCaps, repeats: int | None = None) -> list[PlannedCell]:
    return [PlannedCell(c, skip_reason(c, matrix, host)) for c in expand(matrix, host, repeats)]


def skip_reason(cell: Cell, matrix: MatrixSpec, host: HostCaps) -> str | None:
    """Why this cell cannot run here, or None. Checked before anything runs."""
    for i, rule in enumerate(matrix.exclude):
        values = {"model": cell.model, "seq_len": cell.seq_len, "batch_size": cell.batch_size,
                  "stack": cell.stack.label, "gpus": cell.gpus}
        if all(values[k] == v for k, v in rule):
            return f"excluded by {matrix.name}.exclude[{i}]"
    if cell.device == "cuda" and host.cuda_devices == 0:
        return "needs a CUDA GPU: none is visible on this machine"
    if cell.device == "cuda" and cell.gpus > host.cuda_devices:
        return f"needs {cell.gpus} GPUs: {host.cuda_devices} visible on this machine"
    if cell.gpus > 1 and not any(u.technique.slot == "engine" for u in cell.stack.uses):
        return f"{cell.gpus} GPUs need a multi-GPU engine in the stack (ddp, fsdp, zero2, zero3)"
    family = models.get(cell.model).family
    attention = models.attention_problem(cell.model, cell.stack.setup.attn_implementation)
    if attention:
        return attention
    for use in cell.stack.uses:
        t = use.technique
        if t.families and family not in t.families:
            return f"{t.name} supports the {', '.join(t.families)} families, not {family} ({cell.model})"
        problem = t.check_cell(cell, use.opts) if t.check_cell else None
        if problem:
            return f"{use.label}: {problem}"
        if t.requires_cuda and cell.device != "cuda":
            return f"{t.name} needs CUDA (this cell runs on {cell.device})"
        missing = [p for p in t.packages if p not in host.packages]
        if missing:
            return f"{t.name} needs the {', '.join(missing)} package (not installed)"
    return None
