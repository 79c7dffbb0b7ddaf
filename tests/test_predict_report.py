"""PREDICTION.md's pairing: a measured cell is compared with the prediction made under the measured
run's software (torch and transformers releases) where one exists, whatever the predictions' order."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from bench import report as bench_report
from bench.predict import report
from conftest import REPO

MEASURED_RUN = REPO / "results" / "llama3b" / "runs" / "llama3b-h100-20261122.parquet"
PREDICTED_RUN = REPO / "results" / "llama3b" / "predicted" / "llama3b-predicted-h100-20261123.parquet"


def _results_with_a_second_software(tmp_path: Path, started_at: str) -> Path:
    """The published llama3b run and its predictions, plus a copy of those predictions relabelled as
    made under the GPU's releases, each prediction equal to the measurement (a stand-in, test-only)."""
    (tmp_path / "llama3b" / "runs").mkdir(parents=True)
    (tmp_path / "llama3b" / "predicted").mkdir(parents=True)
    shutil.copy(MEASURED_RUN, tmp_path / "llama3b" / "runs")
    shutil.copy(PREDICTED_RUN, tmp_path / "llama3b" / "predicted")
    measured = pd.read_parquet(MEASURED_RUN).drop_duplicates("cell_id").set_index("cell_id")
    other = pd.read_parquet(PREDICTED_RUN)
    other = other[other["cell_id"].isin(measured.index[measured["status"] == "ok"])].copy()
    other["run_id"], other["started_at"] = "same-software", started_at
    other["torch_version"], other["transformers_version"] = "2.11.0+cu130", "5.17.0"
    other["peft_version"] = measured["peft_version"].iloc[0]
    for column in ("peak_allocated_gib", "peak_reserved_gib"):
        other[column] = other["cell_id"].map(measured[column]).astype(other[column].dtype)
    other.to_parquet(tmp_path / "llama3b" / "predicted" / "same-software.parquet")
    return tmp_path


@pytest.mark.parametrize("started_at", ["2000-01-01T00:00:00+00:00", "2100-01-01T00:00:00+00:00"])
def test_a_measured_cell_is_paired_with_the_prediction_under_its_own_software(tmp_path: Path, started_at: str) -> None:
    results_dir = _results_with_a_second_software(tmp_path, started_at)
    both = report.checked(results_dir)
    assert len(both) == both["cell_id"].nunique() > 0
    assert set(both["run_id_predicted"]) == {"same-software"}  # older or newer than the other predictions
    assert both["reserved_error_frac"].abs().max() == 0
    # a board's newest-per-cell view still holds one prediction per cell
    newest = report.predictions(results_dir)
    assert newest["cell_id"].is_unique


def test_a_preferred_softwares_prediction_is_chosen_over_a_newer_one_under_other_releases(tmp_path: Path) -> None:
    """`predictions(prefer=...)`, as SCENARIOS.md takes them: a cell's newest prediction made under the GPU
    runs' releases, though one under other releases is newer; a cell with none under them keeps its newest."""
    results_dir = _results_with_a_second_software(tmp_path, "2000-01-01T00:00:00+00:00")  # the preferred: older
    image = "torch 2.11.0, transformers 5.17.0, peft 0.21.0"
    newest = report.predictions(results_dir).set_index("cell_id")
    preferred = report.predictions(results_dir, prefer=image).set_index("cell_id")
    assert newest.index.is_unique and preferred.index.is_unique and set(newest.index) == set(preferred.index)
    relabelled = set(pd.read_parquet(results_dir / "llama3b" / "predicted" / "same-software.parquet")["cell_id"])
    assert set(newest.loc[list(relabelled), "run_id"]) != {"same-software"}
    assert set(preferred.loc[list(relabelled), "run_id"]) == {"same-software"}
    others = preferred.index.difference(list(relabelled))
    assert len(others) and (preferred.loc[others, "run_id"] == newest.loc[others, "run_id"]).all()


