"""Generated matrices and command lines, valid, mutated and hostile: each one plans cleanly (exit 0)
or is refused with exit 2 and a message; never a traceback, never a file outside the results folder."""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import cli
from bench.techniques import REGISTRY

SAFE = st.sampled_from(["m", "tiny", "a.b-c_d", "x1"])
HOSTILE_NAMES = st.sampled_from(["../x", "../../../etc/x", ".hidden", "a/b", "", "..", "-", "x" * 300, "é", "a b", "\x00"])
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=12), st.lists(st.integers(-2, 5), max_size=3), st.dictionaries(st.text(max_size=4),
                                                                                                st.integers(), max_size=2))


def _option(name: str) -> st.SearchStrategy[str]:
    options = list(REGISTRY[name].options) or ["r"]
    value = st.one_of(st.integers(-5, 70000).map(str), st.sampled_from(["true", "[", "!!python/object/apply:os.system [x]",
                                                                       "1.5", "-0.1", ".nan", "fp32", "''", "{a: 1}"]))
    return st.tuples(st.sampled_from([*options, "bogus"]), value).map(lambda kv: f"{kv[0]}={kv[1]}")


@st.composite
def stacks(draw: Any) -> str:
    names = draw(st.lists(st.sampled_from([*sorted(REGISTRY), "baseline", "lorra", "gc+"]), min_size=1, max_size=3))
    terms = []
    for name in names:
        opts = draw(st.lists(_option(name), max_size=2)) if name in REGISTRY else []
        terms.append(f"{name}({', '.join(opts)})" if opts else name)
    return " + ".join(terms)


VALID = {"device": "cpu", "models": ["tiny-llama"], "seq_lens": [32], "batch_sizes": [1, 2],
         "stacks": ["baseline", "gc + lora(r=8)"], "steps": {"warmup": 1, "measure": 2}}


@st.composite
def matrices(draw: Any) -> dict[str, Any]:
    if draw(st.booleans()):  # a valid matrix, maybe with one key made wrong
        body = {**VALID, "stacks": draw(st.lists(st.sampled_from(["baseline", "gc", "lora(r=4)", "mixed", "zero2",
                                                                  "grad_accum", "liger"]), min_size=1, max_size=3,
                                                 unique=True))}
        if draw(st.booleans()):
            body[draw(st.sampled_from([*VALID, "timeout_s", "exclude", "ladder"]))] = draw(JUNK)
        return body
    body = {
        "device": draw(st.sampled_from(["cpu", "cuda", "auto", "tpu"])),
        "models": draw(st.lists(st.sampled_from(["tiny-llama", "tiny-qwen2", "llama-3.1-70b", "nope"]), min_size=0, max_size=2)),
        "seq_lens": draw(st.lists(st.integers(-1, 4096), max_size=2)),
        "batch_sizes": draw(st.lists(st.integers(-1, 8), max_size=2)),
        "stacks": draw(st.lists(stacks(), max_size=3)),
    }
    for key in draw(st.lists(st.sampled_from(["steps", "timeout_s", "seed", "repeats", "exclude", "ladder", "gpus",
                                              "checkpoint", "prune_after_oom", "colour"]), max_size=3)):
        body[key] = draw(JUNK)
    for key in draw(st.lists(st.sampled_from(list(body)), max_size=2)):  # mutate a valid-looking value into junk
        body[key] = draw(JUNK)
    return body


def _run(root: Path, args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(["--matrix-file", str(root / "matrix.yaml"), "--results-dir", str(root / "results"), *args])
        except SystemExit as stop:  # argparse's own refusals
            code = int(stop.code or 0)
    return code, err.getvalue()


def _check(root: Path, args: list[str]) -> None:
    code, err = _run(root, args)
    assert code in (0, 2), (args, code, err)
    if code == 2:
        assert err.strip(), f"exit 2 without a message: {args}"
    assert sorted(p.name for p in root.iterdir()) == ["matrix.yaml", "results"], args


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.one_of(SAFE, HOSTILE_NAMES), body=matrices())
def test_generated_matrices_plan_or_are_refused(name: str, body: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "results").mkdir()
        try:
            text = yaml.safe_dump({"matrices": {name: body}})
        except (yaml.YAMLError, ValueError):
            return
        (root / "matrix.yaml").write_text(text)
        _check(root, ["list", name])


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(command=st.sampled_from(["run", "report", "predict", "fit", "compare", "overhead", "shard", "merge"]),
       run_id=st.one_of(SAFE, HOSTILE_NAMES), only=st.one_of(st.none(), st.sampled_from(["nomatch*", "*", "[", ""])),
       budgets=st.sampled_from(["8", "-1", "x", "nan", "1,,2", "inf"]),
       shard=st.sampled_from(["1/2", "2/2", "0/8", "9/8", "x", "1/0", "", "3/8/1"]))
def test_generated_command_lines_are_refused_before_anything_runs(command: str, run_id: str, only: str | None,
                                                                  budgets: str, shard: str) -> None:
    """Commands that would run cells are given something wrong (a bad run id, a glob matching nothing,
    a bad budget, a GPU-only matrix on this CPU): each must stop with exit 2, having written nothing."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU host the GPU-only matrix would run")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "results").mkdir()
        (root / "matrix.yaml").write_text(yaml.safe_dump({"matrices": {"m": {
            "device": "cuda", "models": ["tiny-llama"], "seq_lens": [32], "batch_sizes": [1], "stacks": ["baseline"]}}}))
        args = {"run": ["run", "m", "--run-id", run_id, *(["--only", only] if only is not None else [])],
                "report": ["report", "m", "--run-id", run_id],
                "predict": ["predict", "m", "--run-id", run_id, "--only", "nomatch*"],
                "fit": ["fit", "m", "--budgets", budgets, "--run-id", run_id],
                "compare": ["compare", run_id, "other"],
                "overhead": ["overhead", "m", "--run-id", run_id],
                "shard": ["run", "m", "--shard", shard, "--run-id", run_id],
                "merge": ["report", "m", "--run-id", "*", "--into", run_id]}[command]
        code, err = _run(root, args)
        assert code == 2 and err.strip(), (args, code, err)
        assert not any(root.glob("results/**/*.parquet")), args
