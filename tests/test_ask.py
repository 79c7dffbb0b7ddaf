"""`bench ask`: one cell predicted on this CPU, its verdict on a card, beside the published GPU rows of
the same settings."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from bench import ask, cli, envinfo, fit, models, results
from bench.predict import gpus
from bench.predict import report as predict_report
from bench.predict import runner as predict_runner

REPO = Path(__file__).resolve().parents[1]
H100 = gpus.GPUS["h100"]
sys.path[:0] = [str(REPO / "tools")]  # model_types: how a user's config.json of another architecture is shrunk


def _ask(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["--results-dir", str(tmp_path / "results"), "ask", *args])
    return code, capsys.readouterr().out


HERE = envinfo.versions()  # the releases this CPU predicts under


def _measured(cell_id: str, run_id: str, status: str, reserved: float | None, **settings: object) -> dict:
    return {"schema_version": results.SCHEMA_VERSION, "run_id": run_id, "cell_id": cell_id, "status": status,
            "device": "cuda", "gpu_name": H100.name, "peak_allocated_gib": 0.5, "peak_reserved_gib": reserved,
            "started_at": "2026-11-24T00:00:00+00:00", "torch_version": HERE["torch"],
            "transformers_version": HERE["transformers"], "peft_version": HERE["peft"], **settings}


def test_a_cell_is_predicted_judged_on_the_card_and_shown_beside_its_published_measurement(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    cell, _ = ask.cell_for(ask.Question("tiny-llama", 64, 2, "gc"))
    same = {"model": "tiny-llama", "seq_len": 64, "batch_size": 2, "stack": "gc", "gpus": 1}
    results.write_parquet([
        _measured(cell.cell_id, "gpu-run", "ok", 0.75, **same, tokens_per_s=12345.6, step_ms_p50=10.37),
        _measured("other", "gpu-run", "ok", 9.0, **{**same, "batch_size": 4}),  # another batch: not this cell
        _measured("capped", "gpu-fit", "oom", None, **same, budget_gib=0.1),  # a fit probe under a cap: not it
    ], tmp_path / "results" / "m" / "runs" / "gpu-run.parquet")

    code, out = _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", "--batch", "2", "--stack", "gc")
    assert code == 0, out
    assert f"cell {cell.cell_id}" in out and "a prediction, not a measurement" in out
    assert "verdict: fits" in out and "GiB to spare on the card" in out and "smallest card" in out
    assert "measured: ok on NVIDIA H100 80GB HBM3, run gpu-run" in out and "reserved 0.75 GiB" in out
    assert "; 12,346 tokens/s, step 10 ms (median)" in out  # what it cost where a GPU ran it
    assert re.search(r"compute +\d+\.\d\d TFLOP a step: the matmuls and attention", out)  # counted, not timed
    assert out.count("measured:") == 1  # neither the other batch nor the capped probe
    assert f"under torch {HERE['torch'].split('+')[0]}, transformers {HERE['transformers']}" in out
    assert "measured under other releases" not in out and "since fixed" not in out
    # a row measured under the suite's code as it was (PREDICTION.md lists them): said beneath it
    monkeypatch.setattr(predict_report, "MEASURED_UNDER_OLD_CODE", {("gpu-run", cell.cell_id): "a hook as it was"})
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", "--batch", "2", "--stack", "gc")
    assert "reserved 0.75 GiB" in out and "under the suite's code as it was, since fixed: a hook as it was" in out
    monkeypatch.undo()

    older = {**same, "torch_version": "2.0.1", "transformers_version": "4.40.0", "peft_version": "0.10.0"}  # no venv's
    results.write_parquet([_measured(cell.cell_id, "older-gpu-run", "ok", 0.8, **older)],
                          tmp_path / "results" / "m" / "runs" / "older-gpu-run.parquet")
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", "--batch", "2", "--stack", "gc")
    assert "run older-gpu-run (torch 2.0.1, transformers 4.40.0, peft 0.10.0)" in out
    assert "measured under other releases than predicted here" in out

    code, out = _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", "--batch", "2", "--stack", "gc", "--json")
    answer = json.loads(out)
    assert answer["verdict"] == "fits" and answer["predicted"]["fits"] is True
    assert answer["predicted"]["prediction_method"].startswith("fake-run/")
    assert [r["run_id"] for r in answer["measured"]] == ["gpu-run", "older-gpu-run"]


def test_a_compiled_stack_says_how_many_graphs_dynamo_made(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torch.compile's evidence from the fake run (the graphs dynamo compiled, what they saved for backward), as a
    GPU run records it: said beside the prediction; a stack without compile says nothing of it."""
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", "--batch", "2", "--stack", "compile")
    assert code == 0, out
    assert re.search(r"compiled +1 graph \(dynamo\), \d+\.\d\d GiB saved for backward", out), out
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", "--batch", "2", "--stack", "gc")
    assert "compiled " not in out


def test_a_card_too_small_is_exit_1_and_a_stack_the_fake_run_cannot_see_is_exit_3(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", "--gpu-memory-gib", "0.01")
    assert code == 1 and "verdict: does not fit: the smallest card it runs on has" in out
    assert "measured: no published GPU run has this cell" in out
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", "--stack", "unsloth")
    assert code == 3 and "not predicted (unsupported): unsloth:" in out
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", "--gpu-memory-gib", "0.01",
                     "--stack", "garbage_collection_threshold")  # its smallest card needs a memory fraction
    assert code == 1 and "and only under a memory fraction (torch.cuda.set_per_process_memory_fraction)" in out


