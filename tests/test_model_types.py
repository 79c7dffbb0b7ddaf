"""tools/model_types.py: which of transformers' architectures `bench predict` predicts, each in a process of its own."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from conftest import REPO

sys.path[:0] = [str(REPO / "tools")]

import model_types  # noqa: E402


def test_the_architectures_asked_about_are_the_text_causal_lms() -> None:
    every = model_types.text_model_types()
    assert {"llama", "qwen3", "gemma3_text", "deepseek_v3"} <= set(every)
    assert "gemma3" not in every  # multimodal: `bench ask` takes its text model's config instead


def test_each_answer_is_its_own_process_and_a_refusal_is_said_not_raised(tmp_path: Path) -> None:
    config = tmp_path / "llama" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(model_types.shrunk("llama")))
    ok = model_types.ask(config, "llama", "gc + lora")
    assert ok.status == "ok" and ok.peak_allocated_gib and ok.peak_reserved_gib >= ok.peak_allocated_gib
    broken = tmp_path / "broken" / "config.json"
    broken.parent.mkdir()
    broken.write_text('{"hidden_size": 8}')  # no model_type: bench ask exits 2 naming the problem
    refused = model_types.ask(broken, "broken", "gc")
    assert refused.status == "refused" and "model_type" in refused.why
    table = model_types.markdown([ok, model_types.Answer("broken", "gc + lora", "refused", why="a | b")],
                                 ["gc + lora"], "torch x")
    assert "`gc + lora`: 1 of 2 predicted" in table
    assert "| broken | **refused**: a \\| b |" in table  # a reason's pipe cannot break the table


def test_a_reason_is_given_whole_up_to_its_limit() -> None:
    """peft's refusal of LoRA on a Mamba hybrid with the suite's hint of the targets that would do runs to ~400
    characters: the table once cut it at 200, hint and all. Only a reason past the limit is cut, and says so."""
    hint = "lora: peft refuses LoRA with targets=all-linear: " + "x" * 330 + "; targets=in_proj|o_proj adapts every other"
    assert model_types._short(hint) == hint
    huge = "RuntimeError: " + "1.0, " * 400  # an exception with a tensor's repr
    assert model_types._short(huge) == huge[:model_types.WHY_MAX_CHARS] + " [cut]"
    table = model_types.markdown([model_types.Answer("falcon_h1", "gc + lora", "skipped", why=hint)],
                                 ["gc + lora"], "torch x")
    in_cell = hint.replace("|", "\\|")  # its pipes escaped, not changed: a user copies the targets as they are
    assert f"| falcon_h1 | **skipped**: {in_cell} |" in table


def test_a_failed_answer_is_the_predictors_only_where_its_step_runs_for_real(tmp_path: Path) -> None:
    """An error where the same cell's step runs for real (the suite's trainer, on the CPU) is the predictor's to fix;
    where the real step fails too, the shrinking's or the stack's on that architecture: the table says which."""
    config = tmp_path / "llama" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(model_types.shrunk("llama")))
    assert model_types.runs_for_real(config, "gc + lora") == ""
    phimoe = tmp_path / "phimoe" / "config.json"
    phimoe.parent.mkdir()
    phimoe.write_text(json.dumps(model_types.shrunk("phimoe")))
    # peft's LoRA (all-linear) wraps PhiMoE's router, which returns a tuple: the stack's failure, not the config's
    assert model_types.runs_for_real(phimoe, "mixed") == ""
    assert "tuple" in model_types.runs_for_real(phimoe, "gc + lora")
    config.write_text(json.dumps(model_types.shrunk("llama", {"num_key_value_heads": 3})))  # 4 heads in 3 groups
    assert model_types.runs_for_real(config, "mixed")
    assert model_types.runs_for_real(config, "expandable_segments").startswith("RuntimeError: not run on the CPU")
    errs = [model_types.Answer(t, "gc", "error", why="RuntimeError: x", real_step=real)
            for t, real in (("a", ""), ("b", "ValueError: heads"), ("c", "RuntimeError: x"))]
    table = model_types.markdown(errs, ["gc"], "torch x")
    assert "1 failed answers whose step runs for real, 2 whose step fails for real too" in table
    assert "| a | **error**: RuntimeError: x; **runs for real** |" in table
    assert "| b | **error**: RuntimeError: x; fails for real: ValueError: heads |" in table
    assert "| c | **error**: RuntimeError: x; fails for real too |" in table


def test_a_shrunk_config_keeps_a_layer_of_each_kind_its_model_has() -> None:
    """Cut to a few layers, a hybrid keeps each kind it has (Qwen3-Next's linear attention beside full attention,
    Gemma 3's sliding window beside global layers), its per-layer lists cut to the same layers."""
    assert model_types.kept_layers([["s", "s", "s", "f", "s", "f"]], 2) == [0, 3]
    assert model_types.kept_layers([["a", "b", "c", "a"], ["x", "x", "y", "x"]], 2) == [0, 1, 2]
    assert model_types.kept_layers([["a"] * 5], 2) == [0, 1]
    for model_type, kinds in (("qwen3_next", {"linear_attention", "full_attention"}),
                              ("gemma3_text", {"sliding_attention", "full_attention"})):
        config = model_types.shrunk(model_type)
        assert set(config["layer_types"]) == kinds and config["num_hidden_layers"] == len(config["layer_types"])
    from transformers import CONFIG_MAPPING, AutoConfig

    if "kolibri1_1" in CONFIG_MAPPING:  # transformers >= 5.25. Its lists of layer indices at the default depth (the
        # indexer layers, each layer's key-value source) are derived again at two layers, not cut as per-layer lists
        kolibri = AutoConfig.for_model(**model_types.shrunk("kolibri1_1"))
        assert kolibri.layer_types == ["sliding_attention", "indexed_attention"]
        assert (kolibri.index_layers, kolibri.kv_source_layers, kolibri.mlp_only_layers) == ([1], [0, 1], [0])


def test_every_architecture_shrinks_to_a_config_transformers_builds() -> None:
    """The sizes an architecture needs of its own (OWN_SIZES) pass transformers' validators, and the names of
    BART's family narrow its decoder as SMALL's narrow Llama's (a blenderbot left at its defaults was a 2.7B-parameter
    model, 33 GiB under `mixed`)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    for model_type in filter(CONFIG_MAPPING.__contains__, model_types.OWN_SIZES):  # those this transformers has
        fields = model_types.shrunk(model_type)
        AutoConfig.for_model(**fields)  # raises where a validator refuses (a Mamba head size, say)
    blenderbot = model_types.shrunk("blenderbot")
    assert (blenderbot["d_model"], blenderbot["decoder_layers"], blenderbot["decoder_ffn_dim"]) == (256, 2, 512)


def test_against_a_baseline_an_architecture_that_stops_predicting_fails(tmp_path: Path) -> None:
    """`--baseline`: an answer the earlier run predicted that no longer predicts is exit 1, named in the table; one
    it did not predict, or did not ask, is not counted."""
    import subprocess

    def answer(model_type: str, status: str) -> dict[str, object]:
        return {"model_type": model_type, "stack": "gc", "status": status}

    baseline = tmp_path / "before.json"
    baseline.write_text(json.dumps({"answers": [answer("bloom", "ok"), answer("mamba", "skipped"),
                                                answer("llama", "ok")]}))
    out = tmp_path / "now.md"
    command = [sys.executable, str(REPO / "tools" / "model_types.py"), "--only", "bloom,mamba", "--stack", "gc",
               "--baseline", str(baseline), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    table = out.read_text()
    assert "1 answers it predicted no longer predict" in table and "- bloom / gc: skipped: " in table
    assert json.loads(out.with_suffix(".json").read_text())["answers"][0]["model_type"] == "bloom"
    again = tmp_path / "again.md"  # the table made again from the kept answers, nothing asked
    render = [sys.executable, str(REPO / "tools" / "model_types.py"), "--render", str(out.with_suffix(".json")),
              "--baseline", str(baseline), "--out", str(again)]
    assert subprocess.run(render, capture_output=True, text=True).returncode == 1 and again.read_text() == table
    missing = subprocess.run([*command[:-4], "--baseline", str(tmp_path / "none.json")], capture_output=True, text=True)
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_the_nightly_gate_asks_every_architecture_against_answers_under_the_baseline_releases() -> None:
    """`make predict-architectures` (a step of the CPU gate's workflow) gates against the committed answers, made under
    the releases the gate's baseline was predicted under (PREDICT_BASELINE_VERSIONS), with every text architecture."""
    import re

    makefile = (REPO / "Makefile").read_text()
    release_set = re.search(r"^PREDICT_BASELINE_VERSIONS \?= (\S+)$", makefile, re.M)
    assert release_set and "results/model-types/$(PREDICT_BASELINE_VERSIONS).json" in makefile
    answers = json.loads((REPO / "results" / "model-types" / f"{release_set[1]}.json").read_text())
    pins = dict(line.split("==") for line in (REPO / "versions" / f"{release_set[1]}.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert answers["versions"].startswith(f"torch {pins['torch']}") and f"transformers {pins['transformers']}" in \
        answers["versions"]
    import transformers

    if transformers.__version__ == pins["transformers"]:  # a newer release may add architectures: asked about nightly
        assert {a["model_type"] for a in answers["answers"]} == set(model_types.text_model_types())
    assert "make predict-architectures" in (REPO / ".github" / "workflows" / "predict-gate.yml").read_text()
    # and the fake-vs-real comparison it gates against is of those very answers: every pair they predicted
    assert "results/model-types/$(PREDICT_BASELINE_VERSIONS)-fake-vs-real.json" in makefile
    compared = json.loads((REPO / "results" / "model-types" / f"{release_set[1]}-fake-vs-real.json").read_text())
    assert compared["sweep"] == f"{release_set[1]}.json" and compared["versions"] == answers["versions"]
    assert {(p["model_type"], p["stack"]) for p in compared["pairs"]} == {
        (a["model_type"], a["stack"]) for a in answers["answers"] if a["status"] == "ok"}


def test_fake_vs_real_sets_a_predicted_architectures_fake_run_beside_real_cpu_tensors(tmp_path: Path) -> None:
    """tools/fake_vs_real.py: each pair a sweep predicted counted on fake and on real CPU tensors; equal to the byte
    for Llama; with `--baseline`, only a pair equal there that no longer is fails (exit 1)."""
    import subprocess

    import fake_vs_real  # tools/

    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"answers": [{"model_type": "llama", "stack": "gc + lora", "status": "ok"},
                                             {"model_type": "llama", "stack": "no_such_technique", "status": "ok"},
                                             {"model_type": "bloom", "stack": "gc + lora", "status": "skipped"}]}))
    out = tmp_path / "fvr.md"
    command = [sys.executable, str(REPO / "tools" / "fake_vs_real.py"), str(sweep), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 1, done.stderr  # a pair that fails (its stack, here) fails the comparison
    assert "2 pairs: 1 equal, 0 differ, 1 failed." in out.read_text()  # the skipped answer is not a pair
    equal, failed = json.loads(out.with_suffix(".json").read_text())["pairs"]
    assert equal["fake_phases"] == equal["real_phases"] and "measure/backward" in equal["fake_phases"]
    assert failed["status"] == "failed" and "no_such_technique" in failed["why"]
    again = tmp_path / "again.md"  # the table made again from the kept pairs, nothing run
    render = [sys.executable, str(REPO / "tools" / "fake_vs_real.py"), "--render", str(out.with_suffix(".json")),
              "--out", str(again)]
    assert subprocess.run(render, capture_output=True).returncode == 0 and again.read_text() == out.read_text()
    for was, code in (("failed", 0), ("equal", 1)):  # judged against a baseline: only a pair equal there counts
        baseline = tmp_path / f"{was}.json"
        baseline.write_text(json.dumps({"pairs": [{"model_type": "llama", "stack": "no_such_technique", "status": was}]}))
        assert subprocess.run([*command, "--baseline", str(baseline)], capture_output=True).returncode == code, was
    differing = fake_vs_real.Pair("llama", "gc", "differs", {"first_step/forward": 3 * 2**20},
                                  {"first_step/forward": 2 * 2**20}, 0.5, 0.5)
    assert differing.worst == ("first_step/forward", 3 * 2**20, 2**21)
    assert "first_step/forward 3.000 MiB fake, 2.000 MiB real (+50.00%)" in fake_vs_real._result(differing)
    host = fake_vs_real.Pair("llama", "fsdp + offload(params=True)", "differs", {}, {}, 0.5, 0.5, ranks=2,
                             fake_host_bytes=1024, real_host_bytes=2048)  # the phases alike, the pinned host not
    assert fake_vs_real._result(host) == "**differs**: pinned host memory 1024 B fake, 2048 B real"
    missing = subprocess.run([*command, "--baseline", str(tmp_path / "none.json")], capture_output=True, text=True)
    assert missing.returncode == 2 and "--baseline" in missing.stderr


def test_fake_vs_real_names_each_release_once() -> None:
    """A comparison's header names the releases it ran under, each once: the stacks' form adds bitsandbytes and
    torchao to the architectures' (torch, transformers, peft), not peft a second time."""
    import fake_vs_real  # tools/

    named = [part.split()[0] for part in fake_vs_real.stack_versions().split(", ")]
    assert named[:3] == ["torch", "transformers", "peft"] and len(named) == len(set(named)), named


def test_fake_vs_real_keeps_a_reasons_pipes_as_said() -> None:
    """peft's hint names targets as `q_proj|k_proj`: in the list of pairs not compared it stays as said, in a table's
    cell it is escaped (GitHub reads `\\|` as one pipe), never turned into slashes a user would copy wrongly."""
    import fake_vs_real  # tools/

    why = "peft refuses DoRA; targets=q_proj|k_proj adapts the attention alone"
    text = fake_vs_real.markdown([fake_vs_real.Pair("tiny-olmoe", "gc", "no real step", why="ValueError: a|b")],
                                 {"versions": "torch x", "matrix": "coverage", "models": ["tiny-olmoe"],
                                  "not_compared": [["tiny-olmoe", "dora", why]]})
    assert f"- {why}: tiny-olmoe (`dora`)" in text
    assert "| tiny-olmoe | `gc` | **no real step**: ValueError: a\\|b |" in text


@pytest.mark.slow
def test_fake_vs_real_sets_each_stacks_fake_run_beside_real_cpu_tensors(tmp_path: Path) -> None:
    """tools/fake_vs_real.py --stacks: each stack of a matrix on each registry model, counted on fake and on real CPU
    tensors; FSDP2's on two ranks, the fake process group against two real gloo ranks; ZeRO's, those needing CUDA and
    adapters peft refuses (DoRA on OLMoE's fused experts) are named with the reason and not run; a stack whose real
    step fails here nonetheless (that DoRA, asked by `--one`, which does not plan) is `no real step`, not a failure."""
    import subprocess

    import fake_vs_real  # tools/

    compared, not_compared = fake_vs_real.stack_pairs("llama3b", ["tiny-llama"])
    assert ("tiny-llama", "gc + lora") in compared and ("tiny-llama", "dora") in compared
    assert ("tiny-llama", "fsdp") in compared and not_compared["tiny-llama", "zero3"] == fake_vs_real.ZERO
    assert ("tiny-llama", "fsdp + offload(params=True)") in compared  # on gloo ranks, though CUDA's on a GPU
    assert "needs CUDA" in not_compared["tiny-llama", "liger"] and "needs CUDA" in not_compared[
        "tiny-llama", "expandable_segments"]
    assert "use_dora=True" in fake_vs_real.stack_pairs("llama3b", ["tiny-olmoe"])[1]["tiny-olmoe", "dora"]
    out = tmp_path / "stacks.md"
    tool = [sys.executable, str(REPO / "tools" / "fake_vs_real.py")]
    done = subprocess.run([*tool, "--stacks", "smoke-ranks", "--models", "tiny-llama", "--out", str(out), "--jobs",
                           "2"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    kept = json.loads(out.with_suffix(".json").read_text())
    assert [(p["stack"], p["ranks"], p["status"]) for p in kept["pairs"]] == [
        ("baseline", 1, "equal"), ("padding", 1, "equal"), ("packing", 1, "equal"), ("fsdp", 2, "equal"),
        ("fsdp(precision=mixed)", 2, "equal"), ("gc + fsdp", 2, "equal")]
    fsdp = kept["pairs"][3]  # its shards: less state than one rank's whole model
    assert fsdp["real_state_gib"] == fsdp["fake_state_gib"] < kept["pairs"][0]["real_state_gib"]
    assert {stack for _, stack, _ in kept["not_compared"]} == {"zero2", "zero3"}
    assert "6 pairs: 6 equal, 0 differ, 0 failed." in out.read_text() and "Not compared here:" in out.read_text()
    assert "tiny-llama (`gc + fsdp` on 2 ranks)" in out.read_text()
    assert "against as many real gloo ranks, each rank's count equal" in out.read_text()
    assert "the optimizer state and the pinned host memory are the same" in out.read_text()
    again = tmp_path / "again.md"
    assert subprocess.run([*tool, "--render", str(out.with_suffix(".json")), "--out", str(again)]).returncode == 0
    assert again.read_text() == out.read_text()
    earlier = tmp_path / "earlier.json"  # a pair equal there that did not run here is named, not judged
    earlier.write_text(json.dumps({"pairs": [{"model_type": "tiny-llama", "stack": "unsloth", "status": "equal"}]}))
    assert subprocess.run([*tool, "--render", str(out.with_suffix(".json")), "--baseline", str(earlier), "--out",
                           str(again)]).returncode == 0
    assert "still is. 1 pairs equal there did not run here (not compared, or not asked): tiny-llama (`unsloth`)" in \
        again.read_text()
    one = subprocess.run([*tool, "--one", "tiny-olmoe", "--stack", "dora"], capture_output=True, text=True)
    assert "use_dora" in json.loads(one.stdout.splitlines()[-1])["no_real_step"]
    for bad in (["--stacks", "no-such-matrix"], ["--stacks", "smoke", "--models", "tiny-nothing"], [],
                ["--stacks", "smoke", "--only", "llama"]):
        refused = subprocess.run([*tool, *bad], capture_output=True, text=True)
        assert refused.returncode == 2 and "fake_vs_real:" in refused.stderr, bad


def test_the_stacks_fake_vs_real_gate_is_of_every_coverage_stack_under_the_baselines_releases() -> None:
    """make predict-gate compares each stack's fake run with its real CPU step against a committed comparison made
    under PREDICT_BASELINE_VERSIONS, of every stack of the coverage matrix on the Makefile's models."""
    import re

    from bench import spec

    makefile = (REPO / "Makefile").read_text()
    release_set = re.search(r"^PREDICT_BASELINE_VERSIONS \?= (\S+)$", makefile, re.M)
    chosen = re.search(r"^PREDICT_STACKS_MODELS \?= (\S+)$", makefile, re.M)
    assert release_set and chosen and "--stacks coverage --models $(PREDICT_STACKS_MODELS)" in makefile
    kept = json.loads((REPO / "results" / "coverage" / f"{release_set[1]}-fake-vs-real.json").read_text())
    pins = dict(line.split("==") for line in (REPO / "versions" / f"{release_set[1]}.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert kept["versions"].startswith(f"torch {pins['torch']}") and kept["models"] == chosen[1].split(",")
    stacks = [s.label for s in spec.get(REPO / "matrix.yaml", "coverage").stacks]
    judged = {(p["model_type"], p["stack"]) for p in kept["pairs"]} | {(m, s) for m, s, _ in kept["not_compared"]}
    assert judged == {(m, s) for m in kept["models"] for s in stacks}


def test_against_a_baseline_a_peak_that_moved_past_one_percent_is_said_but_does_not_fail() -> None:
    """A release that changes what a predicted step holds (peft 0.22's `all-linear` adapting Qwen2-MoE's router and
    experts: +1.0 to +4.1% on the shrunk models of transformers 5.25) is listed under the table; a move within 1%,
    or an answer that stopped predicting (counted by `lost`, the gate's failure), is not listed as a move."""
    def answer(model_type: str, status: str, peak_gib: float | None) -> model_types.Answer:
        return model_types.Answer(model_type=model_type, stack="gc + lora", status=status, peak_allocated_gib=peak_gib,
                                  peak_reserved_gib=peak_gib, why="")

    before = {"answers": [asdict(answer("qwen2_moe", "ok", 0.100)), asdict(answer("olmoe", "ok", 0.100)),
                          asdict(answer("mamba", "ok", 0.100)), asdict(answer("bloom", "skipped", None))]}
    now = [answer("qwen2_moe", "ok", 0.104), answer("olmoe", "ok", 0.1009), answer("mamba", "error", None),
           answer("bloom", "ok", 0.2)]
    shifted = model_types.moved(before, now)
    assert shifted == ["qwen2_moe / gc + lora: 0.1000 -> 0.1040 GiB (+4.00%)"]
    text = model_types.against("before.json", model_types.lost(before, now), shifted)
    assert "1 answers it predicted no longer predict" in text and "- mamba / gc + lora: error: " in text
    assert "1 answers' peak allocated moved by more than 1% (not a failure):\n\n- qwen2_moe" in text
    assert "moved" not in model_types.against("before.json", [], [])
