"""Does the fake run count what a real run counts, on every architecture and every stack `bench predict` predicts?

    python tools/fake_vs_real.py results/model-types/latest-2026-11-25.json [--only llama,qwen3] [--jobs 2] [--out FILE]
    python tools/fake_vs_real.py --stacks coverage --models tiny-llama,tiny-olmoe [--jobs 2] [--out FILE]

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

`--stacks MATRIX` asks the same of techniques: each stack of the matrix on each `--models` (the registry's tiny models),
the same cell, each pair in a process of its own (a Triton kernel that finds no GPU breaks the process it ran in).
FSDP2's and DDP's stacks are compared on ENGINE_RANKS ranks: the fake run as a prediction makes it, this process
rank 0 of torch's fake process group, against as many real gloo ranks (tools/gloo_ranks.py), every rank's count
equal to the fake one's, pinned host memory too (FSDP2's offload: its real step runs on gloo ranks, though a measured
CPU cell, with nothing to offload from, is skipped as needing CUDA). Stacks whose real step cannot run on this CPU are
listed with the reason, not compared: a technique that needs CUDA (Liger's Triton kernels, the allocator's settings,
paged AdamW), adapters peft refuses when the cell is planned (DoRA on OLMoE's fused experts), and ZeRO, whose
hybrid is compared with DeepSpeed's engine by tools/hybrid_check.py. A pair whose real step fails here
nonetheless (`--one tiny-olmoe --stack dora` skips the planning) is `no real step`: nothing to compare with, not
failed; `failed` is a fake run that fails where the real step runs, the
predictor's fault. Each fake run runs within what a prediction runs within (bench/predict/fake.py `predicting`: Liger's
and cut cross-entropy's kernels launching nothing, their value-dependent helpers replaced); the real step as the
tests run it (torchao's compiled optimizer step replaced on both sides by what it allocates). Under torch 2.13 /
transformers 5.24, the coverage matrix's 60 stacks on the four tiny models took 12 minutes on 2 cores with --jobs 2
before the engines' pairs came; with their 12 on 2 ranks, 25 minutes beside the test suite (2026-12-02).

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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import model_types  # noqa: E402  (tools/: the architectures' shrunk configs)

from bench.views import in_cell  # noqa: E402

ZERO = "ZeRO: its hybrid is compared with DeepSpeed's engine on gloo ranks by tools/hybrid_check.py"
ENGINE_RANKS = 2  # FSDP2's and DDP's pairs: the fake process group's ranks against as many real gloo ranks
TIMEOUT_S = 600  # one pair: two counted runs of a two-layer model, seconds to a minute on 2 cores
SEQ, BATCH = 64, 2  # the cell tests/test_predict.py compares for the registry's tiny models


@dataclass(frozen=True)
class Pair:
    model_type: str  # with --stacks: the registry's model
    stack: str
    status: str  # equal | differs | failed (the fake run, where the real step runs) | no real step (here)
    fake_phases: dict[str, int] | None = None  # stage/phase -> peak bytes alive, the build's aside
    real_phases: dict[str, int] | None = None
    fake_state_gib: float | None = None  # optimizer state
    real_state_gib: float | None = None
    why: str = ""  # a failed pair's exception
    ranks: int = 1  # FSDP2's and DDP's: ENGINE_RANKS (the real side's figures: the first rank unlike the fake run)
    fake_host_bytes: int | None = None  # pinned host memory at its peak (offload)
    real_host_bytes: int | None = None

    @property
    def worst(self) -> tuple[str, int, int] | None:
        """The phase whose peaks differ the most, (phase, fake bytes, real bytes); None if none differs."""
        fake, real = self.fake_phases or {}, self.real_phases or {}
        differing = [(p, fake.get(p, 0), real.get(p, 0)) for p in sorted(set(fake) | set(real))
                     if fake.get(p) != real.get(p)]
        return max(differing, key=lambda d: abs(d[1] - d[2]), default=None)


def counted(model: str | Path, stack: str) -> dict[str, Any]:
    """The cell's phase peaks and optimizer state, on fake and on real tensors (run in `compare`'s process).
    `model`: a config.json's path, or a registry model's name. {"no_real_step": ...} where the real step fails
    (nothing to compare with), else {"error": ...} where the fake run does: the predictor's fault."""
    from bench import models
    from bench.predict import fake
    from bench.predict.counter import Workspaces

    name = models.register_file(Path(model)) if str(model).endswith(".json") else str(model)
    cell = _cell(name, stack)
    found: dict[str, Any] = {"ranks": cell.gpus}
    try:  # the fake run within what a prediction runs within (its kernels launching nothing, its process group)
        with fake.predicting(cell):
            counter, _, state_gib = fake.counted_run(cell, Workspaces(), fake=True)
        found.update(_side("fake", counter.phase_peaks, state_gib, counter.host_peak_bytes))
    except Exception as err:  # this stack's; the process's other stacks still run
        found["fake_error"] = _said_briefly(err)
    try:
        found.update(_real_side(cell, found))
    except Exception as err:
        return {"ranks": cell.gpus, "no_real_step": _said_briefly(err)}  # nothing to compare with
    return {"ranks": cell.gpus, "error": found["fake_error"]} if "fake_error" in found else found


