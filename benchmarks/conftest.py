"""Options of the pytest-benchmark view of a matrix (see test_matrix_benchmark.py)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--bench-matrix", default=None, help="matrix to benchmark (default: regress on a GPU, smoke on CPU)")
    parser.addoption("--bench-only", default=None, help="only cells whose id matches this glob")
