"""The result schema: rows are checked, parquet carries its schema, derived columns are right."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bench import measure, results, views


def _row(**extra: object) -> dict:
    return {"schema_version": results.SCHEMA_VERSION, "run_id": "r", "cell_id": "c", "status": "ok", **extra}


def test_rows_outside_the_schema_are_a_bug() -> None:
    with pytest.raises(KeyError, match="peak_gb"):
        results.check_row(_row(peak_gb=1.0))
    with pytest.raises(ValueError, match="crashed"):
        results.check_row(_row(status="crashed"))
    assert list(results.check_row(_row())) == list(results.COLUMNS)


def test_every_memory_column_names_its_unit() -> None:
    for name, _, definition in results.SCHEMA:
        if "peak" in name and "phase" not in name:
            assert name.endswith("_gib") and "GiB" in definition, name


def test_parquet_carries_schema_version_and_definitions(tmp_path: Path) -> None:
    path = tmp_path / "run.parquet"
    results.write_parquet([_row(device="cpu", tokens_per_s=10.0)], path)
    meta = pq.read_schema(path).metadata
    assert meta[b"bench.schema_version"] == str(results.SCHEMA_VERSION).encode()
    assert b"peak_reserved_gib" in meta[b"bench.schema"]
    assert pq.read_table(path).column_names == list(results.COLUMNS)


def test_mfu_is_derived_from_the_gpu_name() -> None:
    row = _row(device="cuda", gpu_name="NVIDIA H100 80GB HBM3", tokens_per_s=10_000.0, flops_per_token=2e10)
    assert results.derive(row)["mfu"] == pytest.approx(2e14 / 989e12)
    assert results.derive({**row, "gpu_name": "NVIDIA H100 PCIe"})["mfu"] == pytest.approx(2e14 / 756e12)
    assert results.derive({**row, "gpu_name": "Some Future GPU"}).get("mfu") is None
    assert results.derive({**row, "device": "cpu"}).get("mfu") is None


def test_a_mixture_of_experts_counts_the_flops_of_the_experts_a_token_runs(tmp_path: Path) -> None:
    """A token runs num_experts_per_tok of a layer's experts: tiny OLMoE routing each token to 2 of 8
    experts counts what it counts with 2 experts of 2 (every expert run), less the larger router's
    matmul; a dense model (tiny-llama) counts every parameter but the input embedding."""
    import json

    import torch

    from bench import models

    def meta_model(name: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(models.hf_config(models.get(name), "sdpa"))

    config = {**models.get("tiny-olmoe").hf_fields, "num_experts": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    every_expert = meta_model(models.register_file(tmp_path / "config.json"))
    routed = meta_model("tiny-olmoe")
    hidden, layers, router_extra = config["hidden_size"], config["num_hidden_layers"], 8 - 2
    assert measure.flops_per_token(routed, 64) == measure.flops_per_token(every_expert, 64) + 6 * router_extra * hidden * layers
    llama = meta_model("tiny-llama")
    matmul_params = sum(p.numel() for p in llama.parameters()) - llama.get_input_embeddings().weight.numel()
    dense = models.get("tiny-llama").hf_fields
    attention = 12 * dense["num_hidden_layers"] * dense["num_attention_heads"] * dense["head_dim"] * 64
    assert measure.flops_per_token(llama, 64) == 6 * matmul_params + attention


def test_flops_per_token_sums_attention_over_a_heterogeneous_configs_layers(tmp_path: Path) -> None:
    """Gemma 4's layers differ in head_dim (its config's per_layer_config): reading one global head_dim raises, so the
    attention term is each layer's own; a config whose tying is not a `tie_word_embeddings` flag (Inkling's) counts
    the head by its weight being the embedding's."""
    import json
    import sys

    import torch

    from bench import models
    from conftest import REPO

    sys.path[:0] = [str(REPO / "tools")]
    from model_types import shrunk

    config = shrunk("gemma4_text")
    (tmp_path / "config.json").write_text(json.dumps(config))
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(models.hf_config(models.get(models.register_file(
            tmp_path / "config.json")), "sdpa"))
    layers = list(model.config.per_layer_config)
    assert len({layer.head_dim for layer in layers}) == 2  # the shrunk config keeps a layer of each kind
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    matmul_params = sum(p.numel() for p in model.parameters()) - embedding.numel() + (embedding.numel() if tied else 0)
    attention = sum(12 * layer.num_attention_heads * layer.head_dim * 64 for layer in layers)
    assert measure.flops_per_token(model, 64) == 6 * matmul_params + attention