def _side(side: str, phase_peaks: dict[str, int], state_gib: float, host_bytes: int) -> dict[str, Any]:
    """One side's figures, as a Pair holds them: every phase's peak but the build's (a real build makes temporaries a
    meta build does not)."""
    return {f"{side}_phases": {k: v for k, v in phase_peaks.items() if k != "build"}, f"{side}_state_gib": state_gib,
            f"{side}_host_bytes": host_bytes}


def _real_side(cell: Any, fake_found: dict[str, Any]) -> dict[str, Any]:
    """The cell's steps on real CPU tensors: here, or on `cell.gpus` real gloo ranks. Of several ranks, the first
    whose figures differ from the fake run's (`fake_found`), else rank 0's."""
    from bench.predict import fake
    from bench.predict.counter import Workspaces

    if cell.gpus == 1:
        counter, _, state_gib = fake.counted_run(cell, Workspaces(), fake=False)
        return _side("real", counter.phase_peaks, state_gib, counter.host_peak_bytes)
    import gloo_ranks

    sides = [_side("real", r.phase_peaks, r.state_gib, r.host_peak_bytes) for r in gloo_ranks.counted_ranks(cell)]
    return next((s for s in sides if any(fake_found.get(k.replace("real", "fake")) != v for k, v in s.items())),
                sides[0])


def _said_briefly(err: Exception) -> str:
    """An exception on one line of at most 300 characters (a table's cell)."""
    return " ".join(f"{type(err).__name__}: {err}".split())[:300]


def _cell(model: str, stack: str) -> Any:
    """The compared cell: `model` under `stack` on the CPU, seq SEQ, batch BATCH, the smoke matrix's steps; on
    ENGINE_RANKS ranks where the stack's engine is FSDP2 or DDP (their fake process group is what is compared)."""
    from bench import spec
    from bench.cells import make_cell
    from bench.predict.fake import FAKE_GROUP_ENGINES
    from bench.stacks import parse_stack

    cell = make_cell(spec.get(REPO / "matrix.yaml", "smoke"), "cpu", model, SEQ, BATCH, parse_stack(stack))
    return replace(cell, gpus=ENGINE_RANKS) if set(cell.stack.names) & set(FAKE_GROUP_ENGINES) else cell


def compare(model: str, model_type: str, stacks: list[str]) -> list[Pair]:
    """One model's pairs, in a process of its own (its imports and its config's checks paid once)."""
    command = [sys.executable, __file__, "--one", model, *(f"--stack={s}" for s in stacks)]
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
    ranks = found.get("ranks", 1)
    if "error" in found:
        return Pair(model_type, stack, "failed", why=found["error"], ranks=ranks)
    if "no_real_step" in found:
        return Pair(model_type, stack, "no real step", why=found["no_real_step"], ranks=ranks)
    same = all(found[f"fake_{k}"] == found[f"real_{k}"] for k in ("phases", "state_gib", "host_bytes"))
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
            found = [p for ps in pool.map(lambda t: compare(str(paths[t]), t, stacks[t]), stacks) for p in ps]
    return [_said(p) for p in found]