def test_any_models_config_json_can_be_asked_about(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A hub model's config.json, downloaded alone, is a model: named after its folder."""
    folder = tmp_path / "My-Llama"
    folder.mkdir()
    config = {**models.get("tiny-llama").hf_fields, "torch_dtype": "bfloat16", "transformers_version": "4.51.0"}
    (folder / "config.json").write_text(json.dumps(config))
    code, out = _ask(tmp_path, capsys, str(folder / "config.json"), "--seq", "64", "--stack", "lora")
    assert code == 0, out
    assert out.startswith("My-Llama, seq 64, batch 1, stack lora, 1 GPU") and "verdict: fits" in out


# Architectures unlike the registry's, as a user's config.json would bring them: transformers' own defaults for the
# model type, shrunk to a few layers and narrow widths (tools/model_types.py, which asks about every one)
_ARCHITECTURES = {
    # multi-head latent attention (as many key heads as query heads; its head_dim the rope's) and routed experts
    "deepseek_v3": ("mixed", {"head_dim": 32, "num_key_value_heads": 4}),  # fp32 experts: CUDA's grouped-mm fallback
    "qwen3_next": ("gc + lora", {}),  # gated DeltaNet linear attention beside full attention layers, experts
    "falcon_h1": ("gc", {}),  # Mamba-2 mixers beside attention (LoRA: peft refuses the Mamba projections, below)
    "gpt_oss": ("eager_attention + lora", {}),  # attention sinks: no sdpa in transformers, so eager
    "gemma3_text": ("gc", {}),  # sliding-window layers beside global ones
}


@pytest.mark.parametrize("model_type", sorted(_ARCHITECTURES))
def test_architectures_unlike_llama_are_predicted_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        model_type: str) -> None:
    """`bench ask` on a config.json of an architecture the registry lacks predicts its step, and the step holds the
    whole model: the weights at the peak are the parameters' bytes (bf16, fp32 under mixed; LoRA's adapters fp32),
    AdamW's two moments twice the weights where every parameter trains. Of 37 causal-LM model types of transformers
    5.24 tried so on 2026-11-30, every one was predicted (gemma2 and gpt_oss with eager attention, as the answer
    without it says; DeepSeek-V3, Qwen3-MoE and Qwen3-Next under `mixed` since fake-run/27)."""
    from model_types import shrunk  # tools/

    stack, extra = _ARCHITECTURES[model_type]
    path = tmp_path / model_type / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(shrunk(model_type, extra)))
    code, out = _ask(tmp_path, capsys, str(path), "--seq", "128", "--stack", stack, "--json")
    row = json.loads(out)["predicted"]
    assert code == 0 and row["status"] == "ok", out
    weights_bytes = row["at_peak_weights_gib"] * 2**30
    adapters = row["trainable_params"] if "lora" in stack else 0  # peft makes LoRA's adapters fp32
    base_bytes = 4 if stack == "mixed" else 2  # mixed precision keeps fp32 weights
    assert weights_bytes == pytest.approx(base_bytes * (row["total_params"] - adapters) + 4 * adapters, rel=0.002)
    if stack == "gc":  # every parameter trained, its AdamW moments bf16 like it
        assert row["at_peak_optimizer_state_gib"] * 2**30 == pytest.approx(2 * weights_bytes, rel=0.01)


def test_a_model_transformers_cannot_checkpoint_is_skipped_with_gc_saying_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CTRL's model class does not support activation checkpointing: a gc stack is skipped at plan time, naming it,
    as a stack without sdpa is (enabling it would raise inside the fake run or the worker)."""
    from model_types import shrunk  # tools/

    path = tmp_path / "ctrl" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(shrunk("ctrl")))
    for stack in ("gc", "selective_gc"):
        row = json.loads(_ask(tmp_path, capsys, str(path), "--seq", "64", "--stack", stack, "--json")[1])["predicted"]
        assert row["status"] == "skipped", row
        assert row["skip_reason"].endswith("CTRLLMHeadModel does not support activation checkpointing in transformers "
                                           f"{__import__('transformers').__version__}")
    assert json.loads(_ask(tmp_path, capsys, str(path), "--seq", "64", "--json")[1])["predicted"]["status"] == "ok"


def test_lora_on_projections_peft_refuses_is_skipped_with_peft_s_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Falcon-H1's Mamba mixers: `all-linear` targets their projections, which peft refuses for Mamba models. Asked
    of peft on a meta build when planned, the answer is `skipped` with peft's reason, before any fake run, and names
    the targets peft takes instead (all-linear less the modules it names, tried on peft too): those are predicted."""
    from model_types import shrunk  # tools/

    path = tmp_path / "falcon_h1" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(shrunk("falcon_h1")))
    row = json.loads(_ask(tmp_path, capsys, str(path), "--seq", "64", "--stack", "gc + lora", "--json")[1])["predicted"]
    assert row["status"] == "skipped" and row["skip_reason"].startswith("lora: peft "), row
    assert "incompatible with Mamba-based models" in row["skip_reason"]
    hinted = row["skip_reason"].rsplit("; targets=", 1)[-1]
    assert hinted == "down_proj|gate_proj|in_proj|k_proj|o_proj|q_proj|up_proj|v_proj adapts every other linear layer"
    others = json.loads(_ask(tmp_path, capsys, str(path), "--seq", "64", "--stack",
                             f"gc + lora(targets={hinted.split()[0]})", "--json")[1])["predicted"]
    assert others["status"] == "ok", others
    # a model that does not build (MusicGen's config lacks what its class reads): asking peft cannot build it either,
    # and leaves it to the fake run, which records the build's error; the planning does not fail on it
    broken = tmp_path / "musicgen" / "config.json"
    broken.parent.mkdir()
    broken.write_text(json.dumps(shrunk("musicgen")))
    code, out = _ask(tmp_path, capsys, str(broken), "--seq", "64", "--stack", "lora", "--json")
    row = json.loads(out)["predicted"]
    assert code == 3 and row["status"] == "error" and "dropout" in row["error"], row