def test_predictions_of_some_cells_are_those_rows_of_every_table_and_skip_tables_without_them(tmp_path: Path) -> None:
    """`every_prediction(cell_ids=...)`, as `bench ask`'s record reads it (the measured cells' predictions only):
    the same rows as reading every table whole and keeping those cells', oldest first; a table holding none of
    them is not converted at all."""
    results_dir = _results_with_a_second_software(tmp_path, "2000-01-01T00:00:00+00:00")
    pd.read_parquet(PREDICTED_RUN).assign(cell_id="elsewhere").to_parquet(tmp_path / "llama3b" / "predicted" / "other.parquet")
    wanted = set(pd.read_parquet(results_dir / "llama3b" / "predicted" / "same-software.parquet")["cell_id"][:5])
    whole = report.every_prediction(results_dir)
    some = report.every_prediction(results_dir, cell_ids=wanted)
    expected = whole[whole["cell_id"].isin(wanted)].reset_index(drop=True)
    assert set(some["cell_id"]) == wanted and len(some) == 2 * len(wanted)  # each in both tables that hold it
    pd.testing.assert_frame_equal(some, expected)
    read = []
    real = report.results.read_parquet
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report.results, "read_parquet", lambda path, *a: read.append(path.name) or real(path, *a))
        report.every_prediction(results_dir, cell_ids=wanted)
    assert "other.parquet" not in read and len(read) == 2


def test_prediction_md_gives_each_softwares_errors_on_the_same_cells(tmp_path: Path) -> None:
    results_dir = _results_with_a_second_software(tmp_path, "2100-01-01T00:00:00+00:00")
    text = report.markdown(report.measured_gpu_cells(results_dir), report.predictions(results_dir, every_software=True))
    section = text.split("### By software", 1)[1].split("\n\n", 2)[2].split("\n\n")[0].splitlines()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in section[2:]}
    assert set(rows) == {"torch 2.13.0, transformers 5.23.0, peft 0.21.2"}  # each other release, beside the measured run's
    other = rows["torch 2.13.0, transformers 5.23.0, peft 0.21.2"]
    assert other[1] == str(len(report.checked(results_dir)))
    reserved, beside = other[3].split(" (")
    assert beside == "0.00% / 0.00%)" and reserved != "0.00% / 0.00%"  # in brackets: the measured run's releases
    paired = pd.read_parquet(PREDICTED_RUN).set_index("cell_id").loc[report.checked(results_dir)["cell_id"]]
    assert other[-1].rstrip(" |") == ", ".join(sorted(paired["prediction_method"].unique()))  # the methods beside
    assert "**56 cells compared**" in text  # one pair per measured cell, not one per prediction


@pytest.mark.parametrize("library", ["transformers", "peft"])
def test_a_release_that_predicted_a_few_cells_does_not_shrink_the_other_comparisons(tmp_path: Path, library: str) -> None:
    """A third release (of transformers, or of peft alone: its LoRA layers are the step's code too) checked on 5
    cells: it is set beside the measured run's releases on those 5 cells, while the other release keeps its
    comparison on every measured cell."""
    results_dir = _results_with_a_second_software(tmp_path, "2100-01-01T00:00:00+00:00")
    few = pd.read_parquet(PREDICTED_RUN)
    few = few[few["cell_id"].isin(report.checked(results_dir)["cell_id"])].head(5).copy()
    few["run_id"], few[f"{library}_version"] = "newer-release", "9.9.9"
    few.to_parquet(results_dir / "llama3b" / "predicted" / "newer-release.parquet")
    text = report.markdown(report.measured_gpu_cells(results_dir), report.predictions(results_dir, every_software=True))
    section = text.split("### By software", 1)[1].split("\n\n", 2)[2].split("\n\n")[0].splitlines()
    rows = [line.split(" | ") for line in section[2:]]
    everything = str(len(report.checked(results_dir)))
    newer = {"transformers": "torch 2.13.0, transformers 9.9.9, peft 0.21.2",
             "peft": "torch 2.13.0, transformers 5.23.0, peft 9.9.9"}[library]
    assert sorted((r[0].strip("| "), r[1]) for r in rows) == sorted(
        [("torch 2.13.0, transformers 5.23.0, peft 0.21.2", everything), (newer, "5")])


