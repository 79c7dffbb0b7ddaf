"""Terminal progress for a run: a bar with the current cell, done/total and ETA, and one log line
per finished cell (the only output when stdout is not a terminal, e.g. in CI or a remote log)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .cells import Cell
from .views import row_peak_gib

_STYLE = {"ok": "green", "oom": "yellow", "skipped": "dim", "host_oom": "yellow", "error": "red", "timeout": "red"}


class RichProgress:
    def __init__(self, console: Console | None = None):
        self.console = console or Console(log_path=False)
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.console)
        self.task = self.bar.add_task("", total=0)

    def __enter__(self) -> RichProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def start(self, total: int) -> None:
        self.bar.update(self.task, total=total)

    def cell_started(self, cell: Cell) -> None:
        self.bar.update(self.task, description=cell.row_key)

    def cell_finished(self, cell: Cell, row: dict[str, Any]) -> None:
        status = row["status"]
        self.bar.console.log(f"[{_STYLE.get(status, '')}]{status:8}[/] " + escape(f"{cell.row_key}  {_detail(row)}"))
        self.bar.advance(self.task)


def _detail(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        peak = row_peak_gib(row)
        return f"peak {peak:.2f} GiB, {row['tokens_per_s']:.0f} tok/s, {row.get('wall_s', 0):.0f} s"
    if row["status"] == "oom":
        return f"in {row.get('oom_phase')}"
    why = row.get("skip_reason") or row.get("error") or ""
    return why.strip().splitlines()[-1] if why.strip() else ""


class LineProgress:
    """One line per finished cell, no bar: for callers that run cells one at a time (bench fit)."""

    def start(self, total: int) -> None:
        pass

    def cell_started(self, cell: Cell) -> None:
        pass

    def cell_finished(self, cell: Cell, row: dict[str, Any]) -> None:
        print(f"{row['status']:8} {cell.row_key}  {_detail(row)}", flush=True)
