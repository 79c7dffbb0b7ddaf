"""site/index.html: the published results as one self-contained page.

The page has its data embedded (a JSON script element), its script and style inlined (site.js,
site.css beside this file), and, written here in HTML, what must stay readable without JavaScript:
a table of every cell per run, SCENARIOS.md and PREDICTION.md. The script adds the filters, the
"fits in N GiB" control, the plots and a cell's detail on top. It shows each cell once per source and
GPU (its primary record, see data.py), so only those records are embedded: the others (an older run's
measurement, a prediction a newer one replaced) are in the tables alone, and their full rows in the
parquet files. Embedding them all made the page 24.8 MB, three quarters of it rows the script never shows.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any

from markdown_it import MarkdownIt

from .data import SiteData, collect

HERE = Path(__file__).parent
# Sections rendered from the generated markdown boards: (anchor, file under results/, heading)
MARKDOWN_SECTIONS = (("scenarios", "SCENARIOS.md"), ("prediction", "PREDICTION.md"))
TABLE_COLUMNS = (("model", "model"), ("seq_len", "seq"), ("batch_size", "batch"), ("gpus", "GPUs"),
                 ("stack", "stack"), ("status", "status"), ("peak_gib", "peak GiB"),
                 ("device_gib", "device GiB"), ("tokens_per_s", "tokens/s"), ("error", "prediction error"))


def write_site(results_dir: Path, out_dir: Path, results_url: str | None = None) -> Path:
    """Write out_dir/index.html from every published table under results_dir. Links into results/
    (boards, plots) are made relative to out_dir unless results_url says where results/ is served."""
    data = collect(results_dir)
    url = results_url if results_url is not None else os.path.relpath(results_dir, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "index.html"
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render(data, results_dir, url.rstrip("/")))
    os.replace(tmp, path)
    return path


def render(data: SiteData, results_dir: Path, results_url: str) -> str:
    sections = [_markdown_section(anchor, results_dir / name, results_url) for anchor, name in MARKDOWN_SECTIONS]
    payload = {"cells": [cell for cell in data.cells if cell["primary"]], "columns": data.columns, "predictor": data.predictor,
               "stepTime": data.step_time, "resultsUrl": results_url}
    return (HERE / "template.html").read_text().format(
        style=(HERE / "site.css").read_text(),
        script=(HERE / "site.js").read_text(),
        data=_script_json(payload),
        summary=_summary(data),
        tables=_static_tables(data),
        sections="\n".join(sections),
    )


def _script_json(payload: dict[str, Any]) -> str:
    """JSON safe inside a <script> element: no '</' can close it early."""
    return json.dumps(payload, separators=(",", ":"), default=str).replace("</", "<\\/")


def _summary(data: SiteData) -> str:
    measured = [c for c in data.cells if c["source"] == "measured"]
    predicted = [c for c in data.cells if c["source"] == "predicted" and c["primary"]]
    replaced = sum(c["source"] == "predicted" and not c["primary"] for c in data.cells)
    on_gpu = sorted({c["gpu"] for c in measured if c["gpu"] != "CPU"})
    versions = sorted({str(c["row"].get("torch_version")) for c in measured if c["gpu"] != "CPU"})
    error = data.predictor
    newest = max((str(c["started_at"]) for c in data.cells), default="")
    accuracy = (f"checked against {error['cells']} measured cells, the predicted peak reserved is off by "
                f"{error['median_abs_error']:.2%} (median), {error['max_abs_error']:.2%} at most"
                if error.get("cells") else "not yet checked against a measured cell")
    return (f"<p>{len(measured)} measured cells ({sum(c['gpu'] != 'CPU' for c in measured)} on "
            f"{html.escape(', '.join(on_gpu) or 'no GPU')}, torch {html.escape(', '.join(versions) or '-')}) and "
            f"{len(predicted)} predicted ones (<code>bench predict</code>: the training step on fake tensors on a "
            f"CPU; {accuracy}; {replaced} older predictions of the same cells, replaced by these, are in the tables "
            f"alone). Measured figures come from real runs; predicted ones are always marked as "
            f"predictions. Generated from {len(data.sources)} tables (newest cell {html.escape(newest[:16])} UTC) by "
            f"<code>python -m bench site</code>; each cell's detail names the commit and versions that made it.</p>")


def _static_tables(data: SiteData) -> str:
    """Every cell, one table per run: the page without JavaScript."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for cell in data.cells:
        by_run.setdefault(cell["run_id"], []).append(cell)
    parts = []
    for run_id, cells in sorted(by_run.items()):
        cells.sort(key=lambda c: (c["model"], c["seq_len"], c["batch_size"], c["stack"]))
        first = cells[0]
        label = "PREDICTED" if first["source"] == "predicted" else "measured"
        head = "".join(f"<th>{html.escape(title)}</th>" for _, title in TABLE_COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{_cell_text(c, key)}</td>" for key, _ in TABLE_COLUMNS) + "</tr>"
                       for c in cells)
        parts.append(f'<details class="run-table"><summary>{html.escape(run_id)}: {label}, '
                     f"{html.escape(first['gpu'])}, {len(cells)} cells</summary>"
                     f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
                     f"</details>")
    return "\n".join(parts)


def _cell_text(cell: dict[str, Any], key: str) -> str:
    value = cell.get(key)
    if value is None:
        return ""
    if key == "error":
        return f"{value:+.2%}"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.2f}"
    return html.escape(str(value))


def _markdown_section(anchor: str, path: Path, results_url: str) -> str:
    if not path.exists():
        return ""
    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = md.parse(path.read_text())
    for token in tokens:
        for child in token.children or ():
            if child.type == "link_open":
                child.attrSet("href", _link(str(child.attrGet("href") or ""), path.parent, results_url))
    return f'<section id="{anchor}" class="markdown">{md.renderer.render(tokens, md.options, {})}</section>'


def _link(href: str, base: Path, results_url: str) -> str:
    """A board's relative link, made to work from the page: another rendered board -> its section,
    anything else under results/ -> results_url."""
    if "://" in href or href.startswith("#") or not href:
        return href
    for anchor, name in MARKDOWN_SECTIONS:
        if href == name:
            return f"#{anchor}"
    return f"{results_url}/{href}"
