"""tools/preregister.py: which cells a GPU would run next that no published prediction speaks for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd

from conftest import REPO

sys.path[:0] = [str(REPO / "tools")]

import preregister  # noqa: E402

from bench import spec  # noqa: E402
from bench.predict import gpus  # noqa: E402

IMAGE = "torch 2.11.0, transformers 5.17.0, peft 0.21.0"
H100_PREDICTIONS = REPO / "results" / "llama8b" / "predicted" / "llama8b-predicted-h100-torch211-20261128.parquet"
H200_RUN = REPO / "results" / "llama3b" / "runs" / "llama3b-h200-20261127.parquet"


def test_an_h100_prediction_speaks_for_an_h200_only_where_the_cards_size_shaped_nothing(tmp_path: Path) -> None:
    """Of four llama8b cells predicted for an H100 under the GPU image's releases: a calm one speaks for the
    H200, and so does one not predicted (`unsupported`); one whose allocator retried, or whose reserved would
    not fit the H200, does not. One already run on an H200 is not asked for; nor is a prediction under other
    releases taken."""
    matrix = spec.get(REPO / "matrix.yaml", "llama8b")
    predicted = pd.read_parquet(H100_PREDICTIONS)
    calm, retried, too_big, unsupported, ran = predicted["cell_id"].iloc[:5]
    four = predicted[predicted["cell_id"].isin([calm, retried, too_big, unsupported])].copy().reset_index(drop=True)
    four["alloc_retries"] = four["alloc_retries"].astype("Int64")
    four.loc[four["cell_id"] == calm, "alloc_retries"] = 0
    four.loc[four["cell_id"] == retried, "alloc_retries"] = 1
    four.loc[four["cell_id"] == too_big, ["alloc_retries", "peak_reserved_gib"]] = [0, 150.0]  # an H200: 140.4
    four.loc[four["cell_id"] == unsupported, "status"] = "unsupported"
    newer = four[four["cell_id"] == too_big].assign(transformers_version="9.9.9", peak_reserved_gib=1.0)
    (tmp_path / "llama8b" / "predicted").mkdir(parents=True)
    pd.concat([four, newer]).to_parquet(tmp_path / "llama8b" / "predicted" / "p.parquet")
    (tmp_path / "llama8b" / "runs").mkdir(parents=True)
    pd.read_parquet(H200_RUN).head(1).assign(cell_id=ran).to_parquet(tmp_path / "llama8b" / "runs" / "r.parquet")

    asked = preregister.unspoken_for(matrix, gpus.get("h200"), IMAGE, tmp_path)
    to_run = [pc.cell.cell_id for pc in preregister.predict_runner.plan(matrix, None)
              if pc.skip_reason is None and pc.cell.gpus == 1]
    assert retried in asked and too_big in asked
    assert asked == [c for c in to_run if c not in (calm, unsupported, ran)]
    on_h100 = preregister.unspoken_for(matrix, gpus.get("h100"), IMAGE, tmp_path)  # its own kind: any status
    assert on_h100 == [c for c in to_run if c not in (calm, retried, too_big, unsupported)]


def test_a_bad_gpu_kind_matrix_or_software_exits_2() -> None:
    for args in (["h999", "llama8b"], ["h200", "no-such-matrix"],
                 ["h200", "llama8b", "--software", "torch 2.11.0, transformers 5.17.0"]):  # peft unnamed
        proc = subprocess.run([sys.executable, str(REPO / "tools" / "preregister.py"), *args],
                              capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 2 and "preregister:" in proc.stderr and not proc.stdout