def stack_pairs(matrix_name: str, models: list[str]) -> tuple[list[tuple[str, str]], dict[tuple[str, str], str]]:
    """The matrix's stacks on each model: the (model, stack) pairs to compare, and the others with why not."""
    from bench import spec
    from bench.envinfo import host_caps

    matrix = spec.get(REPO / "matrix.yaml", matrix_name)
    host = replace(host_caps(), cuda_devices=0)  # the real step runs on this CPU
    smoke = spec.get(REPO / "matrix.yaml", "smoke")
    compared, not_compared = [], {}
    for model in models:
        for stack in matrix.stacks:
            cell = _cell(model, stack.label)
            zero = any(u.technique.slot == "engine" for u in stack.uses) and cell.gpus == 1
            why = ZERO if zero else _skip_reason(cell, smoke, host)
            if why:
                not_compared[model, stack.label] = why
            else:
                compared.append((model, stack.label))
    return compared, not_compared


def _skip_reason(cell: Any, smoke: Any, host: Any) -> str | None:
    """Why the cell's real step cannot run on this CPU (bench/cells.py), or None. FSDP2's offload is the one
    technique that needs CUDA whose step runs here nonetheless, on gloo ranks: a measured CPU cell has nothing to
    offload from, but its CPUOffloadPolicy moves the shards, gradients and optimizer state to the host all the same,
    which is what the fake run counts there. So a multi-rank stack needing CUDA for offload alone is judged as on
    GPUs, its other conditions (families, adapters peft takes) as they would be there."""
    from bench import cells

    if cell.gpus > 1 and {u.name for u in cell.stack.uses if u.technique.requires_cuda} == {"offload"}:
        return cells.skip_reason(replace(cell, device="cuda"), smoke, replace(host, cuda_devices=cell.gpus))
    return cells.skip_reason(cell, smoke, host)


def compare_stacks(pairs: list[tuple[str, str]], jobs: int) -> list[Pair]:
    """Every (registry model, stack) pair, each in a process of its own, `jobs` at a time; in the order given."""
    with ThreadPoolExecutor(jobs) as pool:
        return [_said(p) for ps in pool.map(lambda pair: compare(pair[0], pair[0], [pair[1]]), pairs) for p in ps]


def markdown(found: list[Pair], about: dict[str, Any]) -> str:
    """The table of a comparison; `about` is its JSON's other keys: versions, and the sweep's name (architectures) or
    the matrix's and the stacks not compared (--stacks)."""
    statuses = ("equal", "differs", "failed", "no real step")
    counts = {s: sum(p.status == s for p in found) for s in statuses}
    if "matrix" in about:
        title, what = "stack by stack", (f"Each stack of the `{about['matrix']}` matrix on each of "
                                         f"{', '.join(about['models'])}: the cell")
    else:
        title, what = "architecture by architecture", (f"Each (model type, stack) that `{about['sweep']}` predicted, "
                                                       "its shrunk config's cell")
    ranks = (f"; FSDP2's and DDP's on {ENGINE_RANKS} ranks, torch's fake process group against as many real gloo "
             "ranks, each rank's count equal to the fake one's") if any(p.ranks > 1 for p in found) else ""
    equal = ("every phase's peak bytes (the build's aside), the optimizer state and the pinned host memory are"
             if any(p.fake_host_bytes is not None for p in found) else
             "every phase's peak bytes (the build's aside) and the optimizer state are")
    lines = [f"# The fake run against real CPU tensors, {title} ({about['versions']})", "",
             f"{what} on the CPU (seq {SEQ}, batch {BATCH}) counted twice by the predictor's memory counter: on fake "
             f"tensors, as a prediction runs, and on real CPU tensors (`tools/fake_vs_real.py`){ranks}. Equal: {equal} "
             "the same to the byte. CPU runs, not GPU "
             "measurements: what a GPU adds (workspaces, kernels' scratch, the allocator) is checked against GPU rows, "
             "in PREDICTION.md. Generated; never edited by hand.", "",
             f"{len(found)} pairs: " + ", ".join(f"{counts[s]} {s.replace('differs', 'differ')}" for s in statuses
                                                 if counts[s] or s != "no real step") + "."]
    unequal = [p for p in found if p.status != "equal"]
    if unequal:
        lines += ["", f"| {'model' if 'matrix' in about else 'model type'} | stack | result |", "|---|---|---|"]
        lines += [f"| {p.model_type} | {_stack(p)} | {_result(p)} |" for p in unequal]
    lines += ["", "Equal: " + ", ".join(f"{p.model_type} ({_stack(p)})" for p in found if p.status == "equal") + "."]
    reasons: dict[str, list[str]] = {}
    for model, stack, why in about.get("not_compared", []):
        reasons.setdefault(why, []).append(f"{model} (`{stack}`)")
    if reasons:
        lines += ["", "Not compared here:", ""]
        lines += [f"- {why}: {', '.join(pairs)}" for why, pairs in reasons.items()]  # a list: its pipes stay as said
    return "\n".join(lines) + "\n"


