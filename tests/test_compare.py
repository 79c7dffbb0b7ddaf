"""`bench compare`: the regression gate, on the committed llama3b H100 run and altered copies of it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from bench import cli, compare

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "results" / "llama3b" / "runs" / "llama3b-h100-20261122.parquet"
CELL = "llama-3.2-3b_s2048_b2_baseline_f57da4d7"


@pytest.fixture
def base() -> pd.DataFrame:
    return pd.read_parquet(RUN)


def _gate(tmp_path: Path, base: pd.DataFrame, cand: pd.DataFrame, *flags: str) -> tuple[int, str]:
    base.to_parquet(tmp_path / "base.parquet")
    cand.to_parquet(tmp_path / "cand.parquet")
    out = tmp_path / "report.md"
    code = cli.main(["compare", str(tmp_path / "base.parquet"), str(tmp_path / "cand.parquet"), "--out", str(out), *flags])
    return code, out.read_text()


def _alter(frame: pd.DataFrame, cell_id: str, **values: object) -> pd.DataFrame:
    frame = frame.copy()
    for col, value in values.items():
        frame.loc[frame.cell_id == cell_id, col] = value
    return frame


def test_identical_runs_pass(tmp_path: Path, base: pd.DataFrame) -> None:
    code, report = _gate(tmp_path, base, base)
    assert code == 0
    assert report.startswith("# Regression check: PASS") and "0 regressed" in report


def test_memory_regression_fails_and_names_the_cell(tmp_path: Path, base: pd.DataFrame) -> None:
    peak = base.loc[base.cell_id == CELL, "peak_reserved_gib"].item()
    code, report = _gate(tmp_path, base, _alter(base, CELL, peak_reserved_gib=peak * 1.05))
    assert code == 1 and "FAIL" in report
    line = next(x for x in report.splitlines() if CELL in x)
    assert "| regression |" in line and "+5.0%" in line


def test_memory_within_the_gate_passes(tmp_path: Path, base: pd.DataFrame) -> None:
    peak = base.loc[base.cell_id == CELL, "peak_reserved_gib"].item()
    assert _gate(tmp_path, base, _alter(base, CELL, peak_reserved_gib=peak + 0.2))[0] == 0
    assert _gate(tmp_path, base, _alter(base, CELL, peak_reserved_gib=peak + 0.2), "--mem-abs-gib", "0.1",
                 "--mem-rel", "0.001")[0] == 1


def test_throughput_drop_is_judged_against_the_noise_band(tmp_path: Path, base: pd.DataFrame) -> None:
    row = base.loc[base.cell_id == CELL].iloc[0]
    band = compare._tps_band(row.to_dict(), row.to_dict(), compare.Gate())
    assert band is not None and band >= 0.03
    inside = _alter(base, CELL, tokens_per_s=row.tokens_per_s * (1 - band / 2))
    outside = _alter(base, CELL, tokens_per_s=row.tokens_per_s * (1 - band * 1.5))
    assert _gate(tmp_path, base, inside)[0] == 0
    code, report = _gate(tmp_path, base, outside)
    assert code == 1 and "tokens/s -" in report and "noise band" in report


def test_ok_to_oom_is_a_regression_and_oom_to_ok_an_improvement(tmp_path: Path, base: pd.DataFrame) -> None:
    code, report = _gate(tmp_path, base, _alter(base, CELL, status="oom", oom_phase="first_step/forward",
                                                 peak_reserved_gib=None, tokens_per_s=None))
    assert code == 1
    assert "was ok, now oom (first_step/forward)" in report and "ok → oom" in report
    oom_cell = base.loc[base.status == "oom", "cell_id"].iloc[0]
    code, report = _gate(tmp_path, base, _alter(base, oom_cell, status="ok", peak_reserved_gib=70.0, tokens_per_s=1e4))
    assert code == 0 and "1 improved" in report


def test_a_cell_missing_from_the_candidate_is_reported_not_failed(tmp_path: Path, base: pd.DataFrame) -> None:
    code, report = _gate(tmp_path, base, base[base.cell_id != CELL])
    assert code == 0 and "1 missing" in report


def test_versions_that_differ_are_flagged(tmp_path: Path, base: pd.DataFrame) -> None:
    cand = base.copy()
    cand["transformers_version"] = "5.23.0"
    report = _gate(tmp_path, base, cand)[1]
    assert "| transformers_version | 5.17.0 **≠** | 5.23.0 |" in report


def test_unknown_run_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--results-dir", str(tmp_path), "compare", "no-such-run", "other"]) == 2
    assert "no-such-run" in capsys.readouterr().err


PUBLISHED_PREDICTION = REPO / "results" / "regress" / "predicted" / "regress-predicted-h100-20261123.parquet"


# The committed baseline of `make predict-gate` since the step's work is counted as now (fake-run/25)
GATE_BASELINE = REPO / "results" / "regress" / "predicted" / "regress-predicted-h100-20261130c.parquet"


def _gate_grown(tmp_path: Path, stack: str, *columns: str, growth: float = 1.05,
                baseline: Path = PUBLISHED_PREDICTION) -> tuple[int, str, str]:
    """The CPU gate: a committed regress prediction against a copy in which one cell's `columns` grew by `growth`;
    (exit code, report, that cell's id)."""
    from bench import results

    rows = [dict(r) for r in results.read_parquet(baseline, results.PREDICTED).to_dict("records")]
    cell = next(r for r in rows if r["stack"] == stack)
    for column in columns:  # a count stays whole
        cell[column] = round(cell[column] * growth) if column in ("step_ops", "step_kernels") else cell[column] * growth
    results.write_parquet(rows, tmp_path / "cand.parquet", results.PREDICTED)
    out = tmp_path / "report.md"
    code = cli.main(["compare", str(baseline), str(tmp_path / "cand.parquet"), "--out", str(out)])
    return code, out.read_text(), cell["cell_id"]


def test_two_predictions_are_gated_on_their_predicted_peak_allocated(tmp_path: Path) -> None:
    code, report, cell_id = _gate_grown(tmp_path, "gc + lora", "peak_allocated_gib")
    assert code == 1 and report.startswith("# Regression check (predictions: no GPU ran): FAIL")
    assert f"| `{cell_id}` | regression |" in report and "+5.0%" in report
    assert cli.main(["compare", str(PUBLISHED_PREDICTION), str(PUBLISHED_PREDICTION)]) == 0


def test_two_predictions_are_gated_on_predicted_reserved_too(tmp_path: Path) -> None:
    """A release that moves an allocation changes reserved at the same allocated: the gate must see it."""
    code, report, cell_id = _gate_grown(tmp_path, "gc", "peak_reserved_gib")
    assert code == 1 and "Gate: peak allocated and reserved each +max(2%" in report
    assert "| allocated GiB | reserved GiB |" in report
    line = next(x for x in report.splitlines() if cell_id in x)
    assert "| regression |" in line and "reserved +" in line and "+5.0%" in line and "allocated +" not in line


WORK = ("step_tflop", "step_ops", "step_kernels", "step_compute_tflop", "step_memory_gb")


def test_two_predictions_are_gated_on_their_predicted_step_time(tmp_path: Path) -> None:
    """A release whose step dispatches more work (ops, kernels, bytes, FLOPs) at the same memory is slower: the
    gate prices both sides' counted work at today's rates (deterministic, so a tight 2%) and fails past it. 5%
    more of everything is 5% more time; 1% passes; 5% less is an improvement."""
    code, report, cell_id = _gate_grown(tmp_path, "gc + lora", *WORK, baseline=GATE_BASELINE)
    assert code == 1 and "predicted step time +2% (the counted work at today's rates, both sides)" in report
    line = next(x for x in report.splitlines() if cell_id in x)
    assert "| regression |" in line and "predicted step time +5.0%" in line and "allocated" not in line
    assert "| step ms (predicted) |" in report
    assert _gate_grown(tmp_path, "gc + lora", *WORK, growth=1.01, baseline=GATE_BASELINE)[0] == 0
    code, report, cell_id = _gate_grown(tmp_path, "gc", *WORK, growth=0.95, baseline=GATE_BASELINE)
    assert code == 0 and "| improvement |" in next(x for x in report.splitlines() if cell_id in x)
    assert cli.main(["compare", str(GATE_BASELINE), str(GATE_BASELINE)]) == 0


def test_gated_on_status_alone_a_prediction_that_stops_running_fails_and_moves_are_only_shown(tmp_path: Path) -> None:
    """The coverage half of the CPU gate (`--status-only`): every stack predicted under new releases must still
    run; how far its figures moved is said, not judged (the regress half judges those)."""
    from bench import results

    code, report, cell_id = _gate_grown(tmp_path, "gc", "peak_reserved_gib", growth=1.10, baseline=GATE_BASELINE)
    assert code == 1
    assert cli.main(["compare", str(GATE_BASELINE), str(tmp_path / "cand.parquet"), "--status-only",
                     "--out", str(tmp_path / "status.md")]) == 0
    report = (tmp_path / "status.md").read_text()
    assert "PASS" in report and "Gate: status alone" in report
    assert "| same |" in next(x for x in report.splitlines() if cell_id in x) and "not gated: reserved +" in report
    rows = [dict(r) for r in results.read_parquet(GATE_BASELINE, results.PREDICTED).to_dict("records")]
    rows[0] |= {"status": "error", "error": "TypeError: a release's new keyword"}
    results.write_parquet(rows, tmp_path / "broken.parquet", results.PREDICTED)
    assert cli.main(["compare", str(GATE_BASELINE), str(tmp_path / "broken.parquet"), "--status-only"]) == 1


def test_cells_skipped_on_both_sides_are_counted_by_reason_not_listed(tmp_path: Path, base: pd.DataFrame) -> None:
    """Nothing ran on either side of a cell the plan skipped twice: the report counts those under the table by
    their reason (the coverage matrix's 52 one-GPU stacks at 2 ranks) and lists every cell that ran on one side."""
    skipped = base[base.status == "skipped"]
    assert len(skipped) > 1
    code, report = _gate(tmp_path, base, base)
    assert code == 0 and not any(f"`{cell}`" in report for cell in skipped.cell_id)
    assert f"Not listed: {len(skipped)} cells skipped on both sides" in report
    assert f"- {(skipped.skip_reason == skipped.skip_reason.iloc[0]).sum()}: {skipped.skip_reason.iloc[0]}" in report
    ran = skipped.cell_id.iloc[0]  # skipped in the baseline, run in the candidate: listed
    code, report = _gate(tmp_path, base, _alter(base, ran, status="ok", peak_reserved_gib=10.0, tokens_per_s=1e4))
    assert f"`{ran}`" in report and f"Not listed: {len(skipped) - 1} cells" in report


def test_the_nightly_gate_compares_with_the_baseline_the_makefile_and_tests_name() -> None:
    """The CPU gate's workflow once pinned its own default baseline (a prediction of an older method) and a frozen
    version set: every night it gated against the wrong run. Now the Makefile's PREDICT_BASELINE is the one baseline
    (the workflow names none), it is the prediction these tests gate, and the nightly set is the newest releases."""
    import re

    makefile = (REPO / "Makefile").read_text()
    baseline = re.search(r"^PREDICT_BASELINE \?= (\S+)$", makefile, re.M)
    assert baseline and GATE_BASELINE.name == f"{baseline[1]}.parquet" and GATE_BASELINE.exists()
    workflow = (REPO / ".github" / "workflows" / "predict-gate.yml").read_text()
    assert not re.search(r"regress-predicted-[\w-]+", workflow), "the workflow must not pin a baseline of its own"
    assert "tools/newest_versions.py versions/nightly.txt" in workflow and "PREDICT_BASELINE_VERSIONS" in workflow
    # a pull request is gated under the releases the baseline was predicted under: its change alone
    baseline_set = re.search(r"^PREDICT_BASELINE_VERSIONS \?= (\S+)$", makefile, re.M)
    assert baseline_set
    pins = dict(line.split("==") for line in (REPO / "versions" / f"{baseline_set[1]}.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    predicted = pd.read_parquet(GATE_BASELINE).iloc[0]
    assert pins and {name: predicted[f"{name.replace('-', '_')}_version"].split("+")[0] for name in pins} == pins
    # its coverage half: every stack of llama3b, predicted under the same releases
    coverage = re.search(r"^PREDICT_COVERAGE_BASELINE \?= (\S+)$", makefile, re.M)
    assert coverage
    every_stack = pd.read_parquet(REPO / "results" / "coverage" / "predicted" / f"{coverage[1]}.parquet")
    first = every_stack.iloc[0]
    assert {name: first[f"{name.replace('-', '_')}_version"].split("+")[0] for name in pins} == pins
    from bench import spec
    matrices = spec.load(REPO / "matrix.yaml")
    assert set(every_stack["stack"]) == {s.label for s in matrices["llama3b"].stacks} == {
        s.label for s in matrices["coverage"].stacks}
    on_two_ranks = set(every_stack[(every_stack["gpus"] == 2) & (every_stack["status"] == "ok")]["stack"])
    assert {"fsdp", "zero2", "zero3", "fsdp + offload(params=True)"} <= on_two_ranks  # the fake process group, the hybrid


def test_the_nightly_version_set_is_the_newest_final_release_not_yanked() -> None:
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    import newest_versions

    ok, yanked = [{"yanked": False}], [{"yanked": True}]
    releases = {"2.9.1": ok, "2.10.0": ok, "2.11.0rc1": ok, "2.11.0.dev20261101": ok, "2.10.1": yanked,
                "2.10.0.post1": ok, "not-a-version": ok, "2.12.0": []}
    assert newest_versions.newest_release(releases) == "2.10.0.post1"  # 2.10.0 < its post release < a yanked 2.10.1
    assert newest_versions.newest_release({"1.0.0b1": ok}) is None
    import datetime as dt

    text = newest_versions.constraints({"torch": "2.15.0", "peft": "0.21.2"}, dt.date(2026, 11, 30))
    assert text.splitlines()[1:] == ["torch==2.15.0", "peft==0.21.2"] and text.startswith("# Newest releases")


def _wheel(directory: Path, name: str, version: str, *requires: str) -> None:
    """A wheel holding only its metadata: enough for pip's resolver, which reads nothing else."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    metadata = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                          *(f"Requires-Dist: {r}" for r in requires)]) + "\n"
    with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", metadata)
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def test_the_nightly_version_set_is_what_pip_installs_not_a_newest_release_it_cannot(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On 2026-12-02 transformers 5.25.0 was on PyPI but needed `kernels>=0.19.1`, which PyPI did not have: pip
    installed 5.24.0, and a nightly set pinning 5.25.0 failed its own install instead of gating anything. The set is
    now pip's resolution, and the newest release passed over is named with pip's reason. Here on wheels made up for
    it, through the real pip: `lib` 2.0 needs a `dep` release no index has."""
    import datetime as dt
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    import newest_versions

    for wheel in [("lib", "1.0", "dep>=1"), ("lib", "2.0", "dep>=5"), ("dep", "1.2"), ("Other_Lib", "3.0+cpu")]:
        _wheel(tmp_path, *wheel)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    local = ("--no-index", "--find-links", str(tmp_path))
    resolved = newest_versions.pip_resolves(["lib", "other-lib"], local)
    assert resolved == {"lib": "1.0", "dep": "1.2", "other-lib": "3.0"}  # canonical names, local label dropped
    assert "dep>=5" in newest_versions.why_not("lib", "2.0", local)
    with pytest.raises(newest_versions.PipRefused, match="dep>=5"):
        newest_versions.pip_resolves(["lib==2.0"], local)
    text = newest_versions.constraints({"lib": "1.0"}, dt.date(2026, 12, 2), {"lib": ("2.0", "no dep>=5")})
    assert text.splitlines() == ["# Newest releases pip installs together on 2026-12-02 (tools/newest_versions.py).",
                                 "# lib 2.0 is on PyPI but not installed: no dep>=5", "lib==1.0"]
