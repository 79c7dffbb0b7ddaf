"""Strict loading of matrix.yaml: every unknown key or bad value is an error naming its key path.

    defaults: {...}            # keys merged under every matrix
    matrices:
      NAME:
        description: str
        device: auto | cpu | cuda   (auto: cuda when a GPU is visible, else cpu)
        models: [registry names]
        seq_lens: [int]
        batch_sizes: [int]         # per GPU (micro-batch of each rank)
        gpus: [int]                # GPUs per cell (default [1]); more than one runs under torchrun,
                                   # one process per rank (on a CPU-only host: gloo processes)
        stacks: ["baseline", "gc + lora(r=8)", ...]
        steps: {warmup: int, measure: int}
        timeout_s: number          # per cell, the whole process (build included)
        seed: int
        repeats: int               # runs of each cell, each in a fresh process (the spread is reported)
        prune_after_oom: bool      # after an OOM at batch b, skip larger batches of that model/seq/stack
        exclude: [{model: .., seq_len: .., batch_size: .., stack: ..}]   # any subset of these keys
        checkpoint: none | model | full   # after the last step, save the model (model) or model +
                                          # optimizer state (full) and measure that phase
        ladder: [baseline, gc, gc + liger, ...]   # stacks of this matrix, each adding to the one before:
                                                  # the leaderboard's cumulative ladder table
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import models
from .stacks import Stack, StackError, parse_stack

DEVICES = ("auto", "cpu", "cuda")
CHECKPOINTS = ("none", "model", "full")
_TOP_KEYS = {"defaults", "matrices"}
_MATRIX_KEYS = {
    "description", "device", "models", "seq_lens", "batch_sizes", "stacks", "steps",
    "timeout_s", "seed", "repeats", "prune_after_oom", "exclude", "ladder", "checkpoint", "gpus",
}
_REQUIRED = ("models", "seq_lens", "batch_sizes", "stacks")
_EXCLUDE_KEYS = {"model", "seq_len", "batch_size", "stack", "gpus"}


class SpecError(ValueError):
    pass


# Names that become file and directory names (matrices, run ids): no path separators, no leading dot.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def safe_name(name: str, what: str) -> str:
    """`name` if it is safe as one path component, else a SpecError naming it."""
    if not SAFE_NAME.match(name) or ".." in name:
        raise SpecError(f"{what} {name!r}: use letters, digits, '.', '_' and '-' (no '/', no leading '.', no '..')")
    return name


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML would keep the last)."""


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


@dataclass(frozen=True)
class MatrixSpec:
    name: str
    description: str
    device: str
    models: tuple[str, ...]
    seq_lens: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    stacks: tuple[Stack, ...]
    warmup_steps: int
    measure_steps: int
    timeout_s: float
    seed: int
    prune_after_oom: bool
    exclude: tuple[tuple[tuple[str, Any], ...], ...]  # each rule: sorted (key, value) pairs
    ladder: tuple[str, ...] = ()  # stack labels, each rung adding techniques to the one before
    repeats: int = 1
    checkpoint: str = "none"  # none | model | full: measure a checkpoint save after the last step
    gpus: tuple[int, ...] = (1,)  # processes (ranks) per cell, one GPU each


def load(path: str | Path) -> dict[str, MatrixSpec]:
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # a SafeLoader: builds plain data only
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}") from None
    where = path.name
    _mapping(raw, where)
    _no_unknown_keys(raw, _TOP_KEYS, where)
    defaults = raw.get("defaults") or {}
    _mapping(defaults, f"{where}: defaults")
    _no_unknown_keys(defaults, _MATRIX_KEYS, f"{where}: defaults")
    matrices = raw.get("matrices")
    _mapping(matrices, f"{where}: matrices")
    return {
        str(name): _matrix(safe_name(str(name), f"{where}: matrix"), {**defaults, **(body or {})}, f"{where}: matrices.{name}")
        for name, body in matrices.items()
    }


def get(path: str | Path, name: str) -> MatrixSpec:
    matrices = load(path)
    if name not in matrices:
        hint = difflib.get_close_matches(name, list(matrices), n=1)
        dym = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise SpecError(f"unknown matrix {name!r}{dym}; {path} defines: {', '.join(matrices)}")
    return matrices[name]


def from_mapping(name: str, body: dict[str, Any]) -> MatrixSpec:
    """A matrix not in matrix.yaml (e.g. `bench ask`'s one cell), checked as a matrix.yaml entry is."""
    return _matrix(safe_name(name, "matrix"), body, name)