def test_a_board_shows_the_prediction_under_the_measured_runs_software(tmp_path: Path) -> None:
    results_dir = _results_with_a_second_software(tmp_path, "2000-01-01T00:00:00+00:00")  # older than the other
    _, board = bench_report.publish(results_dir / "llama3b" / "runs" / MEASURED_RUN.name)
    beside = [line for line in board.read_text().splitlines() if line.startswith("| `") and " / " in line]
    errors = {e for line in beside for e in re.findall(r"\(([+-]\d+\.\d+)%\)", line)}
    assert beside and errors <= {"+0.00", "-0.00"}  # the stand-in predicts every measured figure exactly


def test_a_cell_measured_on_two_gpu_kinds_is_two_measurements_each_beside_its_own_kinds_prediction(
        tmp_path: Path) -> None:
    """The published H200 run measured cells the H100 run had: each GPU's row is compared on its own (not
    folded into one as repeats), with the prediction made for its GPU kind where there is one."""
    results_dir = _results_with_a_second_software(tmp_path, "2100-01-01T00:00:00+00:00")
    h100 = pd.read_parquet(MEASURED_RUN)
    h200 = h100[(h100["status"] == "ok") & (h100["seq_len"] == 2048)].head(3).copy()
    h200["run_id"], h200["gpu_name"] = "h200-run", "NVIDIA H200"
    h200["peak_reserved_gib"] += 1.0  # a figure of its own, so the fold (max over repeats) would show
    h200.to_parquet(results_dir / "llama3b" / "runs" / "h200-run.parquet")
    for_h200 = pd.read_parquet(results_dir / "llama3b" / "predicted" / "same-software.parquet")
    for_h200 = for_h200[for_h200["cell_id"].isin(h200["cell_id"])].assign(gpu_kind="h200", run_id="for-h200")
    for_h200.to_parquet(results_dir / "llama3b" / "predicted" / "for-h200.parquet")

    measured = report.measured_gpu_cells(results_dir)
    assert len(measured) == measured["cell_id"].nunique() + 3
    both = report.checked(results_dir)
    on_h200 = both[both["gpu_name"] == "NVIDIA H200"].set_index("cell_id")
    assert set(on_h200["run_id_predicted"]) == {"for-h200"}
    assert (on_h200["reserved_error_frac"] < 0).all()  # its own measured figure, 1 GiB above the prediction's
    on_h100 = both[both["cell_id"].isin(on_h200.index) & (both["gpu_name"] != "NVIDIA H200")]
    assert set(on_h100["run_id_predicted"]) == {"same-software"} and (on_h100["reserved_error_frac"] == 0).all()
    text = report.markdown(measured, report.predictions(results_dir, every_software=True))
    assert f"**{len(both)} cells compared** ({both['cell_id'].nunique()} cell ids" in text


def test_another_kinds_prediction_stands_in_only_where_the_cards_size_shaped_neither(tmp_path: Path) -> None:
    """A cell measured on an H200 with only an H100 prediction: compared where that prediction neither
    retried an allocation nor reserved more than the H200 holds; not where the H100's end shaped it (the
    allocator freed its cache and reserved less than the H200 measured)."""
    results_dir = _results_with_a_second_software(tmp_path, "2100-01-01T00:00:00+00:00")
    h100 = pd.read_parquet(MEASURED_RUN)
    h200 = h100[(h100["status"] == "ok") & (h100["seq_len"] == 2048)].head(3).copy()
    h200["run_id"], h200["gpu_name"], h200["gpu_memory_gib"] = "h200-run", "NVIDIA H200", 140.4
    h200.to_parquet(results_dir / "llama3b" / "runs" / "h200-run.parquet")
    squeezed, calm, too_big = h200["cell_id"].tolist()
    for path in (results_dir / "llama3b" / "predicted").glob("*.parquet"):  # every software's H100 predictions
        predicted = pd.read_parquet(path)
        predicted.loc[predicted["cell_id"] == squeezed, "alloc_retries"] = 1
        predicted.loc[predicted["cell_id"] == too_big, "peak_reserved_gib"] = 150.0
        predicted.to_parquet(path)

    on_h200 = report.checked(results_dir).query("gpu_name == 'NVIDIA H200'")
    assert on_h200["cell_id"].tolist() == [calm]
    assert set(on_h200["run_id_predicted"]) == {"same-software"}
    on_h100 = report.checked(results_dir).query("gpu_name != 'NVIDIA H200'")
    assert {squeezed, calm}.issubset(on_h100["cell_id"])  # on its own kind a prediction always stands


