"""pytest-benchmark of what `bench ask` spends besides its fake run: the record it quotes beside each answer.

Every answer says how its kind of prediction did against the published GPU cells (`predict.report.record`):
the measured cells' predictions, out of every published predicted table. Those tables grow with every
prediction run (166 files, 7,049 rows on 2026-11-28). Reading each whole, twice, and converting every row to
the schema took a median 9.7 s of each answer; reading the measured cells' rows alone, once, 2.2 s (this
benchmark, 3 rounds, on a 2-core Intel Xeon beside a prediction run, torch 2.13.0).

    pytest benchmarks/test_ask_record_benchmark.py      # on the published results/
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.predict import report

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_ask_record(benchmark: Any) -> None:
    record = benchmark.pedantic(report.record, args=(RESULTS, "fake-run/11", 1, False), rounds=3, iterations=1)
    benchmark.extra_info["measured_cells"] = len(record.reserved_errors)
    assert record.reserved_errors  # the published GPU cells predicted by the one-rank fake run
