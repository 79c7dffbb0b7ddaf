"""The results page (bench site): its data from the published tables, and the page in a real browser.

The browser tests drive Debian's Chromium (/usr/bin/chromium) with Playwright; `.ci/run` installs it.
They are skipped where it is missing, except under CI (CI set), where its absence is a failure.
Screenshots at desktop and phone widths go to $SITE_SCREENSHOTS (default: a temp folder).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pandas as pd
import pytest

from bench import results
from bench.predict import report as predict_report
from bench.site import data as site_data
from bench.site import page
from conftest import REPO

RESULTS = REPO / "results"
CHROMIUM = "/usr/bin/chromium"
# Headless, and without the background connections a closed network refuses.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def site_data_() -> site_data.SiteData:
    return site_data.collect(RESULTS)


def test_every_published_cell_is_on_the_page_once_per_run(site_data_: site_data.SiteData) -> None:
    expected = 0
    for path in site_data.published_tables(RESULTS):
        frame = results.read_any(path)
        expected += frame["cell_id"].nunique()
    assert len(site_data_.cells) == expected
    assert len({c["key"] for c in site_data_.cells}) == expected


def test_one_primary_record_per_cell_source_and_gpu(site_data_: site_data.SiteData) -> None:
    primaries: dict[tuple[str, str, str], int] = {}
    for cell in site_data_.cells:
        primaries.setdefault((cell["source"], cell["gpu"], cell["cell_id"]), 0)
        primaries[(cell["source"], cell["gpu"], cell["cell_id"])] += cell["primary"]
    assert set(primaries.values()) == {1}


def test_predicted_cells_carry_the_error_prediction_md_reports(site_data_: site_data.SiteData) -> None:
    both = predict_report.checked(RESULTS)
    assert len(both) > 0
    # by cell and GPU: a cell measured on two kinds of GPU has an error on each; the primary prediction is the
    # one PREDICTION.md pairs with the measurement. Where PREDICTION.md pairs another kind's prediction (one that
    # stands in: no prediction for the GPU that measured the cell yet), the page has none for that GPU to show.
    own = both[both["same_gpu"].astype(bool)]
    expected = dict(zip(zip(own["cell_id"], own["gpu_name"], strict=True), own["reserved_error_frac"], strict=True))
    primary = {(c["cell_id"], c["gpu"]): c for c in site_data_.cells if c["source"] == "predicted" and c["primary"]}
    assert expected.keys() <= primary.keys()
    for key, error in expected.items():
        assert primary[key]["error"] == pytest.approx(error), key
    # a prediction a newer one replaced carries its own error, not the newer one's
    measured = predict_report.measured_gpu_cells(RESULTS).set_index(["cell_id", "gpu_name"])["peak_reserved_gib"]
    replaced = [c for c in site_data_.cells if c["source"] == "predicted" and not c["primary"] and c["error"] is not None]
    assert any(c["error"] != pytest.approx(primary[(c["cell_id"], c["gpu"])]["error"]) for c in replaced)
    for cell in replaced:
        reserved = measured[(cell["cell_id"], cell["gpu"])]
        assert cell["error"] == pytest.approx((cell["row"]["peak_reserved_gib"] - reserved) / reserved)
    summary = site_data_.predictor
    one_rank = both[both["prediction_method"].str.startswith("fake-run") & (both["gpus"] == 1)]  # the hybrid's apart
    assert summary["median_abs_error"] == pytest.approx(one_rank["reserved_error_frac"].abs().median())


def test_a_prediction_and_a_measurement_of_the_same_card_share_its_gpu_name(site_data_: site_data.SiteData) -> None:
    names = {source: {c["gpu"] for c in site_data_.cells if c["model"] == "llama-3.2-3b" and c["source"] == source}
             for source in ("predicted", "measured")}
    assert "NVIDIA H100 80GB HBM3" in names["predicted"] & names["measured"]
    assert names["predicted"] <= names["measured"]  # each card a prediction is for, named as measured rows name it


def test_a_prediction_needs_its_smallest_card_and_a_measurement_its_device_peak() -> None:
    """What the "fits in N GiB" control compares: a prediction's smallest card (its allocator releasing the
    cache and retrying, as a capped one does) where predicted, else its device peak; a measurement's NVML peak."""
    base = {"run_id": "r", "cell_id": "c", "model": "m", "seq_len": 1, "batch_size": 1, "stack": "gc",
            "status": "ok", "device": "cuda", "peak_reserved_gib": 30.1}
    predicted = site_data._record({**base, "device_peak_gib": 30.9, "least_card_gib": 29.0}, "predicted")
    assert (predicted["device_gib"], predicted["need_gib"]) == (30.9, 29.0)
    older = site_data._record({**base, "device_peak_gib": 30.9}, "predicted")  # a row from before the column
    assert older["need_gib"] == 30.9
    measured = site_data._record({**base, "nvml_peak_gib": 31.8}, "measured")
    assert measured["device_gib"] == measured["need_gib"] == 31.8


