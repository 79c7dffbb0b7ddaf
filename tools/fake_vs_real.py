"""Does the fake run count what a real run counts, on every architecture `bench predict` predicts?

    python tools/fake_vs_real.py results/model-types/latest-2026-11-25.json [--only llama,qwen3] [--jobs 2] [--out FILE]

`tools/model_types.py` says which architectures a prediction runs on; this says whether what it counts there is
right. For each (model type, stack) that sweep predicted (status ok), the shrunk config's cell on the CPU (seq 64,
batch 2, the smoke matrix's steps) runs twice under the predictor's memory counter (bench/predict/fake.py
`counted_run`): on fake tensors, as every prediction runs, and on real CPU tensors, the model built on the CPU. No
GPU's workspaces or kernels' scratch on either side, so the two count the same things: every phase's peak bytes (the
build's aside: a real build makes temporaries a meta build does not) and the optimizer state must be equal, as
tests/test_predict.py requires of tiny Llama and OLMoE. Where they differ, the fake tensors' kernels allocate unlike
the real ones on that architecture, and each of its predictions carries the difference. Each pair in a process of
its own (a timeout, a crash cost that type's pairs alone). Exit 1 if a pair differs or fails (with `--baseline`, an
earlier --out's JSON: only if a pair equal there no longer is), 2 on bad arguments.

The comparison is of the fake-tensor path alone: what a GPU adds (cuBLAS workspaces, attention kernels' scratch, the
caching allocator) is checked against GPU rows (results/PREDICTION.md), not here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import model_types  # noqa: E402  (tools/: the architectures' shrunk configs)

TIMEOUT_S = 600  # one pair: two counted runs of a two-layer model, seconds to a minute on 2 cores
SEQ, BATCH = 64, 2  # the cell tests/test_predict.py compares for the registry's tiny models


@dataclass(frozen=True)
class Pair:
    model_type: str
    stack: str
    status: str  # equal | differs | failed
    fake_phases: dict[str, int] | None = None  # stage/phase -> peak bytes alive, the build's aside
    real_phases: dict[str, int] | None = None
    fake_state_gib: float | None = None  # optimizer state
    real_state_gib: float | None = None
    why: str = ""  # a failed pair's exception

    @property
    def worst(self) -> tuple[str, int, int] | None:
        """The phase whose peaks differ the most, (phase, fake bytes, real bytes); None if none differs."""
        fake, real = self.fake_phases or {}, self.real_phases or {}
        differing = [(p, fake.get(p, 0), real.get(p, 0)) for p in sorted(set(fake) | set(real))
                     if fake.get(p) != real.get(p)]
        return max(differing, key=lambda d: abs(d[1] - d[2]), default=None)


def counted(config_path: Path, stack: str) -> dict[str, Any]:
    """The cell's phase peaks and optimizer state, on fake and on real tensors (run in `compare`'s process)."""
    from bench import models, spec
    from bench.cells import make_cell
    from bench.predict import fake
    from bench.predict.counter import Workspaces
    from bench.stacks import parse_stack

    name = models.register_file(config_path)
    cell = make_cell(spec.get(REPO / "matrix.yaml", "smoke"), "cpu", name, SEQ, BATCH, parse_stack(stack))
    found: dict[str, Any] = {}
    for side, is_fake in (("fake", True), ("real", False)):
        counter, _, state_gib = fake.counted_run(cell, Workspaces(), fake=is_fake)
        found[f"{side}_phases"] = {k: v for k, v in counter.phase_peaks.items() if k != "build"}
        found[f"{side}_state_gib"] = state_gib
    return found


def compare(config_path: Path, model_type: str, stacks: list[str]) -> list[Pair]:
    """One model type's pairs, in a process of its own (its imports and its config's checks paid once)."""
    command = [sys.executable, __file__, "--one", str(config_path), *(f"--stack={s}" for s in stacks)]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S * len(stacks))
    except subprocess.TimeoutExpired:
        return [Pair(model_type, s, "failed", why=f"no answer in {TIMEOUT_S * len(stacks)} s") for s in stacks]
    lines = done.stdout.strip().splitlines()
    answered = [json.loads(line) for line in lines if line.startswith("{")]  # one line a stack, as each ends
    why = model_types._exception(done.stderr)[:200] or f"exit {done.returncode}"
    return [_pair(model_type, s, answered[i]) if i < len(answered) else Pair(model_type, s, "failed", why=why)
            for i, s in enumerate(stacks)]


def _pair(model_type: str, stack: str, found: dict[str, Any]) -> Pair:
    if "error" in found:
        return Pair(model_type, stack, "failed", why=found["error"])
    same = found["fake_phases"] == found["real_phases"] and found["fake_state_gib"] == found["real_state_gib"]
    return Pair(model_type, stack, "equal" if same else "differs", **found)


def predicted_pairs(sweep: dict[str, Any], only: set[str] | None) -> list[tuple[str, str]]:
    """The (model type, stack) answers a model-types sweep predicted."""
    return [(a["model_type"], a["stack"]) for a in sweep["answers"]
            if a["status"] == "ok" and (only is None or a["model_type"] in only)]


def compare_all(pairs: list[tuple[str, str]], jobs: int) -> list[Pair]:
    """Every pair, a model type's in one process, `jobs` processes at a time; in the order given."""
    stacks: dict[str, list[str]] = {}
    for model_type, stack in pairs:
        stacks.setdefault(model_type, []).append(stack)
    with tempfile.TemporaryDirectory() as tmp:
        paths = model_types.shrunk_configs(Path(tmp), list(stacks))
        with ThreadPoolExecutor(jobs) as pool:
            found = [p for ps in pool.map(lambda t: compare(paths[t], t, stacks[t]), stacks) for p in ps]
    return [_said(p) for p in found]