def test_step_time_stats() -> None:
    stats = measure.step_time_stats([0.1, 0.1, 0.1, 0.1])
    assert stats["step_ms_p50"] == pytest.approx(100.0) and stats["step_time_cv"] == pytest.approx(0.0)
    spread = measure.step_time_stats([0.1, 0.2, 0.3])
    assert spread["step_ms_p10"] < spread["step_ms_p50"] < spread["step_ms_p90"]


def test_repeats_fold_into_one_row_per_cell() -> None:
    import pandas as pd

    frame = pd.DataFrame([
        {"cell_id": "a", "repeat": r, "status": "ok", "device": "cuda", "tokens_per_s": tps,
         **dict.fromkeys(results.MEMORY_COLUMNS, 1.0),
         "peak_allocated_gib": alloc}
        for r, tps, alloc in ((0, 100.0, 10.0), (1, 110.0, 10.1), (2, 90.0, 10.0))
    ] + [{"cell_id": "b", "repeat": None, "status": "oom", "device": "cuda", "tokens_per_s": None,
          **dict.fromkeys(results.MEMORY_COLUMNS)}])
    cells = views.by_cell(frame).set_index("cell_id")
    assert cells.loc["a", "repeats"] == 3 and cells.loc["a", "tokens_per_s"] == 100.0
    assert cells.loc["a", "peak_allocated_gib"] == 10.1
    assert cells.loc["a", "peak_spread"] == pytest.approx(0.01)
    assert cells.loc["a", "tokens_per_s_cv"] == pytest.approx(pd.Series([100.0, 110.0, 90.0]).std(ddof=0) / 100)
    assert cells.loc["b", "repeats"] == 0 and cells.loc["b", "status"] == "oom"


def test_tables_of_an_older_schema_stay_readable(tmp_path: Path) -> None:
    import pandas as pd

    path = tmp_path / "old.parquet"
    old = {"schema_version": 4, "run_id": "r", "cell_id": "c", "status": "ok", "device": "cuda",
           "tokens_per_s": 1000.0, "tokens_per_step": 4096}
    pd.DataFrame([old]).to_parquet(path)
    frame = results.read_parquet(path)
    assert list(frame.columns) == list(results.COLUMNS)
    assert frame["checkpoint"].isna().all()
    # Columns of schema 5, derived for rows that predate it: one rank, full rows, every token useful.
    row = frame.iloc[0]
    assert row["gpus"] == 1 and row["useful_tokens_per_s"] == row["tokens_per_s_per_gpu"] == 1000.0


def _predicted(cell_id: str, status: str = "ok", **extra: object) -> dict:
    return {"schema_version": results.PREDICTED.version, "run_id": "p", "cell_id": cell_id, "status": status, **extra}


def test_a_predicted_table_read_whole_columns_at_a_time_is_what_its_rows_make(tmp_path: Path) -> None:
    """A predicted table is converted a column at a time: an older one (columns missing) reads as `to_frame`
    makes its rows, of the cells asked for, in the current schema's dtypes; a column outside the schema or a
    status outside its statuses is refused as a row of it would be."""
    import pandas as pd

    rows = [_predicted("a", peak_allocated_gib=1.5, gpus=2, fits=True), _predicted("b", "skipped", skip_reason="no"),
            _predicted("c", peak_allocated_gib=None, gpus=None)]
    old = tmp_path / "old.parquet"
    pd.DataFrame(rows).to_parquet(old)  # written before most of today's columns existed, NaN and None in them
    assert results.read_parquet(old, results.PREDICTED).equals(results.to_frame(rows, results.PREDICTED))
    some = results.read_parquet(old, results.PREDICTED, cell_ids=["c", "a"])
    assert some.equals(results.to_frame([rows[0], rows[2]], results.PREDICTED))
    assert list(some.index) == [0, 1] and str(some["gpus"].dtype) == "Int64" and str(some["fits"].dtype) == "boolean"

    pd.DataFrame([_predicted("a", not_a_column=1)]).to_parquet(tmp_path / "extra.parquet")
    with pytest.raises(KeyError, match="not_a_column"):
        results.read_parquet(tmp_path / "extra.parquet", results.PREDICTED)
    pd.DataFrame([_predicted("a"), _predicted("b", "exploded")]).to_parquet(tmp_path / "status.parquet")
    with pytest.raises(ValueError, match="'exploded'"):
        results.read_parquet(tmp_path / "status.parquet", results.PREDICTED)