def test_only_a_prediction_made_before_a_cells_first_run_counts_as_made_before_it(tmp_path: Path) -> None:
    """PREDICTION.md's "Predicted before the GPU ran it": a cell predicted a minute before its first run is
    listed with that prediction's own error (not the newer, exact one's); a cell predicted after its first
    run but before a later repeat is not, nor one predicted only after."""
    results_dir = _results_with_a_second_software(tmp_path, "2100-01-01T00:00:00+00:00")  # exact, made after
    measured = pd.read_parquet(MEASURED_RUN)
    ok = measured[measured["status"] == "ok"].drop_duplicates("cell_id")
    early, repeated = ok["cell_id"].iloc[0], ok["cell_id"].iloc[1]
    first_ran = pd.to_datetime(ok.set_index("cell_id")["started_at"], utc=True)
    repeat = ok[ok["cell_id"] == repeated].assign(run_id="later-run", started_at="2026-12-01T00:00:00+00:00")
    repeat.to_parquet(results_dir / "llama3b" / "runs" / "later-run.parquet")
    stand_in = pd.read_parquet(results_dir / "llama3b" / "predicted" / "same-software.parquet")
    older = stand_in[stand_in["cell_id"].isin([early, repeated])].copy()
    older["run_id"] = "made-earlier"
    older["peak_reserved_gib"] *= 1.10  # its own error, +10%, where the newest prediction's is 0
    older["started_at"] = [(first_ran[early] - pd.Timedelta(minutes=1)).isoformat() if c == early
                           else "2026-11-30T00:00:00+00:00" for c in older["cell_id"]]  # after the first run
    older.to_parquet(results_dir / "llama3b" / "predicted" / "made-earlier.parquet")
    # the other published predictions (llama3b-predicted-h100-20261123) came after every cell's first run

    report.publish(results_dir)
    text = (results_dir / "PREDICTION.md").read_text()
    section = text.split("### Predicted before the GPU ran it", 1)[1].split("###", 1)[0]
    listed = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(listed) == 1 and f"`{early}`" in listed[0]
    assert listed[0].endswith("| +10.00% (+0.00%) |")  # its own error, and in brackets the newest prediction's
    assert f"1 of the {report.measured_gpu_cells(results_dir).shape[0]} measurements had one" in section


def test_a_record_is_read_again_once_a_table_is_written(tmp_path: Path) -> None:
    """`record` reads the tables once per state of them (bench ask asks for one per stack): a table written
    since, here predictions equal to the measurements, is in the next record."""
    full = _results_with_a_second_software(tmp_path / "full", "2100-01-01T00:00:00+00:00")
    results_dir = tmp_path / "results"
    shutil.copytree(full, results_dir, ignore=shutil.ignore_patterns("same-software.parquet"))
    before = report.record(results_dir, "fake-run/1", 1, offload=False)
    assert report.record(results_dir, "fake-run/1", 1, offload=False) == before
    assert before.reserved_errors and max(map(abs, before.reserved_errors)) > 0
    shutil.copy(full / "llama3b" / "predicted" / "same-software.parquet", results_dir / "llama3b" / "predicted")
    after = report.record(results_dir, "fake-run/1", 1, offload=False)
    assert len(after.reserved_errors) == len(before.reserved_errors) and set(after.reserved_errors) == {0.0}


