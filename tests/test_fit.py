"""The fit search: probe-count bound, both sides of the boundary, use of what is already known."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from bench import fit, spec
from bench.cells import make_cell


def _prober(limit: int, log: list[int]):
    def probe(size: int) -> str:
        log.append(size)
        return "ok" if size <= limit else "oom"
    return probe


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 64, 100])
def test_finds_the_boundary_within_the_probe_bound(n: int) -> None:
    sizes = list(range(1, n + 1))
    for limit in range(0, n + 1):  # 0: nothing fits; n: everything fits
        log: list[int] = []
        found = fit.search(sizes, _prober(limit, log))
        assert found.largest_ok == (limit or None)
        assert found.smallest_oom == (limit + 1 if limit < n else None)
        assert len(log) <= fit.max_probes(n) == math.ceil(math.log2(n + 1))
        assert found.probes == tuple(log)


def test_known_results_narrow_the_search_and_are_not_rerun() -> None:
    sizes = list(range(1, 65))
    log: list[int] = []
    found = fit.search(sizes, _prober(37, log), known_ok=32, known_oom=40)
    assert (found.largest_ok, found.smallest_oom) == (37, 38)
    assert all(32 < s < 40 for s in log) and len(log) <= fit.max_probes(7)


def test_known_boundary_needs_no_probe() -> None:
    found = fit.search([1, 2, 4, 8], _prober(0, []), known_ok=4, known_oom=8)
    assert found == fit.Frontier(4, 8, ())


def test_a_predicted_host_oom_bounds_the_search_as_an_oom_does() -> None:
    """A predicted host OOM costs nothing: the search bisects on it (too_big) and finds the boundary;
    by default (a measured one) it stops the search."""
    def probe(size: int) -> str:
        return "ok" if size <= 5 else ("host_oom" if size <= 9 else "oom")

    found = fit.search(list(range(1, 16)), probe, too_big=("oom", "host_oom"))
    assert (found.largest_ok, found.smallest_oom, found.stopped) == (5, 6, "")
    assert fit.search(list(range(1, 16)), probe).stopped == "host_oom at 8"


def test_an_error_stops_the_search_and_says_where() -> None:
    def probe(size: int) -> str:
        return "error" if size == 8 else ("ok" if size < 8 else "oom")

    found = fit.search(list(range(1, 16)), probe)
    assert found.stopped == "error at 8" and found.probes == (8,)
    assert (found.largest_ok, found.smallest_oom) == (None, None)


def _needs_prober(need, budget: float, log: list[int], known: dict[int, float]):
    """A predicted search's probe: the size's need becomes known once probed (as a fake run's row)."""
    def probe(size: int) -> str:
        log.append(size)
        known[size] = need(size)
        return "ok" if known[size] <= budget else "oom"
    return probe, fit.Needs(known.get, budget)


NEEDS = {  # GiB a size needs: linear, with a fixed cost; convex (eager attention); in steps (segments); flat then steep
    "linear": lambda s: 6.0 + 0.25 * s,
    "convex": lambda s: 4.0 + 0.05 * s + 0.004 * s * s,
    "steps": lambda s: 2.0 + 2.0 * (s // 5),
    "knee": lambda s: 5.0 + (0.01 * s if s < 200 else 2.0 + 3.0 * (s - 200)),
}


@pytest.mark.parametrize("shape", sorted(NEEDS))
def test_an_interpolating_search_finds_what_bisection_finds_within_three_times_its_bound(shape: str) -> None:
    need, sizes = NEEDS[shape], list(range(1, 353))
    for budget in (0.5, 6.3, 20.0, 41.7, 80.0, 1e4):
        bisected = fit.search(sizes, lambda s, b=budget: "ok" if need(s) <= b else "oom")
        log: list[int] = []
        probe, needs = _needs_prober(need, budget, log, {})
        found = fit.search(sizes, probe, needs=needs)
        assert (found.largest_ok, found.smallest_oom) == (bisected.largest_ok, bisected.smallest_oom), budget
        assert found.probes == tuple(log) and len(set(log)) == len(log)
        assert len(log) <= 3 * fit.max_probes(len(sizes))


def test_a_near_linear_need_is_found_in_fewer_probes_than_bisection_and_known_needs_cost_none() -> None:
    """Over 352 candidates bisection takes 8 or 9 probes a budget. Interpolating a linear need takes 4 at the
    first budget (two bisections give it a line, then the boundary's two sides), and at each later budget,
    where every size probed so far is known, 2: the boundary's sides."""
    need, sizes, known, known_ok = NEEDS["linear"], list(range(1, 353)), {}, None
    logs = []
    for budget in (8.0, 20.0, 41.7, 80.0):
        log: list[int] = []
        probe, needs = _needs_prober(need, budget, log, known)
        found = fit.search(sizes, probe, known_ok=known_ok, needs=needs)
        known_ok = found.largest_ok
        assert (found.largest_ok, found.smallest_oom) == (max(s for s in sizes if need(s) <= budget), known_ok + 1)
        logs.append(log)
    assert logs == [[176, 88, 8, 9], [56, 57], [142, 143], [296, 297]]
    assert fit.search(sizes, lambda s: "ok" if need(s) <= 20.0 else "oom", known_ok=8).probes == (
        180, 94, 51, 72, 61, 56, 58, 57)  # bisection, from the same start


class _Needing:
    """Probes whose cells need `needs[batch]` GiB, known once probed (as a predicted search's)."""

    too_big = ("oom",)

    def __init__(self, needs: dict[int, float]) -> None:
        self.needs, self.rows, self.known = needs, {}, set()
        self.replay_fails: set[int] = set()  # sizes whose replay within the budget fails below their need

    def run(self, cell) -> None:
        self.known.add(cell.batch_size)
        self.rows[cell.row_key] = {"status": "ok" if self.needs[cell.batch_size] <= cell.budget_gib else "oom"}

    def run_key(self, cell) -> str:
        return cell.row_key

    def need_gib(self, cell) -> float | None:
        return self.needs[cell.batch_size] if cell.batch_size in self.known else None

    def fits(self, cell) -> bool | None:
        if cell.batch_size not in self.known:
            return None
        return self.needs[cell.batch_size] <= cell.budget_gib and cell.batch_size not in self.replay_fails


def test_a_size_seen_not_to_fit_below_one_that_fits_is_flagged_on_the_board() -> None:
    """Reserved memory is not always monotone in the batch (the allocator's fragmentation): a search cannot
    know, but where a size was seen to fail below one that fits, the summary and the board say so."""
    from bench import fitreport
    from bench.envinfo import HostCaps

    matrix = spec.from_mapping("f", {"device": "cpu", "models": ["tiny-llama"], "seq_lens": [64], "batch_sizes": [1],
                                     "stacks": ["baseline"]})
    probes = _Needing({b: 10.0 + b for b in range(1, 9)} | {5: 16.5})  # batch 5 needs more than batch 6
    run = fit.FrontierRun(matrix, HostCaps(0, frozenset()), fit.FitPlan((16.2,), max_batch=8, max_seq=64, seq_step=64),
                          probes)
    batch, _ = run.all()
    assert (batch["largest_ok"], batch["smallest_oom"], batch["not_monotone"]) == (6, 7, "")  # 5 was not probed

    def cell_for(size: int):
        return make_cell(matrix, "cpu", "tiny-llama", 64, size, matrix.stacks[0], budget_gib=16.2)

    probes.known.update(range(1, 9))  # as if other budgets' searches had predicted every size
    seen = run.not_monotone(list(range(1, 9)), 16.2, cell_for)
    assert seen == "5 (16.50 GiB) not fitting, below 6 (16.00 GiB) fitting"
    board = fitreport.not_monotone(pd.DataFrame([{**batch, "not_monotone": seen}]))
    assert board[0] == "## Not monotone" and f"| 16.2 | tiny-llama | `baseline` | batch at seq 64 | {seen} |" in board
    assert fitreport.not_monotone(pd.DataFrame([batch])) == []

    # a prediction's replay within the budget can fail where its smallest card is below it (the allocator is
    # not monotone in the capacity): the flag follows the replay, as the probe does, and shows no need there
    probes.replay_fails = {3}
    assert run.not_monotone(list(range(1, 9)), 16.2, cell_for) == "3, 5 (16.50 GiB) not fitting, below 6 (16.00 GiB) fitting"


FIT = """
matrices:
  f:
    device: cpu
    models: [tiny-llama]
    seq_lens: [32]
    batch_sizes: [1]
    stacks: ["fault(mode=oom, over_tokens=160)"]
    steps: {warmup: 1, measure: 1}
    timeout_s: 120
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fit_end_to_end_with_a_simulated_memory_limit(workdir) -> None:
    """Real probe processes; the `fault` technique OOMs above 160 tokens, standing in for a budget."""
    from conftest import raw_rows, run_bench, write_matrix

    write_matrix(workdir, FIT)
    args = ("fit", "f", "--budgets", "1,2", "--max-batch", "8", "--seq-step", "32", "--max-seq", "256", "--run-id", "fit")
    proc = run_bench(workdir, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = pd.read_parquet(workdir / "results" / "f" / "fit" / "fit.parquet").set_index(["axis", "budget_gib"])
    assert summary.loc[("batch", 1.0), ["largest_ok", "smallest_oom"]].tolist() == [5, 6]
    assert summary.loc[("seq", 1.0), ["largest_ok", "smallest_oom"]].tolist() == [160, 192]
    assert summary.loc[("batch", 1.0), "probes"] <= fit.max_probes(8)
    # the larger budget starts from what fit under the smaller: only sizes above 5 are probed
    assert summary.loc[("batch", 2.0), "probes"] <= fit.max_probes(3)
    rows = {(r["budget_gib"], r["seq_len"], r["batch_size"]): r["status"] for r in raw_rows(workdir, "fit").values()}
    assert rows[(1.0, 32, 5)] == "ok" and rows[(1.0, 32, 6)] == "oom"  # both sides of the boundary are rows
    board = (workdir / "results" / "f" / "fit" / "FIT.md").read_text()
    assert "## 1 GiB · seq 32: largest batch" in board and "| 1 | tiny-llama | `fault(mode=oom, over_tokens=160)` | 5 |" in board

    again = run_bench(workdir, *args)  # resumed: every probe is already a row
    assert again.returncode == 0 and "0 probes run now" in again.stdout


def test_fit_refuses_a_multi_gpu_matrix(tmp_path, capsys) -> None:
    from bench import cli
    from conftest import write_matrix

    write_matrix(tmp_path, """
    matrices:
      m: {device: cpu, models: [tiny-llama], seq_lens: [32], batch_sizes: [1], gpus: [2], stacks: [fsdp]}
    """)
    assert cli.main(["--matrix-file", str(tmp_path / "matrix.yaml"), "fit", "m", "--budgets", "8"]) == 2
    assert "bench fit searches one-GPU cells; remove its gpus: [2]" in capsys.readouterr().err


@pytest.mark.parametrize("limit", [0, 1, 9, 10, 11, 30, 64])
def test_a_guess_settles_the_search_in_two_probes_when_right_and_still_finds_the_boundary_when_wrong(limit: int) -> None:
    sizes = list(range(1, 65))
    for guess in (limit, limit - 1, limit + 1, limit + 20, 1, 64):
        log: list[int] = []
        found = fit.search(sizes, _prober(limit, log), guess=guess)
        assert (found.largest_ok, found.smallest_oom) == (limit or None, limit + 1 if limit < 64 else None), guess
        if guess == limit:
            assert len(log) <= 2, (guess, log)
        assert len(log) <= fit.max_probes(64) + 2


PREDICTED_FIT = """
matrices:
  f:
    device: cpu
    models: [tiny-llama]
    seq_lens: [64]
    batch_sizes: [1]
    stacks: [baseline, unsloth]
    steps: {warmup: 1, measure: 2}
"""


@pytest.mark.timeout(600)
def test_predicted_fit_needs_no_gpu_and_agrees_with_its_predictions(workdir) -> None:
    """`bench fit --predict`: each probe a fake run; a cell fits when the smallest card it runs on (its trace
    replayed within the budget less the H100's context, the allocator releasing its cache and retrying, as a
    measured probe's capped allocator does) is within the budget, which may be less than its device peak
    with no cap; a stack the fake run does not cover stops with its reason. Two stacks are searched side by side
    (--jobs 2), each fake run in one of two processes."""
    from conftest import run_bench, write_matrix

    write_matrix(workdir, PREDICTED_FIT)
    proc = run_bench(workdir, "fit", "f", "--predict", "--budgets", "0.82", "--max-batch", "16", "--seq-step", "256",
                     "--max-seq", "1024", "--run-id", "fp", "--jobs", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fit_dir = workdir / "results" / "f" / "fit"
    summary = pd.read_parquet(fit_dir / "fp.parquet").set_index(["stack", "axis"])
    predicted = pd.read_parquet(fit_dir / "fp-predictions.parquet").set_index(["stack", "seq_len", "batch_size"])
    largest = int(summary.loc[("baseline", "batch"), "largest_ok"])
    assert 1 < largest < 16
    least = predicted["least_card_gib"]
    assert least.loc[("baseline", 64, largest)] <= 0.82 < least.loc[("baseline", 64, largest + 1)]  # both predicted
    def within(batch: int) -> bool:  # each prediction replayed within the budget
        return json.loads(predicted.loc[("baseline", 64, batch), "fits_budgets_json"])["0.82"]

    assert within(largest) and not within(largest + 1)
    assert (least <= predicted["device_peak_gib"]).all()
    assert summary.loc[("unsloth", "batch"), "stopped"].startswith("unsupported at")
    board = (fit_dir / "FIT-predicted.md").read_text()
    assert board.startswith("# PREDICTED: fits on my GPU") and "unsloth: Unsloth" in board
    # the answer's tokens/s, from its prediction's step time at the H100's rates (bench/predict/steptime.py)
    step_ms = predicted.loc[("baseline", 64, largest), "step_ms"]
    assert summary.loc[("baseline", "batch"), "step_ms"] == step_ms > 0
    row = next(line for line in board.splitlines() if line.startswith(f"| tiny-llama | `baseline` | {largest} |"))
    assert row.endswith(f"| {largest * 64 / (step_ms / 1000):,.0f} |")
    assert "*tokens/s there*" in board


@pytest.mark.timeout(600)
def test_a_predicted_fit_says_where_the_host_runs_out(workdir) -> None:
    """With --host-memory-gib, a probe whose predicted host RAM (activation offload's pinned copies, one
    worker process) exceeds it is host_oom: it bounds the search as an OOM does, and the board says the
    host ran out. Without --predict the flag is refused."""
    from conftest import run_bench, write_matrix

    write_matrix(workdir, PREDICTED_FIT.replace("[baseline, unsloth]", "[activation_offload]"))
    args = ("fit", "f", "--budgets", "80", "--max-batch", "4", "--seq-step", "64", "--max-seq", "128")
    refused = run_bench(workdir, *args, "--host-memory-gib", "1")
    assert refused.returncode == 2 and "--host-memory-gib" in refused.stderr
    refused = run_bench(workdir, *args, "--jobs", "2")
    assert refused.returncode == 2 and "--jobs spreads fake runs over processes: it needs --predict" in refused.stderr
    proc = run_bench(workdir, *args, "--predict", "--host-memory-gib", "1", "--run-id", "fh")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = pd.read_parquet(workdir / "results" / "f" / "fit" / "fh.parquet").set_index("axis")
    # one worker process alone needs 1.53 GiB: not even batch 1 fits the host
    assert pd.isna(summary.loc["batch", "largest_ok"]) and summary.loc["batch", "smallest_oom"] == 1
    assert summary.loc["batch", "smallest_oom_status"] == "host_oom" and not summary.loc["batch", "stopped"]
    assert "| 1 (host RAM) |" in (workdir / "results" / "f" / "fit" / "FIT-predicted.md").read_text()


def test_a_predicted_frontier_on_a_card_whose_context_is_not_measured_says_its_budgets_are_torchs() -> None:
    """On an A100 (no measured context) a cell's need is torch's alone, least_torch_gib before peak allocated,
    and FIT-predicted.md says a budget there is what torch may use, not the card."""
    from bench import fitreport

    a100 = {"status": "ok", "peak_allocated_gib": 9.0, "least_torch_gib": 10.5}
    assert fit.predicted_need_gib(a100) == 10.5
    assert fit.predicted_need_gib({**a100, "device_peak_gib": 12.0, "least_card_gib": 11.2}) == 11.2
    assert fit.predicted_need_gib({"status": "ok", "peak_allocated_gib": 9.0}) == 9.0  # a row from before it
    bullet = "NVIDIA A100's CUDA context is not measured"
    assert bullet in fitreport._context_unmeasured(pd.DataFrame([{**a100, "device_peak_gib": None}]), "NVIDIA A100")[0]
    assert fitreport._context_unmeasured(pd.DataFrame([{**a100, "device_peak_gib": 12.0}]), "NVIDIA H100") == []


def test_a_published_frontier_is_quoted_beside_ours_never_mixed_in() -> None:
    """unsloth8b's boards quote Unsloth's table (their recipes, their numbers, their page and the date
    read) with our longest sequence per stack at the budget of the same number: a length where one
    fit, OOM where not even the shortest did, "not predicted" where the fake run does not cover the
    stack; budgets we did not search stay empty. Other matrices get no such section."""
    from bench import fitreport, peers

    published = peers.FRONTIERS["unsloth8b"]
    searches = pd.DataFrame([
        {"axis": "seq", "budget_gib": 16.0, "stack": "gc + qlora(r=32)", "largest_ok": 9216.0, "stopped": ""},
        {"axis": "seq", "budget_gib": 8.0, "stack": "gc + qlora(r=32)", "largest_ok": float("nan"), "stopped": ""},
        {"axis": "seq", "budget_gib": 16.0, "stack": "unsloth", "largest_ok": float("nan"),
         "stopped": "unsupported at 1024"},
        {"axis": "batch", "budget_gib": 16.0, "stack": "unsloth", "largest_ok": 1.0, "stopped": ""},
    ])
    lines = fitreport.beside_published(searches, "unsloth8b", "predicted")
    text = "\n".join(lines)
    assert published.url in text and published.read_on in text
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ") and "---" not in line}
    assert rows["16"] == "| 16 | 40,724 | 2,551 | 9,216 | not predicted |"  # columns: theirs, then ours by stack
    assert rows["8"] == "| 8 | 2,972 | OOM | OOM |  |"
    assert rows["80"] == "| 80 | 342,733 | 28,454 |  |  |"
    assert fitreport.beside_published(searches, "fit3b", "predicted") == []


def _search(stack: str, budget: float, largest: float | None, stopped: str = "") -> dict:
    """A fit summary's row: one batch search at seq 64."""
    return {"model": "tiny-llama", "stack": stack, "budget_gib": budget, "axis": "batch", "seq_len": 64,
            "batch_size": None, "largest_ok": largest, "smallest_oom": None, "probes": 2, "stopped": stopped,
            "not_monotone": "", "tokens_per_s": 1000.0 if largest else None, "nvml_peak_gib": None}


def _predicted_frontier(fit_dir, run_id: str, made: str, searches: list[dict]) -> None:
    """A predicted frontier as `bench fit --predict` writes it: its searches, and its cells (here one, made then)."""
    from bench import results

    pd.DataFrame(searches).to_parquet(fit_dir / f"{run_id}.parquet")
    results.write_parquet([{"cell_id": "c", "status": "ok", "started_at": made}], fit_dir / f"{run_id}-predictions.parquet",
                          table=results.PREDICTED)


def test_a_gpu_fit_starts_from_the_newest_predicted_frontier_by_when_it_was_made(tmp_path, capsys) -> None:
    from bench import cli

    _predicted_frontier(tmp_path, "fit-f-predicted-h100-z", "2026-01-01T00:00:00+00:00", [_search("baseline", 1.0, 4)])
    _predicted_frontier(tmp_path, "fit-f-predicted-h100-a", "2026-02-01T00:00:00+00:00",  # newer, first by name
                        [_search("baseline", 1.0, 6), _search("gc", 1.0, None)])
    assert cli._predicted_hints(tmp_path) == {("tiny-llama", "baseline", "batch", 64, 1.0): 6}  # none fits: no guess
    assert "fit-f-predicted-h100-a" in capsys.readouterr().out
    assert cli._predicted_hints(tmp_path / "nothing-here") == {}


def test_a_measured_frontier_is_set_beside_the_one_predicted_before_it(tmp_path) -> None:
    """FIT.md of a measured fit: each search beside the answer of the newest predicted frontier made before
    the fit's first probe (not one made after), and how many of them agree, err small (the safe side) or
    large; a search the prediction did not cover is shown as such and not counted."""
    from bench import fitreport

    search = _search
    for run_id, made, answers in (("early", "2026-01-01T00:00:00+00:00", (4, None, None)),
                                  ("late", "2026-12-01T00:00:00+00:00", (5, 3, 2))):
        _predicted_frontier(tmp_path, run_id, made, [
            search("baseline", 1.0, answers[0]), search("baseline", 2.0, answers[1]),
            search("compile", 1.0, answers[2], "unsupported at 1" if run_id == "early" else "")])
    measured = [search("baseline", 1.0, 5), search("baseline", 2.0, 3), search("compile", 1.0, 2)]
    probe = {"run_id": "m", "cell_id": "p", "matrix": "f", "device": "cpu", "status": "ok", "wall_s": 10.0,
             "started_at": "2026-06-01T00:00:00+00:00"}
    board = fitreport.publish(measured, [probe], tmp_path, "m").read_text()
    assert ("- Predicted before this run: `early` (its last fake run 2026-01-01 00:00 UTC), column *predicted before*: "
            "of the 2 searches both answered, 0 the same, 2 smaller (the safe side), 0 larger.") in board
    assert "| 1 | tiny-llama | `baseline` | 5 | 4 |" in board  # measured 5, predicted 4
    assert "| tiny-llama | `baseline` | 3 | none |" in board  # predicted: none fits
    assert "| tiny-llama | `compile` | 2 | not predicted |" in board
    alone = fitreport.publish(measured, [{**probe, "started_at": "2025-01-01T00:00:00+00:00"}], tmp_path, "m2")
    assert "no predicted frontier of this matrix was made before it" in alone.read_text()


def test_a_stack_with_a_pipe_keeps_its_table_row_whole(tmp_path) -> None:
    """lora's targets are joined by `|`, which splits a markdown table's row: escaped in the cell, the row
    keeps its columns (GitHub's tables need the escape inside a code span too)."""
    import re

    from bench import fitreport

    probe = {"run_id": "m", "cell_id": "p", "matrix": "f", "device": "cpu", "status": "ok", "wall_s": 10.0,
             "started_at": "2026-06-01T00:00:00+00:00"}
    board = fitreport.publish([_search("lora(targets=q_proj|v_proj)", 1.0, 3)], [probe], tmp_path, "m").read_text()
    row = next(line for line in board.splitlines() if "q_proj" in line)
    header = board.splitlines()[board.splitlines().index(row) - 2]
    assert "`lora(targets=q_proj\\|v_proj)`" in row
    assert len(re.split(r"(?<!\\)\|", row)) == len(header.split("|"))


def test_a_predicted_probe_fits_a_budget_as_its_replay_within_that_budget_says() -> None:
    """The allocator can run within a budget and not within a larger one (it releases its cache sooner):
    Llama-3.2-3B gc + offload(params=True) + zero3 at seq 2048, batch 16, on this CPU, runs within 60 GiB,
    not within 65, and within 80, while the bisection's least card is 68.6. A probe takes the replay at
    its budget where the prediction made one, else the least card."""
    row = {"status": "ok", "least_card_gib": 68.6, "fits_budgets_json": json.dumps({"60": True, "65": False, "80": True})}
    assert [fit.runs_within(row, b) for b in (60.0, 65.0, 80.0, None)] == [True, False, True, True]
    older = {"status": "ok", "least_card_gib": 68.6}  # a prediction made before fits_budgets_json
    assert [fit.runs_within(older, b) for b in (60.0, 70.0)] == [False, True]
    assert [fit.runs_within(row, b) for b in (50.0, 70.0)] == [False, True]  # not replayed there: the least card


def test_the_smallest_card_is_never_above_a_budget_the_step_runs_within() -> None:
    """The allocator runs this trace within 42 MiB, not within 44 to 48, and from 50 on
    (tests/test_allocator.py): a bisection from what it reserves unbounded finds 50 MiB. A prediction
    that replayed the budgets starts the bisection from the smallest budget it ran within, so its smallest
    card (42 MiB here) does not contradict its own verdict at 42 (a board showed such a probe fitting 40
    GiB with a smallest card of 40.32)."""
    from bench.predict import allocator, fake, gpus

    mib = 2**20
    events = [(kind, ident, n * mib) for kind, ident, n in
              [("malloc", 0, 20), ("free", 0, 20), ("malloc", 1, 24), ("malloc", 2, 12), ("free", 1, 24),
               ("malloc", 3, 30)]]
    matrix = spec.from_mapping("f", {"device": "cuda", "models": ["tiny-llama"], "seq_lens": [64], "batch_sizes": [1],
                                     "stacks": ["baseline"]})
    cell = make_cell(matrix, "cuda", "tiny-llama", 64, 1, matrix.stacks[0])
    budgets = tuple(n / 1024 for n in (42, 46, 60))
    card = gpus.GpuKind("test", "a test card", (9, 0), outside_torch_gib=0.0, budgets_gib=budgets)
    out = fake.replayed_columns(cell, events, [], [], card)
    assert list(json.loads(out["fits_budgets_json"]).values()) == [True, False, True]
    assert out["least_card_gib"] * 1024 == pytest.approx(42)
    without = fake.replayed_columns(cell, events, [], [], gpus.GpuKind("test", "a test card", (9, 0), outside_torch_gib=0.0))
    assert "fits_budgets_json" not in without and without["least_card_gib"] * 1024 == pytest.approx(50)
    assert allocator.least_capacity(events, allocator.replay(events).peak_reserved_bytes) == 50 * mib
    # a card whose context is not measured: no smallest card, but torch's least need, from the card's capacity down
    unmeasured = gpus.GpuKind("test", "a test card", (9, 0), memory_gib=42 / 1024)
    out = fake.replayed_columns(cell, events, [], [], unmeasured)
    assert "least_card_gib" not in out and "fits" not in out and out["least_torch_gib"] * 1024 == pytest.approx(42)
    assert fake.replayed_columns(cell, events, [], [], gpus.GpuKind("test", "a test card", (9, 0)))[
        "least_torch_gib"] * 1024 == pytest.approx(50)  # nor its capacity: bisected from what it reserves unbounded
    assert without["least_torch_gib"] == without["least_card_gib"]  # with its context measured (0 here)


def test_a_boards_tokens_per_s_is_at_todays_rates_and_names_the_8bit_rate_where_it_times_one() -> None:
    from bench import fitreport
    from bench.predict import steptime
    from bench.stacks import parse_stack

    h100 = steptime.RATES["h100"]
    work = {"gpu_kind": "h100", "gpus": 1, "status": "ok", "model": "m", "seq_len": 64, "batch_size": 2,
            "trainable_params": 10**6, "step_tflop": 1.0, "step_ops": 1000, "step_kernels": 800,
            "step_compute_tflop": 1.0, "step_memory_gb": 1.0}
    plain = pd.DataFrame([{**work, "stack": "gc"}])
    eight_bit = pd.DataFrame([{**work, "stack": "gc + adamw8bit"}])
    def bullet(predictions: pd.DataFrame) -> str:
        return "".join(fitreport._step_time_bullet(predictions, fitreport.step_ms_now(predictions)))

    assert "8-bit" not in bullet(plain)
    assert (f"8-bit optimizer step at {h100.optimizer_8bit_ps:.1f} ps a trainable parameter, fitted on "
            f"{h100.optimizer_8bit_cells} cells") in bullet(eight_bit)
    assert bullet(plain.assign(step_ops=None)) == ""  # nothing timed: no bullet
    # the step time at the rates fitted now, not the one a prediction kept when made
    kept_then = plain.assign(step_ms=1.0)
    assert fitreport.step_ms_now(kept_then) == {("m", "gc", 64, 2): steptime.predicted_ms(work, "h100", parse_stack("gc"), 1)}


def test_a_predicted_frontiers_board_is_rendered_again_at_todays_rates(tmp_path, monkeypatch) -> None:
    """A refit of the step time rates reaches the published boards (bench/predict/report.py publish): each
    FIT-predicted.md is rendered again from the run it names, its tables untouched; a board whose run's tables
    are not there is left as it is."""
    import shutil
    from dataclasses import replace
    from pathlib import Path

    from bench import fitreport
    from bench.predict import steptime

    published = Path(__file__).resolve().parents[1] / "results" / "fit70b" / "fit"
    run = "fit-fit70b-predicted-h100-torch211-20261130c"  # fake-run/26: its step work read at today's rates
    board = tmp_path / "fit70b" / "fit" / "FIT-predicted.md"
    board.parent.mkdir(parents=True)
    for tail in ("", "-predictions"):
        shutil.copy(published / f"{run}{tail}.parquet", board.parent)
    board.write_text(f"- **Predictions, not measurements**: run `{run}`, stale\n")
    orphan = tmp_path / "other" / "fit" / "FIT-predicted.md"
    orphan.parent.mkdir(parents=True)
    orphan.write_text("run `fit-other-predicted-h100-gone`\n")
    tables = {p.name: p.read_bytes() for p in board.parent.glob("*.parquet")}
    assert fitreport.refresh_predicted(tmp_path) == [board]
    now = board.read_text()
    assert "stale" not in now and f"run `{run}`" in now and "tokens/s there (predicted)" in now
    assert orphan.read_text() == "run `fit-other-predicted-h100-gone`\n"
    assert {p.name: p.read_bytes() for p in board.parent.glob("*.parquet")} == tables
    # twice the host's time an op: the board's tokens/s move with the rates
    monkeypatch.setitem(steptime.RATES, "h100", replace(steptime.RATES["h100"], op_us=2 * steptime.RATES["h100"].op_us,
                                                        matmul_tflops=steptime.RATES["h100"].matmul_tflops / 2))
    fitreport.refresh_predicted(tmp_path)
    assert board.read_text() != now


@pytest.mark.timeout(600)
def test_a_resumed_predicted_fit_searches_as_one_never_stopped(workdir) -> None:
    """A predicted fit resumed (stopped half way: half its fake runs on disk; or finished) predicts only the cells
    it lacks and writes the summary the run never stopped writes: each search's probes, the probes it ran
    (`probes_run`: those no search before it ran) and its frontier. Before, a resumed search knew every cell on
    disk before it asked and counted as run only what the resume ran: a finished search resumed wrote 0 probes run."""
    from conftest import run_bench, write_matrix

    write_matrix(workdir, PREDICTED_FIT.replace("[baseline, unsloth]", "[baseline]").replace("[64]", "[256]"))
    args = ("fit", "f", "--predict", "--budgets", "0.8,1.2", "--max-batch", "12", "--seq-step", "256",
            "--max-seq", "1024", "--run-id", "fr")
    fit_dir, raw_dir = workdir / "results" / "f" / "fit", workdir / "results" / "raw" / "fr"
    columns = ["stack", "axis", "seq_len", "budget_gib", "largest_ok", "smallest_oom", "probes", "probes_run"]

    def searched() -> tuple[pd.DataFrame, str]:
        proc = run_bench(workdir, *args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return pd.read_parquet(fit_dir / "fr.parquet")[columns], proc.stdout

    fresh, _ = searched()
    made = sorted(raw_dir.glob("*.json"))
    assert fresh["probes_run"].sum() == len(made) and (fresh["probes"] > fresh["probes_run"]).any()
    for lost in made[::2]:  # as if it had stopped half way
        lost.unlink()
    resumed, said = searched()
    pd.testing.assert_frame_equal(resumed, fresh)
    assert f"{len(made[::2])} cells predicted now" in said
    finished, said = searched()
    pd.testing.assert_frame_equal(finished, fresh)
    assert "0 cells predicted now" in said