def test_an_older_predicted_table_gains_the_host_it_was_judged_against_from_its_rerun_command(tmp_path: Path) -> None:
    """Schema 13 records host_memory_gib; a table written before it has the flag in each row's rerun_cmd, and
    only where it was given: a row predicted without it, or one with nothing on the host to judge, stays empty."""
    import pandas as pd

    cmd = "python -m bench predict m --gpu h100 --run-id p --only '{}' --redo"
    rows = [_predicted("a", host_fits=False, rerun_cmd=cmd.format("a") + " --host-memory-gib 128"),
            _predicted("b", host_fits=True, rerun_cmd=cmd.format("b") + " --gpu-memory-gib 40 --host-memory-gib 7.5"),
            _predicted("c", rerun_cmd=cmd.format("c") + " --host-memory-gib 128"),  # no offload: nothing judged
            _predicted("d", rerun_cmd=cmd.format("d")), _predicted("e")]
    old = tmp_path / "old.parquet"
    pd.DataFrame(rows).to_parquet(old)
    assert results.read_parquet(old, results.PREDICTED)["host_memory_gib"].tolist() == [128.0, 7.5, pd.NA, pd.NA, pd.NA]
    new = tmp_path / "new.parquet"  # a recorded column is read as written, not from the command
    results.write_parquet([rows[0] | {"host_memory_gib": 64.0}], new, results.PREDICTED)
    assert results.read_parquet(new, results.PREDICTED).loc[0, "host_memory_gib"] == 64.0
    # a run resumed from its published table (`bench predict --only` adding cells) rewrites its rows: they keep the
    # host they were judged against (read in the current schema, as the reports read them; 2026-12-08, the coverage
    # baseline's 10 judged offload cells lost their 128 GiB to a resume)
    (tmp_path / "m" / "predicted").mkdir(parents=True)
    old.rename(tmp_path / "m" / "predicted" / "p.parquet")
    published = results.published_rows(tmp_path, "p", folder="predicted")
    assert [published[k].get("host_memory_gib") for k in "abcde"] == [128.0, 7.5, None, None, None]


def test_a_table_is_read_once_a_process_and_again_once_replaced(tmp_path: Path) -> None:
    """Every report reads every published table; a process reads a file once. A copy each time (a caller that
    changes its frame changes no one else's), and a table written since is read afresh."""
    path = tmp_path / "p.parquet"
    results.write_parquet([_predicted("a", peak_allocated_gib=1.0)], path, results.PREDICTED)
    first = results.read_parquet(path, results.PREDICTED)
    first.loc[0, "peak_allocated_gib"] = 99.0
    assert results.read_parquet(path, results.PREDICTED).loc[0, "peak_allocated_gib"] == 1.0
    results.write_parquet([_predicted("a", peak_allocated_gib=2.0), _predicted("b")], path, results.PREDICTED)
    assert list(results.read_parquet(path, results.PREDICTED)["peak_allocated_gib"].fillna(0)) == [2.0, 0.0]


def test_boards_state_coverage_spread_and_noise() -> None:
    """The published smoke run (CPU, noisy step times): the board says how much of the plan it covers
    and which stacks are missing, shows a noisy cell's CV, and calls no noise-sized change a finding."""
    from bench import report

    published = Path(__file__).resolve().parents[1] / "results" / "smoke" / "runs" / "smoke-cpu-20261122.parquet"
    frame = results.read_parquet(published)
    stacks = (*sorted(set(frame["stack"])), "gc + liger")
    board = report.leaderboard(frame, "cmd`", plan=report.Plan(36, stacks))
    assert "- Coverage: 30 of the 36 cells the matrix plans" in board
    assert "- Stacks not measured yet: `gc + liger`" in board
    assert "tok/s within noise (±" in board
    noisy = frame[frame["step_time_cv"] >= report.NOISY_CV]
    assert len(noisy) == 0 or f"(CV {noisy['step_time_cv'].iloc[0]:.0%})" in board


def test_merged_runs_keep_one_row_per_cell_a_measured_one_first_then_the_newest() -> None:
    def row(cell: str, status: str, day: int, run: str) -> dict:
        return {"cell_id": cell, "status": status, "started_at": f"2026-11-{day:02d}T00:00:00+00:00", "run": run}

    shard_a = {"x": row("x", "ok", 20, "a"), "y": row("y", "oom", 20, "a"), "z": row("z", "error", 20, "a")}
    rerun = {"x": row("x", "error", 22, "b"), "y": row("y", "ok", 21, "b"), "z": row("z", "timeout", 23, "b")}
    merged = {r["cell_id"]: r["run"] for r in results.merge_runs([shard_a, rerun])}
    assert merged == {"x": "a", "y": "b", "z": "b"}  # nothing measured is lost to a later failure
    assert {r["run"] for r in results.merge_runs([rerun, shard_a])} == {"a", "b"}  # order of the runs does not matter