def test_a_cell_measured_under_code_since_fixed_is_compared_and_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A measured row the suite's own code moved (MEASURED_UNDER_OLD_CODE, by run and cell): still compared, its
    error in the summary's figures, and listed beneath them with the reason; the other cells are not listed."""
    results_dir = _results_with_a_second_software(tmp_path, "2100-01-01T00:00:00+00:00")
    both = report.checked(results_dir)
    noted = both.iloc[0]
    monkeypatch.setattr(report, "MEASURED_UNDER_OLD_CODE", {(noted["run_id"], noted["cell_id"]): "a hook as it was"})
    text = report.markdown(report.measured_gpu_cells(results_dir), report.predictions(results_dir, every_software=True))
    listed = text.split("Measured under the suite's code as it was", 1)[1].split("\n\n")[1].splitlines()[2:]
    assert [line.split(" | ")[0].strip("| `") for line in listed] == [noted["cell_id"]]
    assert listed[0].endswith("| a hook as it was |") and f"**{len(both)} cells compared**" in text
    monkeypatch.setattr(report, "MEASURED_UNDER_OLD_CODE", {})
    assert "Measured under the suite's code as it was" not in report.markdown(
        report.measured_gpu_cells(results_dir), report.predictions(results_dir, every_software=True))


def test_a_techniques_evidence_is_set_beside_the_gpus_where_both_rows_have_it(tmp_path: Path) -> None:
    """EVIDENCE_COMPARED from a prediction's evidence_json beside the measured row's: listed for the cells whose
    two rows both have it, and for no other; none, no section."""
    results_dir = _results_with_a_second_software(tmp_path, "2100-01-01T00:00:00+00:00")
    path = results_dir / "llama3b" / "predicted" / "same-software.parquet"
    predicted = pd.read_parquet(path)
    text = report.markdown(report.measured_gpu_cells(results_dir), report.predictions(results_dir, every_software=True))
    assert "A technique's own evidence" not in text
    measured = report.measured_gpu_cells(results_dir).set_index("cell_id")
    cell = predicted["cell_id"].iloc[0]
    predicted["evidence_json"] = None
    predicted.loc[predicted["cell_id"] == cell, "evidence_json"] = '{"saved_for_backward_gib": 1.5, "other": 2}'
    predicted.to_parquet(path)
    with_evidence = measured.loc[[cell]].reset_index().assign(evidence_json='{"saved_for_backward_gib": 1.25}')
    text = report.markdown(pd.concat([measured.drop(index=cell).reset_index(), with_evidence]),
                           report.predictions(results_dir, every_software=True))
    section = text.split("A technique's own evidence", 1)[1].split("\n\n")[1].splitlines()[2:]
    assert section == [f"| `{cell}` | {measured.loc[cell, 'gpu_name']} | saved_for_backward_gib | 1.25 | 1.5 |"]


def test_a_later_prediction_that_named_no_host_does_not_unsay_the_host_verdict(tmp_path: Path) -> None:
    """PREDICTION.md's host table: each offload cell's newest judged prediction, with the host it was judged
    against; a newer run without --host-memory-gib, under the same releases, leaves the verdict standing."""
    (tmp_path / "m" / "predicted").mkdir(parents=True)
    base = {"schema_version": report.results.PREDICTED.version, "status": "ok", "matrix": "m", "device": "cuda",
            "torch_version": "2.13.0", "transformers_version": "5.25.0", "gpu_kind": "h100", "peak_allocated_gib": 9.0}
    tables = {"judged": [{"cell_id": "offload_a", "host_peak_gib": 172.3, "host_fits": False, "host_memory_gib": 128.0},
                         {"cell_id": "offload_b", "host_peak_gib": 4.2, "host_fits": True, "host_memory_gib": 64.0}],
              "later": [{"cell_id": "offload_a", "host_peak_gib": 172.4}, {"cell_id": "offload_c", "host_peak_gib": 3.0}]}
    for day, (run_id, rows) in enumerate(tables.items(), start=1):
        report.results.write_parquet([base | r | {"run_id": run_id, "started_at": f"2026-12-0{day}T00:00:00+00:00"}
                                      for r in rows], tmp_path / "m" / "predicted" / f"{run_id}.parquet",
                                     report.results.PREDICTED)
    every = report.every_prediction(tmp_path)
    text = report.markdown(report.measured_gpu_cells(tmp_path), report.newest(every, every_software=True), every)
    assert "| `offload_a` | 172.3 |  | **no: host_oom** on 128 GiB |" in text
    assert "| `offload_b` | 4.2 |  | yes, of 64 GiB |" in text
    assert "| `offload_c` | 3.0 |  | not judged (no --host-memory-gib) |" in text