def _stack(p: Pair) -> str:
    return f"`{p.stack}`" + (f" on {p.ranks} ranks" if p.ranks > 1 else "")


def _result(p: Pair) -> str:
    if p.status in ("failed", "no real step"):
        return f"**{p.status}**: {in_cell(p.why)}"
    worst = p.worst
    if worst is None and p.fake_state_gib != p.real_state_gib:
        return f"**differs**: optimizer state {p.fake_state_gib:.6f} GiB fake, {p.real_state_gib:.6f} GiB real"
    if worst is None:
        return f"**differs**: pinned host memory {p.fake_host_bytes} B fake, {p.real_host_bytes} B real"
    phase, fake, real = worst
    return (f"**differs**: {phase} {fake / 2**20:.3f} MiB fake, {real / 2**20:.3f} MiB real "
            f"({(fake - real) / max(real, 1):+.2%})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, nargs="?", help="a model-types sweep's JSON (tools/model_types.py --out)")
    parser.add_argument("--only", help="model types, comma-separated (default: every one the sweep predicted)")
    parser.add_argument("--stacks", metavar="MATRIX", help="instead of a sweep: each stack of this matrix (matrix.yaml) "
                        "on each of --models")
    parser.add_argument("--models", default="tiny-llama", help="with --stacks: registry models, comma-separated "
                        "(default tiny-llama)")
    parser.add_argument("--jobs", type=int, default=1, help="pairs side by side (default 1)")
    parser.add_argument("--out", type=Path, help="the markdown table, and beside it the pairs as JSON")
    parser.add_argument("--baseline", type=Path, help="an earlier --out's JSON: exit 1 only if a pair equal there "
                        "no longer is")
    parser.add_argument("--render", type=Path, help="an earlier --out's JSON: its table written again (to --out, else "
                        "beside it; with --baseline, judged against it), nothing run")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # compare's process: a config's path or a registry name
    parser.add_argument("--stack", action="append", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        for stack in args.stack:
            try:
                counts = counted(args.one, stack)
            except Exception as err:  # this stack's (its cell's); the process's other stacks still run
                counts = {"error": _said_briefly(err)}
            print(json.dumps(counts), flush=True)
        return 0
    if args.render:
        if not args.render.is_file() or (args.baseline and not args.baseline.is_file()):
            print(f"fake_vs_real: no {args.render} (or --baseline {args.baseline})", file=sys.stderr)
            return 2
        kept = json.loads(args.render.read_text())
        pairs = [Pair(**p) for p in kept.pop("pairs")]
        text = markdown(pairs, kept) + (_against(args.baseline, pairs)[0] if args.baseline else "")
        (args.out or args.render.with_suffix(".md")).write_text(text)
        return 0
    problem = _bad_arguments(args)
    if problem:
        print(f"fake_vs_real: {problem}", file=sys.stderr)
        return 2
    found, about = _stacks(args) if args.stacks else _architectures(args)
    text = markdown(found, about)
    was_equal = None
    if args.baseline:
        verdict, was_equal = _against(args.baseline, found)
        text += verdict
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({**about, "pairs": [asdict(p) for p in found]}, indent=1)
                                                 + "\n")
    else:
        print(text, end="")
    if was_equal is not None:  # judged against the baseline: a pair equal there that no longer is
        return 1 if any((p.model_type, p.stack) in was_equal and p.status != "equal" for p in found) else 0
    return 1 if any(p.status in ("differs", "failed") for p in found) else 0


def _against(baseline: Path, found: list[Pair]) -> tuple[str, set[tuple[str, str]]]:
    """What an earlier comparison says of these pairs: its words for the table, and its equal pairs (those judged).
    A pair equal there that did not run here (its package not installed, or not asked) is named, not judged."""
    kept = json.loads(baseline.read_text())["pairs"]
    was_equal = {(p["model_type"], p["stack"]) for p in kept if p["status"] == "equal"}
    gone = [p for p in found if (p.model_type, p.stack) in was_equal and p.status != "equal"]
    text = f"\nAgainst {baseline.name}: " + (f"{len(gone)} pairs equal there no longer are:\n\n" + "\n".join(
        f"- {p.model_type} / {_stack(p)}: {_result(p)}" for p in gone) if gone else "every pair equal there still is.")
    unrun = sorted(was_equal - {(p.model_type, p.stack) for p in found})
    if unrun:
        text += (f" {len(unrun)} pairs equal there did not run here (not compared, or not asked): " +
                 ", ".join(f"{model} (`{stack}`)" for model, stack in unrun) + ".")
    return text + "\n", was_equal


def _bad_arguments(args: argparse.Namespace) -> str:
    """What is wrong with the arguments of a comparison to run, or ""."""
    if (args.sweep is None) == (args.stacks is None):
        return "give a model-types sweep's JSON, or --stacks MATRIX (not both)"
    if args.sweep is not None and not args.sweep.is_file():
        return f"no sweep {args.sweep}"
    if args.baseline and not args.baseline.is_file():
        return f"no --baseline {args.baseline}"
    if args.jobs < 1:
        return "--jobs: 1 or more"
    if args.stacks and args.only:
        return "--only chooses a sweep's model types; with --stacks, --models chooses"
    if args.stacks:
        from bench import models, spec

        try:
            spec.get(REPO / "matrix.yaml", args.stacks)
        except spec.SpecError as err:
            return str(err)
        unknown = [m for m in args.models.split(",") if m not in models.registry()]
        if unknown:
            return f"--models: not in the registry: {', '.join(unknown)}"
    return ""


def _architectures(args: argparse.Namespace) -> tuple[list[Pair], dict[str, Any]]:
    sweep = json.loads(args.sweep.read_text())
    found = compare_all(predicted_pairs(sweep, set(args.only.split(",")) if args.only else None), args.jobs)
    return found, {"versions": model_types.versions(), "sweep": args.sweep.name}


def _stacks(args: argparse.Namespace) -> tuple[list[Pair], dict[str, Any]]:
    chosen = args.models.split(",")
    pairs, not_compared = stack_pairs(args.stacks, chosen)
    found = compare_stacks(pairs, args.jobs)
    return found, {"versions": stack_versions(), "matrix": args.stacks, "models": chosen,
                   "not_compared": [[model, stack, why] for (model, stack), why in not_compared.items()]}


def stack_versions() -> str:
    """The releases the stacks' techniques come from, beside those an architecture's answer names (torch's,
    transformers' and peft's: `model_types.versions`, so each library is named once)."""
    from bench.envinfo import versions

    found = versions()
    named = [f"{name} {found[name]}" for name in ("bitsandbytes", "torchao") if found.get(name)]
    return ", ".join([model_types.versions(), *named])


def _said(p: Pair) -> Pair:
    print(f"{p.status:<12} {p.model_type:<28} {p.stack}  {_result(p) if p.status != 'equal' else ''}", file=sys.stderr,
          flush=True)
    return p


if __name__ == "__main__":
    sys.exit(main())