def test_a_board_names_the_cells_whose_worker_held_a_cuda_context_before_them() -> None:
    """A worker started ahead that held a CUDA context while it waited put it in the running cell's NVML
    figures: the board says so, with the cells; a run without one says nothing."""
    from bench import report

    published = Path(__file__).resolve().parents[1] / "results" / "llama3b" / "runs" / "llama3b-h200-20261127.parquet"
    frame = results.read_parquet(published)
    assert "held a CUDA context" not in report.leaderboard(frame, "cmd")
    held = frame.assign(context_before_cell=[i == 2 for i in range(len(frame))])
    board = report.leaderboard(held, "cmd")
    assert "**1 worker(s) held a CUDA context before their cell**" in board
    assert f"`{frame['cell_id'].iloc[2]}`" in board.split("held a CUDA context")[1].splitlines()[0]


def test_a_boards_failure_table_keeps_a_reasons_pipes() -> None:
    """peft's hint names the targets that would do as `in_proj|x_proj`: the board's table of cells that did not
    run keeps them as written (escaped, one pipe to GitHub), not turned into another character a user copies."""
    from bench import report

    published = Path(__file__).resolve().parents[1] / "results" / "llama3b" / "runs" / "llama3b-h200-20261127.parquet"
    frame = results.read_parquet(published)
    hint = "peft cannot wrap these; targets=dt_proj|in_proj|x_proj would do"
    skipped = frame.assign(status=["skipped" if i == 0 else s for i, s in enumerate(frame["status"])],
                           skip_reason=[hint if i == 0 else s for i, s in enumerate(frame["skip_reason"])])
    cell = frame["cell_id"].iloc[0]
    rows = [line for line in report.leaderboard(skipped, "cmd").splitlines() if line.startswith(f"| `{cell}` |")]
    assert rows == [f"| `{cell}` | skipped | peft cannot wrap these; targets=dt_proj\\|in_proj\\|x_proj would do |"]


def test_a_board_says_whether_the_warm_up_steps_were_enough() -> None:
    """From each cell's step trace: the step after which reserved stopped growing (the H200 run: the second,
    in every cell) and, once steps carry their time, the last warm-up step against the measured median."""
    import json

    from bench import report

    published = Path(__file__).resolve().parents[1] / "results" / "llama3b" / "runs" / "llama3b-h200-20261127.parquet"
    frame = results.read_parquet(published)
    frame = frame[frame["git_sha"].str.startswith("d5e329b")].reset_index(drop=True)  # its first window's 11 cells
    board = report.leaderboard(frame, "cmd")
    assert "Reserved memory grew for the last time in step 2 at the latest (of 11 cells; median step 2)" in board
    assert "Warm-up:" not in board  # this run's steps carry no time

    def timed(trace: str, p50: float, slower: float) -> str:
        steps = json.loads(trace)
        return json.dumps([{**t, "ms": p50 * (slower if t["stage"] == "warmup" else 1)} for t in steps])

    pairs = zip(frame["step_trace_json"], frame["step_ms_p50"], strict=True)
    frame["step_trace_json"] = [timed(t, p50, 1.5 if i == 0 else 1.0) for i, (t, p50) in enumerate(pairs)]
    board = report.leaderboard(frame, "cmd")
    assert "the last warm-up step took 1.00× the measured median step (median over 11 cells; 1.00-1.50)" in board


def test_reporting_a_published_run_leaves_its_table_as_published(tmp_path: Path) -> None:
    """`bench report MATRIX --run-id R` of a run with no raw rows reads its published table and never
    rewrites it (written again, it would gain the schema's newer columns); raw rows, when there are some,
    are collected over it."""
    import io
    import json
    import shutil
    import subprocess
    import sys

    import pandas as pd

    repo = Path(__file__).resolve().parents[1]
    run_id = "smoke-cpu-20261122"
    runs = tmp_path / "smoke" / "runs"
    runs.mkdir(parents=True)
    table = runs / f"{run_id}.parquet"
    shutil.copy(repo / "results" / "smoke" / "runs" / table.name, table)
    published = table.read_bytes()

    def report() -> None:
        proc = subprocess.run([sys.executable, "-m", "bench", "--results-dir", str(tmp_path), "report", "smoke",
                               "--run-id", run_id], cwd=repo, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    report()
    assert table.read_bytes() == published and (runs / f"{run_id}.md").exists()

    first = json.loads(pd.read_parquet(table).iloc[[0]].to_json(orient="records"))[0]
    raw = tmp_path / "raw" / run_id
    raw.mkdir(parents=True)
    (raw / "new.json").write_text(json.dumps(first | {"cell_id": "tiny-llama_s256_b9_baseline", "batch_size": 9}))
    report()
    collected = pd.read_parquet(table)
    assert len(collected) == len(pd.read_parquet(io.BytesIO(published))) + 1
    assert "tiny-llama_s256_b9_baseline" in set(collected["cell_id"])