def _matrix(name: str, body: dict[str, Any], where: str) -> MatrixSpec:
    _mapping(body, where)
    _no_unknown_keys(body, _MATRIX_KEYS, where)
    for key in _REQUIRED:
        if key not in body:
            raise SpecError(f"{where}: missing required key {key!r}")
    device = body.get("device", "auto")
    if device not in DEVICES:
        raise SpecError(f"{where}.device: {device!r} is not one of {', '.join(DEVICES)}")
    steps = body.get("steps", {})
    _mapping(steps, f"{where}.steps")
    _no_unknown_keys(steps, {"warmup", "measure"}, f"{where}.steps")
    stacks = tuple(_stack(s, f"{where}.stacks[{i}]") for i, s in enumerate(_list(body, "stacks", where)))
    spec = MatrixSpec(
        name=name,
        description=str(body.get("description", "")),
        device=device,
        models=tuple(_model(m, f"{where}.models[{i}]") for i, m in enumerate(_list(body, "models", where))),
        seq_lens=_positive_ints(body, "seq_lens", where),
        batch_sizes=_positive_ints(body, "batch_sizes", where),
        stacks=stacks,
        warmup_steps=_int(steps.get("warmup", 3), f"{where}.steps.warmup", minimum=1),
        measure_steps=_int(steps.get("measure", 10), f"{where}.steps.measure", minimum=1),
        timeout_s=_number(body.get("timeout_s", 900), f"{where}.timeout_s"),
        seed=_int(body.get("seed", 0), f"{where}.seed", minimum=0),
        prune_after_oom=_bool(body.get("prune_after_oom", True), f"{where}.prune_after_oom"),
        exclude=tuple(_exclude_rule(r, f"{where}.exclude[{i}]") for i, r in enumerate(_optional_list(body, "exclude", where))),
        ladder=_ladder(body.get("ladder") or [], stacks, f"{where}.ladder"),
        repeats=_int(body.get("repeats", 1), f"{where}.repeats", minimum=1),
        checkpoint=_choice(body.get("checkpoint", "none"), CHECKPOINTS, f"{where}.checkpoint"),
        gpus=_positive_ints(body, "gpus", where) if "gpus" in body else (1,),
    )
    for i, rule in enumerate(spec.exclude):
        _excludes_something(spec, dict(rule), f"{where}.exclude[{i}]")
    return spec


def _excludes_something(spec: MatrixSpec, rule: dict[str, Any], where: str) -> None:
    """An exclude rule must name values the matrix has: a typo would silently exclude nothing."""
    axes = {"model": spec.models, "seq_len": spec.seq_lens, "batch_size": spec.batch_sizes,
            "stack": tuple(s.label for s in spec.stacks), "gpus": spec.gpus}
    for key, value in rule.items():
        if value not in axes[key]:
            raise SpecError(f"{where}.{key}: {value!r} is not one of this matrix's {key} values "
                            f"({', '.join(map(str, axes[key]))}): the rule would exclude nothing")


def _ladder(rungs: Any, stacks: tuple[Stack, ...], where: str) -> tuple[str, ...]:
    if not isinstance(rungs, list):
        raise SpecError(f"{where}: expected a list of stacks")
    parsed = [_stack(r, f"{where}[{i}]") for i, r in enumerate(rungs)]
    known = {s.label for s in stacks}
    for i, rung in enumerate(parsed):
        if rung.label not in known:
            raise SpecError(f"{where}[{i}]: {rung.label!r} is not one of this matrix's stacks")
        if i and not set(parsed[i - 1].uses) < set(rung.uses):
            raise SpecError(f"{where}[{i}]: {rung.label!r} does not add to the rung before it ({parsed[i - 1].label!r})")
    return tuple(r.label for r in parsed)


def _choice(value: Any, allowed: tuple[str, ...], where: str) -> str:
    if value not in allowed:
        raise SpecError(f"{where}: {value!r} is not one of {', '.join(allowed)}")
    return value


def _model(name: Any, where: str) -> str:
    try:
        models.get(str(name))
    except KeyError as err:
        raise SpecError(f"{where}: {err.args[0]}") from None
    return str(name)


def _stack(text: Any, where: str) -> Stack:
    if not isinstance(text, str):
        raise SpecError(f"{where}: a stack is a string like 'gc + lora(r=16)', got {text!r}")
    try:
        return parse_stack(text)
    except StackError as err:
        raise SpecError(f"{where}: {err}") from None


def _exclude_rule(rule: Any, where: str) -> tuple[tuple[str, Any], ...]:
    _mapping(rule, where)
    _no_unknown_keys(rule, _EXCLUDE_KEYS, where)
    if "stack" in rule:  # compare by canonical label, so "lora+gc" excludes "gc + lora"
        rule = {**rule, "stack": _stack(rule["stack"], f"{where}.stack").label}
    return tuple(sorted(rule.items()))


def _mapping(value: Any, where: str) -> None:
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected a mapping, got {type(value).__name__}")


def _no_unknown_keys(body: dict[str, Any], known: set[str], where: str) -> None:
    for key in body:
        if key not in known:
            hint = difflib.get_close_matches(str(key), list(known), n=1)
            dym = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise SpecError(f"{where}: unknown key {key!r}{dym}; allowed: {', '.join(sorted(known))}")


def _list(body: dict[str, Any], key: str, where: str) -> list[Any]:
    value = body[key]
    if not isinstance(value, list) or not value:
        raise SpecError(f"{where}.{key}: expected a non-empty list, got {value!r}")
    return value


def _optional_list(body: dict[str, Any], key: str, where: str) -> list[Any]:
    value = body.get(key) or []
    if not isinstance(value, list):
        raise SpecError(f"{where}.{key}: expected a list, got {value!r}")
    return value


def _positive_ints(body: dict[str, Any], key: str, where: str) -> tuple[int, ...]:
    return tuple(_int(v, f"{where}.{key}[{i}]", minimum=1) for i, v in enumerate(_list(body, key, where)))


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise SpecError(f"{where}: expected a positive finite number, got {value!r}")
    return float(value)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{where}: expected true or false, got {value!r}")
    return value
