"""results/SCENARIOS.md: the field reports answered from the published tables, figures labelled by source."""

from __future__ import annotations

from pathlib import Path

from bench import results, scenarios

REPO = Path(__file__).resolve().parents[1]


def test_every_report_gets_a_section_and_an_answer_from_the_published_tables() -> None:
    text = scenarios.markdown(scenarios.Sources(REPO / "results", REPO / "matrix.yaml"))
    for title in ("## 1. 3B at 4k context", "## 2. 8B full fine-tune", "## 3. Memory climbs in steps",
                  "## 4. OOM when saving", "## 5. The generic playbook"):
        section = text.split(title)[1].split("\n## ")[0]
        assert "**Answer:**" in section, title
    assert "never edited by hand" in text and "(predicted)" in text and "(measured)" in text
    # the H100 run measured gc at seq 4096, batch 4 (llama3b): the page shows that row, bold
    assert "| `gc` | **25.5** | **31.3** |" in text


def _row(cell: str, status: str, peak: float | None, **extra: object) -> dict:
    return {"schema_version": 6, "run_id": "r", "cell_id": cell, "status": status, "device": "cuda",
            "peak_allocated_gib": peak, "started_at": "2026-11-23T00:00:00+00:00", **extra}


def test_a_measured_figure_wins_and_an_oom_gives_way_to_the_prediction_of_what_it_needs(tmp_path: Path) -> None:
    results_dir = tmp_path / "results"
    planned = scenarios.Sources(results_dir, REPO / "matrix.yaml").planned("playbook")
    ok_cell, oom_cell, predicted_only = planned[0], planned[1], planned[2]
    results.write_parquet([_row(ok_cell.cell_id, "ok", 28.0), _row(oom_cell.cell_id, "oom", 70.0)],
                          results_dir / "playbook" / "runs" / "r.parquet")
    results.write_parquet([{**_row(c.cell_id, "ok", p), "prediction_method": "fake-run/1"} for c, p in
                           ((ok_cell, 27.0), (oom_cell, 90.0), (predicted_only, 40.0))],
                          results_dir / "playbook" / "predicted" / "p.parquet", table=results.PREDICTED)
    sources = scenarios.Sources(results_dir, REPO / "matrix.yaml")
    assert sources.figure(ok_cell).cell() == "**28.0**" and sources.figure(ok_cell).quote() == "**28.0 GiB** (measured)"
    assert sources.figure(oom_cell).cell() == "**OOM**"
    assert sources.figure(oom_cell, number=True).quote() == "*90.0 GiB* (predicted)"  # not the 70 it reached
    assert sources.figure(predicted_only).cell() == "*40.0*"
    assert sources.figure(planned[3]).cell() == "–"


def test_a_prediction_is_over_the_card_when_its_reserved_memory_and_context_are(tmp_path: Path) -> None:
    """`> card` follows the prediction's `fits` (the allocator's reserved memory plus the CUDA context, on
    the card), not the peak allocated shown: 75 GiB allocated can need 84 GiB of the device."""
    results_dir = tmp_path / "results"
    planned = scenarios.Sources(results_dir, REPO / "matrix.yaml").planned("playbook")
    rows = [(planned[0], 75.0, False), (planned[1], 70.0, True), (planned[2], 90.0, None)]
    results.write_parquet([{**_row(c.cell_id, "ok", p), "prediction_method": "fake-run/4", "fits": fits}
                           for c, p, fits in rows], results_dir / "playbook" / "predicted" / "p.parquet",
                          table=results.PREDICTED)
    sources = scenarios.Sources(results_dir, REPO / "matrix.yaml")
    assert [sources.figure(c).cell() for c, _, _ in rows] == ["*75.0 > card*", "*70.0*", "*90.0 > card*"]


def test_the_save_answer_says_what_a_save_adds_on_the_host_from_the_save_rows(tmp_path: Path) -> None:
    """ZeRO-3 + offload, 8B: the model-only save's copies on top of training's host memory, the full
    save's in place; the GPU side from the code's reading while no save is measured."""
    results_dir = tmp_path / "results"
    sources = scenarios.Sources(results_dir, REPO / "matrix.yaml")
    rows = []
    for matrix, copies in (("save8b", 0.0), ("save8b-model", 15.0)):
        cell = next(c for c in sources.planned(matrix) if {"zero3", "offload"} <= set(c.stack.names))
        rows.append({**_row(cell.cell_id, "ok", 6.0), "prediction_method": "hybrid/1", "peak_reserved_gib": 7.0,
                     "checkpoint_peak_reserved_gib": 7.0, "checkpoint_host_copies_gib": copies,
                     "checkpoint_host_peak_gib": 200.0 + copies})
    results.write_parquet(rows, results_dir / "save8b" / "predicted" / "p.parquet", table=results.PREDICTED)
    below, above = sources.planned("save3b")[:2]  # measured: one save below training's RSS peak, one above
    results.write_parquet([
        {**_row(below.cell_id, "ok", 30.0), "host_rss_peak_gib": 5.0, "checkpoint_host_rss_before_gib": 4.0,
         "peak_reserved_gib": 31.0, "checkpoint_peak_reserved_gib": 31.0},
        {**_row(above.cell_id, "ok", 10.0), "host_rss_peak_gib": 9.0, "checkpoint_host_rss_before_gib": 4.0,
         "checkpoint_host_rss_peak_gib": 9.0}], results_dir / "save3b" / "runs" / "r.parquet")
    section = scenarios.markdown(scenarios.Sources(results_dir, REPO / "matrix.yaml")).split("## 4.")[1]
    answer = section.split("**Answer:**")[1].split("\n")[0]
    assert "*15.0 GiB* (predicted) on top of what training keeps there, *215.0 GiB* (predicted) in all" in answer
    assert "*0.00 GiB* (predicted) of copies, *200.0 GiB* (predicted) in all" in answer
    assert "less than 15.0 GiB to spare" in answer
    assert "| full | *7.00*† | *7.00*† | *200.0* | *0.00* |" in section
    assert f"| `{below.cell_id}` | full | **31.0** | **31.0** | **≤ 5.00** |  |" in section
    assert f"| `{above.cell_id}` | full |  |  | **9.00** | **5.00** |" in section  # no reserved in this row
    assert "the save reserved at most **0.00 GiB** (measured) more than training over 1 measured save cells" in section


def test_a_prediction_for_another_card_does_not_stand_for_the_h100s(tmp_path: Path) -> None:
    """The reports ran on an 80 GB card: a newer prediction made for an H200, whose allocator never had to
    retry, must not replace the H100's (`> card` there), nor give an H200 figure under the H100's verdict."""
    results_dir = tmp_path / "results"
    cell = scenarios.Sources(results_dir, REPO / "matrix.yaml").planned("playbook")[0]
    results.write_parquet([{**_row(cell.cell_id, "ok", 75.0), "prediction_method": "fake-run/10", "fits": fits,
                            "gpu_kind": kind, "started_at": at} for kind, fits, at in
                           (("h100", False, "2026-11-23T00:00:00+00:00"), ("h200", True, "2026-11-28T00:00:00+00:00"))],
                          results_dir / "playbook" / "predicted" / "p.parquet", table=results.PREDICTED)
    sources = scenarios.Sources(results_dir, REPO / "matrix.yaml")
    assert sources.figure(cell).cell() == "*75.0 > card*"
    assert sources.figure(cell).row["gpu_kind"] == "h100"  # type: ignore[index]