def test_a_model_whose_step_computes_on_its_datas_values_is_unsupported_saying_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """BLT groups bytes into patches by their values (aten.nonzero): fake tensors hold no values, so the answer is
    `unsupported` with that reason, not an error's traceback; nor does its config's nesting (no hidden_size at the
    top: no FLOP count, no MFU) fail the step."""
    from model_types import shrunk  # tools/

    path = tmp_path / "blt" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(shrunk("blt")))
    code, out = _ask(tmp_path, capsys, str(path), "--seq", "64", "--stack", "gc", "--json")
    row = json.loads(out)["predicted"]
    assert code == 3 and row["status"] == "unsupported", row
    assert row["unsupported_reason"].startswith("the step computes on its data's values (aten.nonzero.default at "
                                                "modeling_blt.py:"), row  # the model's line that asked


@pytest.mark.parametrize(("content", "message"), [
    ("not json", "not a readable config.json"),
    ('{"hidden_size": 8}', "a JSON object with a 'model_type'"),
    ('{"model_type": "no_such_model_type"}', "transformers cannot build this config: Unrecognized model identifier"),
    ('{"model_type": "qwen3", "num_hidden_layers": 2, "layer_types": ["full_attention", "full_attention", '
     '"full_attention"]}', "transformers cannot build this config: `num_hidden_layers` (2) must be equal to the number "
     "of `layer_types` (3)"),  # transformers' validators raise huggingface_hub's own error, no ValueError
    ('{"model_type": "llama", "quantization_config": {"quant_method": "fp8"}}',
     "the config of a pre-quantized checkpoint (quantization_config, quant_method 'fp8')"),
    ('{"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}, "vision_config": {}}',
     "a multimodal model's config (model_type 'gemma3' with a text_config)"),
])
def test_a_config_file_that_is_not_a_model_is_exit_2_naming_the_problem(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    assert cli.main(["--results-dir", str(tmp_path), "ask", str(path), "--seq", "64"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err) < 500  # not transformers' list of every model type


@pytest.mark.parametrize("args", [["nosuch", "--seq", "64"], ["tiny-llama", "--seq", "0"],
                                  ["tiny-llama", "--seq", "64", "--stack", "gc + nosuch"],
                                  ["tiny-llama", "--seq", "64", "--checkpoint", "half"],
                                  ["tiny-llama", "--seq", "64", "--gpu", "v100"],
                                  ["tiny-llama", "--seq", "64", "--batch", "0"],
                                  ["tiny-llama"], ["tiny-llama", "--largest", "batch"],
                                  ["tiny-llama", "--largest", "batch", "--seq", "64", "--batch", "2"],
                                  ["tiny-llama", "--largest", "seq", "--seq", "64"],
                                  ["tiny-llama", "--largest", "seq", "--gpu", "a100"],
                                  ["tiny-llama", "--largest", "seq", "--seq-step", "512", "--max-seq", "256"],
                                  ["tiny-llama", "--seq", "64", "--outside-torch-gib", "-1"],
                                  ["tiny-llama", "--seq", "64", "--gpu", "a100", "--gpu-memory-gib", "1",
                                   "--outside-torch-gib", "1"]])
def test_bad_questions_are_exit_2_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       args: list[str]) -> None:
    assert cli.main(["--results-dir", str(tmp_path), "ask", *args]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def _answer(card: gpus.GpuKind = H100, **predicted: object) -> ask.Answer:
    cell, _ = ask.cell_for(ask.Question("tiny-llama", 64, 1))
    return ask.Answer(cell, card, {"status": "ok", "peak_allocated_gib": 10.0, **predicted}, ())


def test_the_verdict_follows_the_card_then_the_host_and_says_when_it_cannot_judge() -> None:
    assert _answer(fits=True).verdict == "fits"
    assert _answer(fits=False).verdict == "does not fit"
    assert _answer(fits=True, host_fits=False).verdict == "host_oom"
    host_oom = _answer(fits=True, peak_phase="measure/backward", predict_s=1.0, peak_reserved_gib=11.0,
                       host_peak_gib=130.0, **predict_runner.judged({"host_peak_gib": 130.0}, None, 128.0))
    assert host_oom.predicted["host_fits"] is False and host_oom.predicted["host_memory_gib"] == 128.0
    assert "host_oom: the host needs 130.00 GiB of RAM, more than its 128 GiB" in ask.text(host_oom)
    assert _answer(status="unsupported").verdict == "not predicted"
    unmeasured = gpus.GpuKind("x", "a card whose context is not measured", (8, 9), memory_gib=24.0)
    assert _answer(unmeasured).verdict == "not judged"  # reserved + an unknown context
    assert _answer(unmeasured, peak_allocated_gib=30.0).verdict == "does not fit"  # live tensors alone exceed it
    # torch's least need, its allocator releasing its cache and retrying, above the card: whatever its context takes
    over = _answer(unmeasured, peak_phase="measure/backward", predict_s=1.0, peak_reserved_gib=27.0, least_torch_gib=24.5)
    assert over.verdict == "does not fit"
    assert "does not fit: torch alone needs 24.50 GiB, its allocator releasing its cache" in ask.text(over)
    # within the card: how much the unmeasured context may take (the card less torch's least need, not its peak)
    under = _answer(unmeasured, peak_phase="measure/backward", predict_s=1.0, peak_reserved_gib=27.0,
                    least_torch_gib=21.25)
    assert under.verdict == "not judged"
    assert "it fits if the CUDA context and libraries take under 2.75 GiB of the card" in ask.text(under)


def test_a_card_whose_context_is_not_measured_is_judged_with_the_askers_context(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--outside-torch-gib: the whole device and the verdict on a card whose context is not measured, said to be
    the asker's figure; without it, the same card is not judged."""
    question = ["--results-dir", str(tmp_path), "ask", "tiny-llama", "--seq", "64", "--gpu", "a100",
                "--gpu-memory-gib", "1", "--json"]
    assert cli.main(question) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "not judged"
    assert cli.main([*question, "--outside-torch-gib", "0.5"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert (found["verdict"], found["outside_torch_gib"]) == ("fits", 0.5)
    assert found["predicted"]["device_peak_gib"] == pytest.approx(found["predicted"]["peak_reserved_gib"] + 0.5)
    assert cli.main([*question[:-1], "--outside-torch-gib", "0.99"]) == 1  # torch's 0.02 GiB no longer fits
    assert "outside torch (CUDA context), as given (--outside-torch-gib), not measured here" in capsys.readouterr().out


def test_a_paged_optimizers_managed_state_is_said_apart_from_what_torch_reserves() -> None:
    """device_peak_gib = peak reserved + what lives outside torch + CUDA managed memory: the last is a paged
    optimizer's state, said on its own line (bitsandbytes may page it out); none for another stack."""
    assert H100.outside_torch_gib is not None
    row = {"peak_phase": "measure/backward", "peak_reserved_gib": 12.0, "predict_s": 1.0, "fits": True}
    paged = ask.text(_answer(**row, device_peak_gib=12.0 + H100.outside_torch_gib + 3.25))
    assert "paged state         3.25 GiB  a paged optimizer's state in CUDA managed memory" in paged
    plain = ask.text(_answer(**row, device_peak_gib=12.0 + H100.outside_torch_gib))
    assert "paged state" not in plain and "whole device" in plain


def test_an_answer_says_how_many_parameters_the_stack_trains() -> None:
    """LoRA on every linear layer of a mixture of experts adapts each expert: the count shows it."""
    row = {"peak_phase": "measure/backward", "peak_reserved_gib": 12.0, "predict_s": 1.0, "fits": True}
    lora = ask.text(_answer(**row, trainable_params=189_284_352))
    assert "  trainable          189.3 M parameters, each with its gradient and optimizer state" in lora
    assert "  trainable           6.92 B parameters" in ask.text(_answer(**row, trainable_params=6_919_161_856))
    assert "trainable " not in ask.text(_answer(**row))  # not known: no line


def test_an_answer_gives_the_record_of_the_cells_predicted_as_it_is_and_warns_where_its_worst_miss_exceeds_the_spare(
        tmp_path: Path) -> None:
    """The record: the published GPU cells predicted by the same method, with offload or without as the
    answer, each one's peak reserved error. From the H200's published run and its predictions: the ZeRO
    cells with offload apart from those without. A "fits" whose spare GiB a miss as large as the record's
    worst under-prediction would take says so; one with room to spare does not."""
    import shutil

    from bench.predict import report as predict_report

    for folder, table in (("runs", "llama3b-h200-20261127"), ("predicted", "llama3b-predicted-h200-torch211-20261128")):
        (tmp_path / "llama3b" / folder).mkdir(parents=True)
        shutil.copy(REPO / "results" / "llama3b" / folder / f"{table}.parquet", tmp_path / "llama3b" / folder)
    both = predict_report.checked(tmp_path)
    zero = both[both["prediction_method"].str.startswith("hybrid")]
    offloaded = zero[zero["stack"].str.contains("offload")]
    assert 0 < len(offloaded) < len(zero)  # both kinds published
    with_offload = predict_report.record(tmp_path, "hybrid/18", 1, offload=True)
    assert "ZeRO, hybrid" in with_offload.kind and with_offload.kind.endswith("with offload")
    assert sorted(with_offload.reserved_errors) == sorted(offloaded["reserved_error_frac"])
    assert len(predict_report.record(tmp_path, "hybrid/18", 1, offload=False).reserved_errors) == len(zero) - len(offloaded)
    assert predict_report.record(tmp_path, "fake-run/10", 8, offload=False).reserved_errors == ()  # no 8-GPU cell
    assert with_offload.reserved_errors_before_run == ()  # these predictions were made after the GPU ran the cells
    assert with_offload.models == ("llama-3.2-3b",) and with_offload.gpus == (1,)  # the cells behind the record
    early = pd.read_parquet(tmp_path / "llama3b" / "predicted" / "llama3b-predicted-h200-torch211-20261128.parquet")
    early = early.assign(run_id="early", started_at="2000-01-01T00:00:00+00:00",
                         peak_reserved_gib=early["peak_reserved_gib"] * 1.1)  # 10% over what the newer ones say
    early.to_parquet(tmp_path / "llama3b" / "predicted" / "early.parquet")
    before = predict_report.record(tmp_path, "hybrid/18", 1, offload=True)
    assert before.reserved_errors == with_offload.reserved_errors  # the newest predictions, as before
    expected = (offloaded["peak_reserved_gib_predicted"] * 1.1 - offloaded["peak_reserved_gib"]) / offloaded["peak_reserved_gib"]
    assert sorted(before.reserved_errors_before_run) == pytest.approx(sorted(expected))

    record = predict_report.Record("ZeRO, hybrid, with offload", (-0.0623, 0.0319))
    row = {"peak_phase": "measure/backward", "peak_reserved_gib": 15.53, "predict_s": 1.0, "fits": True}
    tight = ask.text(replace(_answer(**row, headroom_gib=0.5), record=record))
    assert ("its kind's record: peak reserved predicted -6.23% to +3.19% of measured on the 2 published GPU cells "
            "predicted as this one (ZeRO, hybrid, with offload; results/PREDICTION.md); a miss as large as its worst "
            "would need 1.03 GiB more here, over the 0.50 GiB to spare: measure before relying on it") in tight
    roomy = ask.text(replace(_answer(**row, headroom_gib=5.0), record=record))
    assert "its kind's record" in roomy and "measure before relying on it" not in roomy
    earlier = ask.text(replace(_answer(**row, headroom_gib=5.0), record=replace(record, reserved_errors_before_run=(
        -0.0569, 0.0319, -0.0623))))
    assert ("(ZeRO, hybrid, with offload; results/PREDICTION.md); predicted before a GPU ran them, by the methods of the "
            "time: -6.23% to +3.19% on 3") in earlier
    unchecked = ask.text(replace(_answer(**row, headroom_gib=5.0), record=predict_report.Record("k", ())))
    assert "no published GPU cell predicted as this one (k) checks it yet" in unchecked


def test_a_record_of_other_architectures_or_ranks_says_this_ones_predictions_are_not_checked_on_a_gpu() -> None:
    """The record names its cells' models; an answer for a model whose architecture (config model_type) none
    of them has says that the record does not speak for it, one of the same architecture does not; and so for
    a cell on more ranks than any of the record's ran on."""
    from bench.predict import report as predict_report

    record = predict_report.Record("one rank, fake run, without offload", (-0.0006, 0.0024),
                                   models=("llama-3.2-1b", "llama-3.2-3b"))
    row = {"peak_phase": "measure/backward", "peak_reserved_gib": 1.0, "predict_s": 1.0, "fits": True}
    llama = ask.text(replace(_answer(**row), record=record))
    assert "(one rank, fake run, without offload; llama-3.2-1b, llama-3.2-3b; results/PREDICTION.md)" in llama
    assert "none of those cells" not in llama
    cell, _ = ask.cell_for(ask.Question("tiny-qwen2", 64, 1))
    qwen = ask.text(replace(_answer(**row), cell=cell, record=record))
    assert ("none of those cells has this model's architecture (model_type qwen2; theirs: llama): how predictions of "
            "it fare on a GPU is not measured yet") in qwen
    assert "ran on" not in qwen  # the record's ranks unknown: nothing said of them
    one_gpu = replace(record, gpus=(1,))
    assert "none of those cells ran on" not in ask.text(replace(_answer(**row), record=one_gpu))
    eight, _ = ask.cell_for(ask.Question("tiny-llama", 64, 1, "zero3", gpus=8))
    assert ("none of those cells ran on 8 GPUs (theirs: 1): how predictions at this many ranks fare is not measured "
            "yet") in ask.text(replace(_answer(**row), cell=eight, record=one_gpu))
    # and for a technique none of them used: its own ops (an optimizer's step) are not checked by theirs
    used = replace(record, techniques=("gc", "lora"))
    adafactor, _ = ask.cell_for(ask.Question("tiny-llama", 64, 1, "gc + adafactor"))
    assert ("none of those cells used adafactor: how predictions of its own ops fare on a GPU is not measured "
            "yet") in ask.text(replace(_answer(**row), cell=adafactor, record=used))
    gc, _ = ask.cell_for(ask.Question("tiny-llama", 64, 1, "gc"))
    assert "none of those cells used" not in ask.text(replace(_answer(**row), cell=gc, record=used))


def test_the_largest_batch_that_fits_is_the_last_whose_own_answer_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--largest batch: the search's answer agrees with asking its two sides one by one (fits, then does
    not), in fewer fake runs than bisecting 64 candidates would take twice over."""
    card = ["--seq", "256", "--gpu-memory-gib", "0.9"]
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--largest", "batch", *card, "--json")
    found = json.loads(out)
    largest = found["largest_ok"]
    assert code == 0 and found["verdict"] == "fits" and 1 < largest < 64, out
    assert found["smallest_not_fitting"] == largest + 1 and len(found["probes"]) < 12
    assert found["predicted"][str(largest)]["fits"] is True and found["predicted"][str(largest + 1)]["fits"] is False
    assert _ask(tmp_path, capsys, "tiny-llama", "--batch", str(largest), *card)[0] == 0
    assert _ask(tmp_path, capsys, "tiny-llama", "--batch", str(largest + 1), *card)[0] == 1
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--largest", "batch", *card)
    assert f"largest batch that fits (predicted, not measured): {largest}, batch {largest + 1} does not fit" in out


def test_the_longest_sequence_search_stops_on_a_stack_the_fake_run_cannot_see(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--largest", "seq", "--stack", "unsloth", "--gpu-memory-gib", "1")
    assert code == 3 and "the search stopped at 65536: not predicted (unsupported): unsloth:" in out


def test_the_largest_search_says_when_a_size_failed_below_one_that_fits() -> None:
    """Predicted reserved memory is not always monotone in the size: the answer says what the search saw."""
    def sized(fits: bool, least: float) -> ask.Answer:
        return _answer(fits=fits, least_card_gib=least, device_peak_gib=least, predict_s=1.0)

    answers = {4: sized(True, 23.0), 5: sized(False, 24.5), 6: sized(True, 23.9), 7: sized(False, 25.0)}
    found = ask.Largest(ask.Question("tiny-llama", 64, 1), "batch", fit.Frontier(6, 7, (4, 7, 6, 5)), answers)
    text = ask.largest_text(found)
    assert "largest batch that fits (predicted, not measured): 6, batch 7 does not fit" in text
    assert "not monotone: 5 (24.50 GiB) not fitting, below 6 (23.90 GiB) fitting" in text
    del answers[5]
    assert "not monotone" not in ask.largest_text(found)
    # the answer's cost, where its step is timed (bench/predict/steptime.py): tokens/s at the largest that fits only
    work = {"step_tflop": 1.0, "step_ops": 1000, "step_kernels": 800, "step_compute_tflop": 1.0, "step_memory_gb": 10.0}
    answers[6] = replace(answers[6], predicted={**answers[6].predicted, **work})
    answers[7] = replace(answers[7], predicted={**answers[7].predicted, **work})
    ms = ask.predicted_step_ms(answers[6])
    assert ms is not None and f"batch 6: fits, peak allocated 10.00 GiB, whole device 23.90 GiB, smallest card 23.90 GiB, " \
        f"{ask.tokens_per_s(answers[6], ms):,.0f} tokens/s (step {ms:.0f} ms)" in ask.largest_text(found)
    assert "batch 7: does not fit, peak allocated 10.00 GiB, whole device 25.00 GiB, smallest card 25.00 GiB\n" in \
        ask.largest_text(found)


def test_a_zero_cell_is_answered_as_a_hybrid_with_its_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ZeRO cell's prediction is a hybrid (bench/predict/hybrid.py): it names what its peak is made of
    instead of a per-role breakdown it does not have, and its host RAM as DeepSpeed's offloaded states."""
    pytest.importorskip("deepspeed")
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", "--stack", "gc + zero3 + offload(params=true)")
    assert code == 0, out
    assert "(hybrid/" in out and "DeepSpeed's model states as its engine makes them (its bucket 0.93 GiB)" in out
    assert "weights 0.00" not in out
    assert "DeepSpeed's offloaded states (pinned and pageable) and worker processes" in out


def test_a_fake_run_command_quiets_the_import_warnings_of_kernels_it_never_calls(caplog: pytest.LogCaptureFixture) -> None:
    """`bench ask`, `predict` and `fit --predict` quiet the warnings optional libraries log as a fake run imports them
    (bitsandbytes' missing CPU kernel, torchao's CUDA extensions on a CPU), and peft's use of an API transformers
    deprecates: they came first in every answer. Their errors, and other deprecations, still show."""
    loggers = [logging.getLogger(name) for name in cli.IMPORT_NOISE]
    levels = [logger.level for logger in loggers]
    try:
        cli._fake_runs_ahead()
        if importlib.util.find_spec("deepspeed"):  # it sets its logger's level as it is imported, after the call
            from deepspeed.utils import logger as deepspeed_logger

            deepspeed_logger.setLevel(logging.INFO)
            assert deepspeed_logger is logging.getLogger("DeepSpeed")
            assert not deepspeed_logger.filter(deepspeed_logger.makeRecord(
                "DeepSpeed", logging.WARNING, __file__, 0, "Setting accelerator to CPU.", (), None))
        with caplog.at_level(logging.WARNING):
            for logger in loggers:
                logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community")
            logging.getLogger("torchao").error("an error still shows")
        assert [record.getMessage() for record in caplog.records] == ["an error still shows"]
        with warnings.catch_warnings(record=True) as shown:  # the filters it adds go with this block
            warnings.simplefilter("always")
            cli._fake_runs_ahead()
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning, stacklevel=1)
            warnings.warn("another library's deprecation", FutureWarning, stacklevel=1)
        assert [str(w.message) for w in shown] == ["another library's deprecation"]
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
            logger.removeFilter(cli._errors_only)


def test_several_stacks_are_one_table_in_the_order_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--stack` again: one fake run per stack, one row each in the order asked (a stack the fake run does not
    cover says why), which of them fit, and an exit code that is 0 when any fits, 1 when none does."""
    stacks = ["--stack", "gc + lora", "--stack", "unsloth", "--stack", "baseline"]
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", *stacks)
    assert code == 0, out
    rows = [line.split("  ")[0] for line in out.splitlines()[4:7]]
    assert rows == ["gc + lora", "unsloth", "baseline"]
    assert "unsloth: not predicted (unsupported): unsloth: Unsloth" in out
    assert "fits: gc + lora, baseline" in out
    single = json.loads(_ask(tmp_path, capsys, "tiny-llama", "--seq", "64", "--stack", "gc + lora", "--json")[1])
    table = out.splitlines()[4]
    assert f"{single['predicted']['peak_reserved_gib']:.2f}" in table  # the single answer's figures
    code, out = _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", *stacks, "--json")
    found = json.loads(out)
    assert [a["verdict"] for a in found["answers"]] == ["fits", "not predicted", "fits"] and found["verdict"] == "fits"
    # a card below the H100's context: nothing fits
    assert _ask(tmp_path, capsys, "tiny-llama", "--seq", "64", *stacks, "--gpu-memory-gib", "0.7")[0] == 1


def test_several_stacks_name_the_releases_of_a_stack_that_ran_when_the_first_was_skipped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DoRA on a mixture of experts' fused experts is refused by peft when planned (skipped, nothing ran): the
    header names the releases the next stack's fake run ran under, not "torch ?"."""
    import torch

    code, out = _ask(tmp_path, capsys, "tiny-olmoe", "--seq", "64", "--stack", "dora", "--stack", "lora")
    assert code == 0, out
    assert f"under torch {torch.__version__.split('+')[0]}, transformers " in out.splitlines()[1], out
    assert "dora: not predicted (skipped): dora: peft " in out and "use_dora=True" in out


def test_several_stacks_side_by_side_give_the_same_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--jobs 2: the fake runs in two spawned processes, each registering the config.json asked about (they do not
    share this process's registry); the table is the one a single process makes, rows in the order asked."""
    path = tmp_path / "my-model" / "config.json"
    path.parent.mkdir()
    path.write_text((models.CONFIG_DIR / "tiny-llama.json").read_text())
    args = [str(path), "--seq", "64", "--stack", "gc + lora", "--stack", "baseline", "--stack", "compile"]
    one_process = _ask(tmp_path, capsys, *args)
    assert one_process[0] == 0 and "my-model, seq 64" in one_process[1]
    assert _ask(tmp_path, capsys, *args, "--jobs", "2") == one_process


@pytest.mark.parametrize("args", [["--stack", "gc", "--stack", "gc + nosuch"],
                                  ["--stack", "gc", "--stack", "lora", "--largest", "batch"],
                                  ["--stack", "gc", "--jobs", "2"], ["--stack", "gc", "--stack", "lora", "--jobs", "0"]])
def test_several_stacks_are_checked_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          args: list[str]) -> None:
    assert cli.main(["--results-dir", str(tmp_path), "ask", "tiny-llama", "--seq", "64", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "gc:" not in err  # no stack was answered


def test_a_stacks_row_shows_what_a_gpu_of_this_kind_measured_or_how_it_ended() -> None:
    from bench import ask_stacks

    a = _answer(peak_reserved_gib=12.0)
    on = {"gpu_name": H100.name}
    assert ask_stacks.row(replace(a, measured=({**on, "status": "oom"},)))["measured_gib"] == "OOM"
    measured = ({**on, "status": "ok", "peak_reserved_gib": 31.06, "tokens_per_s": 15149.2},
                {**on, "status": "ok", "peak_reserved_gib": 31.2, "tokens_per_s": 15312.0},
                {"gpu_name": "NVIDIA H200", "status": "ok", "peak_reserved_gib": 40.0, "tokens_per_s": 9.0})  # not shown
    row = ask_stacks.row(replace(a, measured=measured))
    assert (row["measured_gib"], row["measured_tokens_per_s"]) == ("31.20", "15,149")  # the largest, the slowest
    assert ask_stacks.row(a)["measured_gib"] == "" and "measured_tokens_per_s" not in ask_stacks.row(a)
    assert ask_stacks.row(_answer(step_tflop=109.2575))["step_tflop"] == "109.26"  # counted compute, not time
    assert "step_tflop" not in ask_stacks.row(_answer(step_tflop=None))  # kernels the fake run cannot count


def test_a_stacks_row_gives_its_record_and_marks_a_fit_its_worst_miss_would_undo() -> None:
    """The record column: the range of the published errors of predictions made as this one was; a fit whose
    spare memory is smaller than that record's worst under-prediction, repeated here, is marked "fits*"."""
    from bench import ask_stacks
    from bench.predict import report as predict_report

    record = predict_report.Record("one rank, fake run, without offload", (-0.0306, 0.0024, 0.0))
    near = replace(_answer(fits=True, peak_reserved_gib=40.0, headroom_gib=1.0), record=record)
    row = ask_stacks.row(near)
    assert (row["verdict"], row["record"]) == ("fits*", "-3.06% to +0.24% (3)")  # 40 / (1 - 0.0306) - 40 = 1.26 GiB
    assert ask_stacks.row(replace(near, predicted={**near.predicted, "headroom_gib": 1.5}))["verdict"] == "fits"
    assert ask_stacks.row(replace(near, record=predict_report.Record("hybrid", ())))["record"] == "none yet"


def test_a_stacks_table_says_what_each_record_is_of_and_marks_a_row_none_of_its_cells_is_like() -> None:
    """Below the table, each record's cells (models, rank counts), once per kind; a row whose model's architecture
    or rank count none of its record's cells shares is marked "?": the record does not speak for it."""
    from bench import ask_stacks
    from bench.predict import report as predict_report

    one_rank = predict_report.Record("one rank, fake run, without offload", (-0.0006, 0.0024),
                                     models=("llama-3.2-1b", "llama-3.2-3b"), gpus=(1,))
    hybrid = predict_report.Record("hybrid, with offload", (-0.0427,), models=("llama-3.2-3b",), gpus=(1,))
    figures = {"peak_phase": "measure/backward", "peak_reserved_gib": 1.0, "predict_s": 1.0, "fits": True}
    llama = replace(_answer(**figures), record=one_rank)
    qwen_cell, _ = ask.cell_for(ask.Question("tiny-qwen2", 64, 1))
    qwen = replace(llama, cell=qwen_cell)
    assert ask_stacks.row(llama)["record"] == "-0.06% to +0.24% (2)"
    assert ask_stacks.row(qwen)["record"] == "-0.06% to +0.24% (2)?"  # no qwen2 cell behind it
    eight_cell, _ = ask.cell_for(ask.Question("tiny-llama", 64, 1, "zero3", gpus=8))
    assert ask_stacks.row(replace(llama, cell=eight_cell, record=hybrid))["record"].endswith("(1)?")  # 8 ranks
    found = ask_stacks.Stacks((llama, replace(llama, record=hybrid), qwen))
    assert ask_stacks.records_of(found) == [
        "  one rank, fake run, without offload: 2 cells of llama-3.2-1b, llama-3.2-3b, on 1 GPU",
        "  hybrid, with offload: 1 cell of llama-3.2-3b, on 1 GPU"]
    assert "records, of:\n  one rank" in ask_stacks.text(found)


def test_a_stacks_summary_says_none_fits_only_of_stacks_it_judged() -> None:
    """On a card whose context is not measured the stacks are "not judged": the summary says so, not that none fit."""
    from bench import ask_stacks

    unmeasured = gpus.GpuKind("x", "a card whose context is not measured", (8, 9), memory_gib=24.0)
    fits, too_big, unjudged = _answer(fits=True), _answer(fits=False), _answer(unmeasured)
    label = fits.cell.stack.label
    assert ask_stacks.fits_line(ask_stacks.Stacks((fits, too_big))) == f"fits: {label}"
    assert ask_stacks.fits_line(ask_stacks.Stacks((too_big,))) == "fits: none of these"
    assert ask_stacks.fits_line(ask_stacks.Stacks((unjudged, too_big))) == (
        f"fits: none judged to; not judged: {label} (see each row's line above)")


def test_an_answer_gives_the_predicted_step_time_or_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step time (bench/predict/steptime.py) at the card's fitted rates, with tokens/s, which side sets the
    pace and both sides' times; on a kind no GPU has fitted rates for, or a stack the model does not time, why not."""
    from bench.predict import steptime

    monkeypatch.setitem(steptime.RATES, "h100", steptime.StepRates(500.0, 2000.0, 0.0, 1.0, "3 cells of run r",
                                                                   "median 1.0% off, -2.0% to +1.0%", cells=3))
    work = {"peak_phase": "measure/backward", "predict_s": 1.0, "peak_reserved_gib": 12.0, "step_tflop": 10.0,
            "step_ops": 1000, "step_kernels": 800, "step_compute_tflop": 10.0, "step_memory_gb": 40.0}
    text = ask.text(_answer(**work))  # 20 ms of matmuls + 20 ms of bytes; the host's 1 ms
    assert "step time             40 ms    1,600 tokens/s, device-bound (device 40 ms, host 1)" in text  # 64 positions
    assert "fitted on 3 measured cells; each left out of the fit was predicted median 1.0% off" in text
    unfitted = gpus.GpuKind("x", "a card no GPU run has fitted", (8, 9), memory_gib=24.0)
    assert "step time       not predicted: no a card no GPU run has fitted has measured steps" in ask.text(
        _answer(unfitted, **work))
    assert "step time       not predicted: the step's work was not counted" in ask.text(
        _answer(**{**work, "step_ops": None}))
    from bench import ask_stacks

    assert ask_stacks.row(_answer(**work))["tokens_per_s"] == "1,600"
    # bitsandbytes' 8-bit optimizer step: its own rate a trainable parameter, and its fit said; without one, why not
    cell, _ = ask.cell_for(ask.Question("tiny-llama", 64, 1, stack="adamw8bit"))
    eight_bit = ask.Answer(cell, H100, {"status": "ok", "peak_allocated_gib": 10.0, **work,
                                        "trainable_params": 10**9}, ())
    assert "not predicted: adamw8bit: bitsandbytes' 8-bit optimizer step runs slower" in ask.text(eight_bit)
    monkeypatch.setitem(steptime.RATES, "h100", replace(
        steptime.RATES["h100"], optimizer_8bit_ps=20.0, optimizer_8bit_cells=4,
        optimizer_8bit_left_out="median 3.0% off, -4.0% to +3.0%"))
    text = ask.text(eight_bit)  # + 10^9 parameters x 20 ps
    assert "step time             60 ms    1,067 tokens/s, device-bound (device 60 ms, host 1)" in text
    assert "8-bit optimizer step at its own rate a parameter, fitted on 4 cells, each left out predicted median 3.0%" in text
