"""Technique stacks: parse `gc + lora(r=8)`, validate it against the rules, order it by phase.

`baseline` is the empty stack: pure bf16 weights, AdamW (fused), sdpa attention, no technique.
Every problem is a StackError whose message names the technique, option or rule at fault.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import yaml

from .techniques import REGISTRY, Technique, TrainSetup
from .techniques._alloc_conf import VARIABLE as ALLOC_CONF

BASELINE = "baseline"
_TERM = re.compile(r"^\s*([A-Za-z_][\w-]*)\s*(?:\((.*)\))?\s*$")


class StackError(ValueError):
    pass


@dataclass(frozen=True)
class Use:
    """One technique in a stack, with every option resolved (defaults filled in)."""

    name: str
    options: tuple[tuple[str, Any], ...]

    @property
    def technique(self) -> Technique:
        return REGISTRY[self.name]

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def label(self) -> str:
        """The name, with only the options that differ from their defaults."""
        defaults = self.technique.options
        changed = [f"{k}={v}" for k, v in self.options if defaults[k] != v]
        return f"{self.name}({', '.join(changed)})" if changed else self.name


@dataclass(frozen=True)
class Stack:
    uses: tuple[Use, ...]  # in application order: by phase, then name

    @classmethod
    def from_row(cls, stack_json: str | None) -> Stack:
        """A result row's stack, read back from its `stack_json` (every use with its options resolved)."""
        return cls(tuple(Use(name, tuple(opts.items())) for name, opts in json.loads(stack_json or "[]")))

    @property
    def label(self) -> str:
        return " + ".join(u.label for u in self.uses) or BASELINE

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.uses)

    @property
    def setup(self) -> TrainSetup:
        """Step 1 of a build: the baseline's TrainSetup (pure bf16, sdpa, fused AdamW) as each technique's
        `configure` changes it, in application order."""
        setup = TrainSetup()
        for use in self.uses:
            if use.technique.configure is not None:
                setup = use.technique.configure(setup, use.opts)
        return setup

    @property
    def preload(self) -> tuple[str, ...]:
        """The modules its techniques' builds import that a waiting worker imports ahead (Technique.preload)."""
        return tuple(dict.fromkeys(m for use in self.uses for m in use.technique.preload))

    @property
    def env(self) -> dict[str, str]:
        """The environment variables its techniques set for a worker before torch starts; the caching
        allocator's settings joined into one PYTORCH_CUDA_ALLOC_CONF, comma-separated as torch reads it."""
        env: dict[str, str] = {}
        for use in self.uses:
            for key, value in (use.technique.env(use.opts) if use.technique.env else {}).items():
                env[key] = f"{env[key]},{value}" if key == ALLOC_CONF and key in env else value
        return env


def parse_stack(text: str) -> Stack:
    terms = [t for t in str(text).split("+")]
    if [t.strip() for t in terms] == [BASELINE]:
        return Stack(())
    uses = [_parse_term(term) for term in terms]
    seen = [u.name for u in uses]
    if BASELINE in seen:
        raise StackError(f"{text!r}: 'baseline' is the empty stack and cannot be combined")
    duplicates = {n for n in seen if seen.count(n) > 1}
    if duplicates:
        raise StackError(f"{text!r}: {', '.join(sorted(duplicates))} appears more than once")
    stack = Stack(tuple(sorted(uses, key=lambda u: (u.technique.phase, u.name))))
    _check_rules(stack)
    return stack


def _parse_term(term: str) -> Use:
    match = _TERM.match(term)
    if not match:
        raise StackError(f"cannot read technique {term.strip()!r}: expected name or name(key=value, ...)")
    name, args = match.group(1), match.group(2)
    if name == BASELINE:
        return Use(BASELINE, ())
    technique = REGISTRY.get(name)
    if technique is None:
        raise StackError(f"unknown technique {name!r}{_did_you_mean(name, REGISTRY)}; known: {', '.join(sorted(REGISTRY))}")
    if technique.test_only and os.environ.get("BENCH_TEST_TECHNIQUES") != "1":
        raise StackError(f"technique {name!r} is for the suite's own tests (set BENCH_TEST_TECHNIQUES=1)")
    given = _parse_options(name, args or "")
    for key, value in given.items():
        _check_option(technique, key, value)
    resolved = {**technique.options, **given}
    return Use(name, tuple(sorted(resolved.items())))


def _parse_options(name: str, args: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in args.split(","))):
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise StackError(f"{name}: option {part!r} must be written key=value")
        try:
            options[key.strip()] = yaml.safe_load(raw.strip())
        except yaml.YAMLError:
            raise StackError(f"{name}: option {key.strip()}={raw.strip()!r} is not a value (a number, true/false "
                             "or a name)") from None
    return options


_KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a word"}  # for option errors


def _check_option(technique: Technique, key: str, value: Any) -> None:
    name = technique.name
    if key not in technique.options:
        known = ", ".join(technique.options) or "none"
        raise StackError(f"{name}: unknown option {key!r}{_did_you_mean(key, technique.options)}; options: {known}")
    default = technique.options[key]
    ok_type = isinstance(value, type(default)) or (isinstance(default, float) and isinstance(value, int))
    if not ok_type or (isinstance(value, bool) and not isinstance(default, bool)):
        raise StackError(f"{name}: option {key}={value!r} should be {_KINDS.get(type(default), type(default).__name__)}")
    allowed = technique.choices.get(key)
    if allowed is not None and value not in allowed:
        raise StackError(f"{name}: option {key}={value!r} is not one of {', '.join(map(str, allowed))}")
    interval = technique.ranges.get(key)
    if interval is not None and not in_range(value, interval):
        raise StackError(f"{name}: option {key}={value!r} is outside {interval}")


def in_range(value: float, interval: str) -> bool:
    """Whether value lies in an interval written as in mathematics: "[1, inf)", "[0, 1)", "(0, 1]"."""
    match = re.match(r"^([\[(])\s*(-?inf|[-\d.e]+)\s*,\s*(-?inf|[-\d.e]+)\s*([\])])$", interval)
    if not match:
        raise ValueError(f"not an interval: {interval!r}")
    opening, low, high, closing = match.groups()
    lo, hi = float(low), float(high)
    above = value >= lo if opening == "[" else value > lo
    below = value <= hi if closing == "]" else value < hi
    return above and below


def _check_rules(stack: Stack) -> None:
    names = set(stack.names)
    slots: dict[str, str] = {}
    for use in stack.uses:
        t = use.technique
        if t.slot and t.slot in slots:
            raise StackError(f"{slots[t.slot]} and {t.name} both set the {t.slot}: a stack takes one")
        if t.slot:
            slots[t.slot] = t.name
        clash = names.intersection(t.conflicts)
        if clash:
            raise StackError(f"{t.name} cannot be combined with {', '.join(sorted(clash))}")
        if t.needs_one_of and not names.intersection(t.needs_one_of):
            raise StackError(f"{t.name} needs one of {', '.join(t.needs_one_of)} in the same stack")
        problem = t.validate(frozenset(names), use.opts) if t.validate else None
        if problem:
            raise StackError(f"{use.label}: {problem}")


def _did_you_mean(word: str, candidates: Any) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