def test_the_predictions_shown_without_a_step_time_are_listed_to_predict_again(site_data_: site_data.SiteData,
                                                                                monkeypatch) -> None:
    """tools/repredict_stale.py: after a change of what the fake run counts (a later WORK_COUNTED_SINCE, as a method
    bump makes), every prediction the page showed with a tokens/s is listed, by matrix and GPU kind, with the
    command that predicts it again; a stack the model does not time (QLoRA, ZeRO, several ranks) is not."""
    import sys

    from bench.predict import steptime

    sys.path.insert(0, str(REPO / "tools"))
    import repredict_stale

    timed = {(c["matrix"], c["row"]["gpu_kind"], c["cell_id"]) for c in site_data_.cells
             if c["primary"] and c["source"] == "predicted" and c["tokens_per_s"] is not None}
    assert timed
    monkeypatch.setattr(steptime, "WORK_COUNTED_SINCE", 10**6)
    found = repredict_stale.stale(RESULTS)
    listed = {(matrix, kind, cell_id) for (matrix, kind), ids in found.items() for cell_id in ids}
    assert timed <= listed
    assert not [c for c in listed if "qlora" in c[2] or "zero" in c[2]]
    for command, ((matrix, kind), ids) in zip(repredict_stale.commands(found, "torch211-x", RESULTS), found.items(),
                                              strict=True):
        assert command[3:] == ["--results-dir", str(RESULTS), "predict", matrix, "--gpu", kind, "--run-id",
                               f"{matrix}-predicted-{kind}-torch211-x", "--only", ",".join(ids)]


def test_stale_fit_boards_are_listed_with_the_search_that_makes_them_again(monkeypatch) -> None:
    """tools/repredict_stale.py, the fit boards: after a method bump every predicted frontier whose answers have a
    tokens/s is listed with the `bench fit --predict` command that searches it again over the board's own budgets
    and candidates; one of stacks the model does not time (unsloth8b: QLoRA) is not."""
    import sys

    import pandas as pd

    from bench.predict import steptime

    sys.path.insert(0, str(REPO / "tools"))
    import repredict_stale

    monkeypatch.setattr(steptime, "WORK_COUNTED_SINCE", 10**6)
    boards = {board.matrix: board for board in repredict_stale.stale_boards(RESULTS)}
    assert {"fit3b", "fit70b", "fullft8b", "moe"} <= set(boards) and "unsloth8b" not in boards
    fit70b = boards["fit70b"]
    shown = pd.read_parquet(fit70b.board.parent / f"{fit70b.run_id}.parquet")
    assert fit70b.untimed_cells > 0 and not fit70b.judged_host_ram()
    command = fit70b.command("torch211-x", RESULTS, 2)
    assert command[3:] == ["--results-dir", str(RESULTS), "fit", "fit70b", "--predict", "--gpu", "h100",
                           "--budgets", ",".join(f"{b:g}" for b in sorted(shown["budget_gib"].unique())),
                           "--max-batch", "64", "--max-seq", "32768", "--seq-step", "1024",
                           "--run-id", "fit-fit70b-predicted-h100-torch211-x", "--jobs", "2"]
    assert "40,80" in command


def test_units_are_read_off_column_names() -> None:
    assert site_data.unit_of("peak_reserved_gib") == "GiB"
    assert site_data.unit_of("step_ms_p50") == "ms"
    assert site_data.unit_of("tokens_per_s") == "tokens/s"
    assert site_data.unit_of("build_s") == "s"
    columns = site_data.column_definitions()
    assert columns["peak_reserved_gib"]["measured"].startswith("overall peak of bytes reserved")
    assert columns["peak_reserved_gib"]["predicted"].startswith("PREDICTED")


