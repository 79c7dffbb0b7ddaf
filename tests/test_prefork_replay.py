"""tools/prefork_replay.py: a run's waits for imports replayed with N workers ahead."""

from __future__ import annotations

import sys

import pandas as pd
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
from prefork_replay import replay


def test_workers_started_further_ahead_leave_less_of_their_imports_to_wait_for() -> None:
    """Imports of 10 s, cells of 4 s after their handover, worked by hand: one worker ahead has a cell's
    4 s to import in, every other cell waits 6 s; two ahead, 8 s; three ahead, 12 s: no wait."""
    assert replay([10] * 4, [4] * 4, ahead=1).waits_s == [10, 0, 6, 0]
    assert replay([10] * 4, [4] * 4, ahead=2).waits_s == [10, 0, 0, 2]
    three = replay([10] * 4, [4] * 4, ahead=3)
    assert three.waits_s == [10, 0, 0, 0] and three.wall_s == 10 + 4 * 4


def test_the_replay_gives_back_the_waits_an_h200_run_measured_with_one_worker_ahead() -> None:
    run = pd.read_parquet(REPO / "results" / "llama3b" / "runs" / "llama3b-h200-20261127.parquet")
    run = run[run["git_sha"].str.startswith("d5e329b")]  # its first window, one worker ahead (a later one ran three)
    run = run.sort_values("started_at", kind="stable")
    after = (run["wall_s"] - run["imports_wait_s"]).tolist()
    replayed = replay(run["imports_s"].tolist(), after, ahead=1)
    assert replayed.waits_s == pytest.approx(run["imports_wait_s"].tolist(), abs=0.5)