def markdown(found: list[Pair], sweep_name: str, versions: str) -> str:
    counts = {s: sum(p.status == s for p in found) for s in ("equal", "differs", "failed")}
    lines = [f"# The fake run against real CPU tensors, architecture by architecture ({versions})", "",
             f"Each (model type, stack) that `{sweep_name}` predicted, its shrunk config's cell on the CPU (seq {SEQ}, "
             f"batch {BATCH}) counted twice by the predictor's memory counter: on fake tensors, as a prediction runs, "
             "and on real CPU tensors (`tools/fake_vs_real.py`). Equal: every phase's peak bytes (the build's aside) "
             "and the optimizer state are the same to the byte. CPU runs, not GPU measurements: what a GPU adds "
             "(workspaces, kernels' scratch, the allocator) is checked against GPU rows, in PREDICTION.md. "
             "Generated; never edited by hand.", "",
             f"{len(found)} pairs: {counts['equal']} equal, {counts['differs']} differ, {counts['failed']} failed."]
    unequal = [p for p in found if p.status != "equal"]
    if unequal:
        lines += ["", "| model type | stack | result |", "|---|---|---|"]
        lines += [f"| {p.model_type} | `{p.stack}` | {_result(p)} |" for p in unequal]
    lines += ["", "Equal: " + ", ".join(f"{p.model_type} (`{p.stack}`)" for p in found if p.status == "equal") + "."]
    return "\n".join(lines) + "\n"


def _result(p: Pair) -> str:
    if p.status == "failed":
        return f"**failed**: {p.why.replace('|', '/')}"
    worst = p.worst
    if worst is None:
        return f"**differs**: optimizer state {p.fake_state_gib:.6f} GiB fake, {p.real_state_gib:.6f} GiB real"
    phase, fake, real = worst
    return (f"**differs**: {phase} {fake / 2**20:.3f} MiB fake, {real / 2**20:.3f} MiB real "
            f"({(fake - real) / max(real, 1):+.2%})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, nargs="?", help="a model-types sweep's JSON (tools/model_types.py --out)")
    parser.add_argument("--only", help="model types, comma-separated (default: every one the sweep predicted)")
    parser.add_argument("--jobs", type=int, default=1, help="pairs side by side (default 1)")
    parser.add_argument("--out", type=Path, help="the markdown table, and beside it the pairs as JSON")
    parser.add_argument("--baseline", type=Path, help="an earlier --out's JSON: exit 1 only if a pair equal there "
                        "no longer is")
    parser.add_argument("--render", type=Path, help="an earlier --out's JSON: its table written again (to --out, else "
                        "beside it), nothing run")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # compare's process: one config
    parser.add_argument("--stack", action="append", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        for stack in args.stack:
            try:
                counts = counted(args.one, stack)
            except Exception as err:  # this stack's; the type's other stacks still run
                counts = {"error": f"{type(err).__name__}: {err}"[:200]}
            print(json.dumps(counts), flush=True)
        return 0
    if args.render:
        kept = json.loads(args.render.read_text())
        text = markdown([Pair(**p) for p in kept["pairs"]], kept["sweep"], kept["versions"])
        (args.out or args.render.with_suffix(".md")).write_text(text)
        return 0
    if args.sweep is None or not args.sweep.is_file() or args.jobs < 1 or (args.baseline and not args.baseline.is_file()):
        print("fake_vs_real: give a model-types sweep's JSON that exists (and a --baseline that does), and --jobs 1 or "
              "more", file=sys.stderr)
        return 2
    sweep = json.loads(args.sweep.read_text())
    found = compare_all(predicted_pairs(sweep, set(args.only.split(",")) if args.only else None), args.jobs)
    text = markdown(found, args.sweep.name, model_types.versions())
    was_equal = None
    if args.baseline:
        kept = json.loads(args.baseline.read_text())["pairs"]
        was_equal = {(p["model_type"], p["stack"]) for p in kept if p["status"] == "equal"}
        gone = [p for p in found if (p.model_type, p.stack) in was_equal and p.status != "equal"]
        text += (f"\nAgainst {args.baseline.name}: " + (f"{len(gone)} pairs equal there no longer are:\n\n" +
                 "\n".join(f"- {p.model_type} / `{p.stack}`: {_result(p)}" for p in gone) if gone else
                 "every pair equal there still is.") + "\n")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"versions": model_types.versions(), "sweep": args.sweep.name,
                                                             "pairs": [asdict(p) for p in found]}, indent=1) + "\n")
    else:
        print(text, end="")
    judged = [p for p in found if was_equal is None or (p.model_type, p.stack) in was_equal]
    return 0 if all(p.status == "equal" for p in judged) else 1


def _said(p: Pair) -> Pair:
    print(f"{p.status:<8} {p.model_type:<28} {p.stack}  {_result(p) if p.status != 'equal' else ''}", file=sys.stderr,
          flush=True)
    return p


if __name__ == "__main__":
    sys.exit(main())