def test_data_cannot_close_the_script_element_early() -> None:
    text = page._script_json({"cells": [{"stack": "</script><script>alert(1)</script>"}]})
    assert "</" not in text
    assert json.loads(text)["cells"][0]["stack"].startswith("</script>")


def test_board_links_point_at_sections_or_the_results_folder() -> None:
    assert page._link("PREDICTION.md", RESULTS, "../results") == "#prediction"
    assert page._link("fit3b/fit/FIT-predicted.md", RESULTS, "results") == "results/fit3b/fit/FIT-predicted.md"
    assert page._link("https://example.org/x", RESULTS, "results") == "https://example.org/x"


def test_the_page_is_one_file_with_everything_inlined(tmp_path: Path) -> None:
    path = page.write_site(RESULTS, tmp_path / "site")
    text = path.read_text()
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=\"https?:", text), "nothing is fetched at view time"
    assert 'id="scenarios"' in text and 'id="prediction"' in text
    # the boards' links into results/ are relative to where the page was written
    assert f'href="{os.path.relpath(RESULTS, tmp_path / "site")}/fit3b/fit/FIT-predicted.md"' in text
    assert 'href="#prediction"' in text


def test_the_script_gets_the_primary_records_and_the_tables_every_record(site_data_: site_data.SiteData) -> None:
    """An older run's measurement and a prediction a newer one replaced are in the tables, not in the data the
    script reads (it shows each cell once per source and GPU; embedding them all made the page 24.8 MB)."""
    text = page.render(site_data_, RESULTS, "results")
    embedded = json.loads(re.search(r'id="site-data">(.*?)</script>', text, re.S)
                          .group(1).replace("<\\/", "</"))
    primaries = {c["key"] for c in site_data_.cells if c["primary"]}
    assert len(primaries) < len(site_data_.cells)  # published runs do replace one another
    assert {c["key"] for c in embedded["cells"]} == primaries
    replaced = sum(c["source"] == "predicted" and not c["primary"] for c in site_data_.cells)
    assert f"{replaced} older predictions of the same cells, replaced by these, are in the tables alone" in text
    tables = text[text.index('<section id="tables">'):]
    assert tables[:tables.index("</section>")].count("<tr><td>") == len(site_data_.cells)


def test_a_results_folder_without_tables_is_refused(tmp_path: Path) -> None:
    from conftest import run_bench

    (tmp_path / "results").mkdir()
    proc = run_bench(tmp_path, "site", "--out", str(tmp_path / "site"))
    assert proc.returncode == 2 and "no published tables" in proc.stderr
    assert not (tmp_path / "site").exists()


# ---- in a real browser -------------------------------------------------------------------------------


def _chromium_or_skip() -> None:
    if Path(CHROMIUM).exists():
        return
    if os.environ.get("CI"):
        pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium package")
    pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")


@pytest.fixture(scope="module")
def site_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return page.write_site(RESULTS, tmp_path_factory.mktemp("site")).as_uri()


@pytest.fixture(scope="module")
def browser():
    _chromium_or_skip()
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def loaded(browser, site_url: str):
    """A desktop-sized page, loaded, with the console errors and page errors it raised."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.goto(site_url)
    tab.wait_for_selector("#fits-out .fit-card")
    yield tab, errors
    context.close()


def _shown_fit_keys(tab) -> list[str]:
    return tab.eval_on_selector_all(".fit-row", "rows => rows.map(r => r.dataset.key)")


def _need_gib(tab, keys: list[str]) -> dict[str, float]:
    return tab.evaluate("keys => Object.fromEntries(DATA.cells.filter(c => keys.includes(c.key))"
                        ".map(c => [c.key, c.need_gib]))", keys)


@pytest.mark.browser
def test_the_page_loads_without_a_console_error(loaded) -> None:
    tab, errors = loaded
    assert errors == []
    assert tab.locator("#explore").is_visible()
    assert tab.locator(".chart svg .point").count() > 0
    assert tab.locator("#cell-table tbody tr").count() > 100


@pytest.mark.browser
def test_the_budget_control_changes_which_cells_fit(loaded) -> None:
    tab, errors = loaded
    tab.fill("#budget-number", "16")
    tab.dispatch_event("#budget-number", "change")
    small = _shown_fit_keys(tab)
    tab.get_by_role("button", name="80 GiB").click()
    large = _shown_fit_keys(tab)
    assert tab.locator("#budget-label").inner_text() == "80"
    assert 0 < len(small) < len(large)
    for budget, keys in ((16, small), (80, large)):
        assert all(gib <= budget for gib in _need_gib(tab, keys).values())
    assert errors == []


@pytest.mark.browser
def test_predicted_cells_that_fit_are_marked_with_the_predictors_error(loaded) -> None:
    tab, _ = loaded
    tab.get_by_role("button", name="80 GiB").click()
    titles = tab.eval_on_selector_all(".fit-row.predicted .badge.predicted", "bs => bs.map(b => b.title)")
    assert titles
    # the fake run's measured error, or, for a method or a stack no measurement has checked yet, that it is unchecked
    checked = [t for t in titles if re.match(r"predicted; error .*\d+\.\d+%", t)]
    assert checked and all(t in checked or re.search(r"no measured .* checks it yet", t) for t in titles)
    stacks = tab.eval_on_selector_all(".fit-row.predicted", "rows => rows.map(r => r.cells[0].textContent)")
    measured_stacks = tab.evaluate("DATA.predictor.stacks")
    for stack, title in zip(stacks, titles, strict=True):
        checked_here = title.startswith("predicted; error over") or "this cell measured" in title
        # a stack measured on one GPU, predicted on several ranks: the method, not the stack, is unchecked
        method_unchecked = "no measured multi-GPU cell" in title or "no measured ZeRO cell" in title
        assert (stack in measured_stacks) == checked_here or method_unchecked, (stack, title)
        assert not (checked_here and method_unchecked), title


@pytest.mark.browser
def test_predicted_points_are_hollow_and_say_how_their_tokens_per_s_was_predicted(loaded) -> None:
    tab, _ = loaded
    tab.select_option("#filter-model", "gemma-3-1b")  # predicted (H100 and H200), not yet measured
    tab.select_option("#filter-gpu", "NVIDIA H200")
    points = tab.locator(".chart svg .point")
    assert points.count() > 0 and points.count() == tab.locator(".chart svg .point.predicted").count()
    assert tab.eval_on_selector_all(".chart svg .point", "ps => ps.every(p => p.getAttribute('fill') === '#ffffff')")
    title = points.first.locator("title").text_content()
    fitted_on = tab.evaluate("DATA.stepTime['NVIDIA H200'].cells")
    assert title.startswith("PREDICTED: ") and f"rates fitted on {fitted_on} measured cells" in title
    # a measured group shows its measurements and the predictions of its cells, each source under its own front
    tab.select_option("#filter-model", "llama-3.2-3b")
    tab.select_option("#filter-gpu", "NVIDIA H100 80GB HBM3")
    tab.select_option("#filter-seq_len", "2048")
    chart = tab.locator(".chart").first
    assert chart.locator(".point.predicted").count() > 0 and chart.locator(".point:not(.predicted)").count() > 0
    assert chart.locator(".front").count() == 2
    # the fit cards rank a predicted stack by its predicted tokens/s, and say where that figure came from
    tab.select_option("#filter-source", "predicted")
    tab.get_by_role("button", name="80 GiB").click()
    titles = tab.eval_on_selector_all(".fit-row.predicted td:nth-child(4)", "tds => tds.map(t => t.title)")
    assert any(t.startswith("predicted tokens/s: the step time") for t in titles)
    assert tab.locator(".fit-card .note.step-time").first.inner_text() in titles


@pytest.mark.browser
def test_an_offload_cell_predicted_to_overflow_its_host_never_fits(loaded) -> None:
    tab, _ = loaded
    tab.select_option("#filter-model", "llama-3.1-8b")
    tab.fill("#budget-number", "1000")
    tab.dispatch_event("#budget-number", "change")
    shown = set(_shown_fit_keys(tab))
    host_oom = tab.evaluate("DATA.cells.filter(c => c.primary && c.row.host_fits === false).map(c => c.key)")
    assert host_oom and shown and not shown & set(host_oom)  # 181 GiB of host RAM on a 128 GiB host
    mixed = tab.evaluate("DATA.cells.filter(c => c.primary && c.model === 'llama-3.1-8b' && c.stack === 'mixed'"
                         " && c.need_gib > 80).map(c => c.key)")
    assert shown & set(mixed)  # over an H100's 80 GiB, within 1000: the budget decides, not the card predicted for


@pytest.mark.browser
def test_a_garbage_collection_threshold_stacks_need_is_marked_as_holding_under_a_memory_fraction(loaded) -> None:
    tab, _ = loaded
    tab.select_option("#filter-model", "llama-3.1-8b")
    tab.get_by_role("button", name="80 GiB").click()
    marked = tab.eval_on_selector_all(".fit-row td.fraction-only", "tds => tds.map(t => [t.parentElement.cells[0]"
                                      ".textContent, t.textContent, t.title])")
    shown = tab.eval_on_selector_all(".fit-row.predicted", "rows => rows.map(r => r.cells[0].textContent)")
    with_threshold = [stack for stack in shown if "garbage_collection_threshold" in stack]
    assert with_threshold and [stack for stack, _, _ in marked] == with_threshold  # the staircase's prediction
    assert all(text.endswith("*") and "memory fraction" in title for _, text, title in marked)


@pytest.mark.browser
def test_a_filter_narrows_every_view(loaded) -> None:
    tab, _ = loaded
    tab.select_option("#filter-source", "predicted")
    sources = tab.eval_on_selector_all("#cell-table tbody tr td:first-child", "tds => tds.map(t => t.textContent)")
    assert sources and set(sources) == {"predicted"}
    # predictions with a predicted step time are plotted, every marker hollow, under a dotted front alone
    assert tab.locator(".chart svg .point").count() == tab.locator(".chart svg .point.predicted").count() > 0
    assert tab.locator(".chart svg .front").count() == tab.locator(".chart svg .front.predicted").count() > 0
    tab.select_option("#filter-source", "")
    tab.select_option("#filter-technique", "lora")
    stacks = tab.eval_on_selector_all("#cell-table tbody tr td:nth-child(7)", "tds => tds.map(t => t.textContent)")
    assert stacks and all("lora" in s for s in stacks)


@pytest.mark.browser
def test_a_cells_detail_opens_with_every_column_and_its_rerun_command(loaded) -> None:
    tab, errors = loaded
    point = tab.locator(".chart svg .point").first
    key = point.get_attribute("data-key")
    point.click()
    dialog = tab.locator("dialog#detail")
    assert dialog.is_visible()
    cell = tab.evaluate("key => DATA.cells.find(c => c.key === key)", key)
    assert dialog.locator("pre.rerun").inner_text() == cell["row"]["rerun_cmd"]
    rows = dialog.locator("table.columns tbody tr")
    assert rows.count() == len(cell["row"])
    assert "GiB" in dialog.locator("table.columns").inner_text()
    assert dialog.locator("h3", has_text="Loss of every step").count() == 1  # a measured GPU cell records its losses
    dialog.get_by_role("button", name="Close").click()
    assert not dialog.is_visible()
    tab.locator(".cell-row.predicted").first.click()
    assert dialog.locator(".badge.predicted").count() == 1
    assert errors == []


@pytest.mark.browser
def test_screenshots_at_desktop_and_phone_widths_and_nothing_overflows_a_phone(browser, site_url: str,
                                                                               tmp_path: Path) -> None:
    out = Path(os.environ.get("SITE_SCREENSHOTS", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    for name, viewport in (("desktop", {"width": 1280, "height": 900}), ("phone", {"width": 390, "height": 844})):
        context = browser.new_context(viewport=viewport)
        tab = context.new_page()
        tab.goto(site_url)
        tab.wait_for_selector("#fits-out .fit-card")
        overflow = tab.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"{name}: the page scrolls sideways by {overflow}px"
        tab.screenshot(path=str(out / f"site-{name}.png"))
        tab.locator("#charts").scroll_into_view_if_needed()
        tab.screenshot(path=str(out / f"site-{name}-charts.png"))
        context.close()
    for png in out.glob("site-*.png"):
        assert png.stat().st_size > 20_000, png


@pytest.mark.browser
def test_without_javascript_every_cell_is_in_the_tables(browser, site_url: str) -> None:
    context = browser.new_context(java_script_enabled=False)
    tab = context.new_page()
    tab.goto(site_url)
    assert not tab.locator("#explore").is_visible()
    n_cells = sum(results.read_any(p)["cell_id"].nunique() for p in site_data.published_tables(RESULTS))
    assert tab.locator("#tables details tbody tr").count() == n_cells
    tab.locator("#tables details summary").first.click()  # <details> opens without a script
    assert tab.locator("#tables details").first.locator("table").is_visible()
    assert tab.locator("#prediction table").first.is_visible()
    context.close()


def test_a_predictions_tokens_per_s_is_its_step_time_at_todays_rates_and_none_where_not_timed(
        site_data_: site_data.SiteData) -> None:
    from bench.predict import steptime
    from bench.stacks import parse_stack

    timed = untimed = 0
    for cell in (c for c in site_data_.cells if c["source"] == "predicted"):
        row = cell["row"]
        step_ms = steptime.predicted_ms(row, row["gpu_kind"], parse_stack(row["stack"]), cell["gpus"])
        if step_ms is None:
            untimed += 1
            assert cell["tokens_per_s"] is None
        else:
            timed += 1
            assert cell["tokens_per_s"] == pytest.approx(cell["batch_size"] * cell["seq_len"] * 1000 / step_ms)
    assert timed and untimed
    # a stack the model does not time gets none though its row counted the work: ZeRO-3 with offload
    base = {"run_id": "r", "cell_id": "c", "model": "m", "seq_len": 2048, "batch_size": 2, "gpus": 1, "status": "ok",
            "gpu_kind": "h100", "step_tflop": 100.0, "step_ops": 20000, "step_kernels": 15000,
            "step_compute_tflop": 99.0, "step_memory_gb": 700.0}
    plain = site_data._record({**base, "stack": "gc", "stack_json": '[["gc", {}]]'}, "predicted")
    assert plain["tokens_per_s"] == pytest.approx(4096 * 1000 / steptime.predicted_ms(base, "h100", parse_stack("gc"), 1))
    offload = site_data._record({**base, "stack": "zero3 + offload",
                                 "stack_json": '[["zero3", {}], ["offload", {}]]'}, "predicted")
    assert offload["tokens_per_s"] is None
    policy = site_data._record({**base, "stack": "selective_gc(every=1, ops=matmuls)",
                                "stack_json": '[["selective_gc", {"every": 1, "ops": "matmuls"}]]'}, "predicted")
    assert policy["tokens_per_s"] is None  # its ops pay a dispatch mode's host time the model does not count
    assert site_data._record({**base, "gpu_kind": "a100", "stack": "gc", "stack_json": '[["gc", {}]]'},
                             "predicted")["tokens_per_s"] is None  # no rates fitted for an A100
    assert site_data_.step_time["NVIDIA H100 80GB HBM3"]["cells"] == steptime.RATES["h100"].cells


def test_the_cells_of_a_folded_run_show_its_median_tokens_per_s(site_data_: site_data.SiteData) -> None:
    frame = results.read_parquet(RESULTS / "llama3b" / "runs" / "llama3b-h100-repeats.parquet")
    repeats = [c for c in site_data_.cells if c["run_id"] == "llama3b-h100-repeats"]
    assert repeats
    ok = frame[frame["status"] == "ok"]
    for cell in repeats:
        runs = ok[ok["cell_id"] == cell["cell_id"]]["tokens_per_s"].astype(float)
        if len(runs):
            assert cell["tokens_per_s"] == pytest.approx(pd.Series(runs).median())


# ---- the boards' PNG plots, drawn the same way ------------------------------------------------------


def test_the_pareto_front_keeps_only_cells_nothing_beats_on_both_axes() -> None:
    from bench.plots import pareto_front

    cells = pd.DataFrame({"peak_reserved_gib": [10, 12, 20, 25, 30, 30], "tokens_per_s": [5, 4, 9, 8, 12, 11]})
    front = pareto_front(cells, "peak_reserved_gib")
    assert list(zip(front["peak_reserved_gib"], front["tokens_per_s"], strict=True)) == [(10, 5), (20, 9), (30, 12)]


def test_forty_stacks_get_forty_distinct_colour_and_marker_pairs_baseline_first() -> None:
    from bench.plots import stack_styles

    styles = stack_styles([f"s{i:02d}" for i in range(39)] + ["baseline"])
    assert len(set(styles.values())) == 40
    assert next(iter(styles)) == "baseline"
