"""Bad input is refused before anything runs, with an error naming the key path or the name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import cli, spec
from bench.stacks import StackError, parse_stack
from conftest import write_matrix

GOOD = """
matrices:
  m:
    device: cpu
    models: [tiny-llama]
    seq_lens: [32]
    batch_sizes: [1, 2]
    stacks: [baseline, gc + lora(r=8)]
"""


def test_the_shipped_matrix_file_loads() -> None:
    matrices = spec.load(Path(__file__).resolve().parents[1] / "matrix.yaml")
    assert {"smoke", "llama3b"} <= set(matrices)
    assert matrices["llama3b"].models == ("llama-3.2-3b",)


@pytest.mark.parametrize(("bad", "good", "message"), [
    ("seq_lens: [32]", "seq_len: [32]", "matrices.m: unknown key 'seq_len'"),
    ("seq_lens: [32]", "seq_lens: [0]", "matrices.m.seq_lens"),
    ("seq_lens: [32]", "seq_lens: [thirty]", "matrices.m.seq_lens"),
    ("device: cpu", "device: tpu", "matrices.m.device"),
    ("device: cpu", "device: cpu\n    checkpoint: sometimes", "matrices.m.checkpoint: 'sometimes' is not one of none"),
    ("device: cpu", "device: cpu\n    gpus: [0]", "matrices.m.gpus[0]: expected an integer >= 1"),
    ("device: cpu", "device: cpu\n    gpus: 2", "matrices.m.gpus: expected a non-empty list"),
    ("models: [tiny-llama]", "models: [tiny-lama]", "tiny-llama"),
    ("stacks: [baseline, gc + lora(r=8)]", "stacks: [baseline, gc + lorra]", "lora"),
    ("stacks: [baseline, gc + lora(r=8)]", "stacks: [lora(rank=8)]", "rank"),
    ("stacks: [baseline, gc + lora(r=8)]", "stacks: [lora(r=eight)]", "r"),
    ("device: cpu", "device: cpu\n    timeout_s: .nan", "matrices.m.timeout_s: expected a positive finite number, got nan"),
    ("device: cpu", "device: cpu\n    timeout_s: .inf", "matrices.m.timeout_s: expected a positive finite number, got inf"),
    ("device: cpu", "device: cpu\n    device: cuda", "key 'device' is given twice"),
    ("device: cpu", "device: cpu\n    exclude: [{model: tiny-lama}]",
     "matrices.m.exclude[0].model: 'tiny-lama' is not one of this matrix's model values (tiny-llama): the rule would "
     "exclude nothing"),
    ("device: cpu", "device: cpu\n    exclude: [{stack: mixed}]", "matrices.m.exclude[0].stack: 'mixed' is not one of"),
    ("device: cpu", "device: cpu\n    exclude: [{batch_size: '1'}]", "matrices.m.exclude[0].batch_size: '1' is not one of"),
    ("  m:", "  ../../../x:", "matrix '../../../x': use letters, digits"),
    ("  m:", "  .hidden:", "matrix '.hidden': use letters, digits"),
])
def test_bad_matrix_names_the_problem(tmp_path: Path, bad: str, good: str, message: str) -> None:
    path = write_matrix(tmp_path, GOOD.replace(bad, good))
    with pytest.raises((spec.SpecError, StackError)) as err:
        spec.get(path, "m")
    assert message in str(err.value)


def test_every_numeric_option_declares_its_range() -> None:
    from bench.techniques import REGISTRY

    for technique in REGISTRY.values():
        for option, default in technique.options.items():
            if isinstance(default, int | float) and not isinstance(default, bool):
                assert option in technique.ranges, f"{technique.name}.{option} declares no range"
                assert spec_in_range(default, technique.ranges[option]), f"{technique.name}.{option}: default outside"


def spec_in_range(value: float, interval: str) -> bool:
    from bench.stacks import in_range

    return in_range(value, interval)


def test_unknown_technique_suggests_the_closest_name() -> None:
    with pytest.raises(StackError, match="did you mean 'lora'"):
        parse_stack("gc + lorra")


@pytest.mark.parametrize(("text", "rule"), [
    ("mixed + mixed", "mixed"),
    ("gc + gc", "gc"),
    ("offload", "offload needs one of zero2, zero3, fsdp in the same stack"),
    ("zero2 + offload(params=true)", "offload(params=True): parameter offload needs zero3 or fsdp"),
    ("fsdp + offload", "FSDP offloads parameters, gradients and optimizer state together: write offload(params=true)"),
    ("fsdp + zero3", "both set the engine"),
    ("fsdp + mixed", "fsdp cannot be combined with mixed"),
    ("fsdp + qlora", "fsdp cannot be combined with qlora"),
    ("fsdp(precision=fp8)", "fsdp: option precision='fp8' is not one of pure, mixed"),
    ("padding + packing", "both set the data"),
    ("packing(min_doc_frac=1.5)", "packing: option min_doc_frac=1.5 is outside (0, 1]"),
    ("grad_accum(steps=1)", "grad_accum: option steps=1 is outside [2, inf)"),
    ("lora(r=-4)", "lora: option r=-4 is outside [1, inf)"),
    ("lora(r=0)", "lora: option r=0 is outside [1, inf)"),
    ("lora(r=1.5)", "lora: option r=1.5 should be a whole number"),
    ("offload(params=1) + zero3", "offload: option params=1 should be true or false"),
    ("lora(dropout=1.5)", "lora: option dropout=1.5 is outside [0, 1)"),
    ("qlora(dropout=1.0)", "qlora: option dropout=1.0 is outside [0, 1)"),
    ("lora(r=[)", "lora: option r='[' is not a value"),
    ("lora(r=!!python/object/apply:os.system [echo])", "lora: option r='!!python/object/apply:os.system [echo]' is not a value"),
    ("zero3 + offload(optimizer=false)", "offloads nothing"),
    ("lora(targets=.*proj)", "lora(targets=.*proj): targets='.*proj': '.*proj' is not a module name"),
    ("qlora(targets=q_proj v_proj)", "'q_proj v_proj' is not a module name; write all-linear or names joined by |"),
    ("dora(targets=q_proj|)", "dora(targets=q_proj|): targets='q_proj|': '' is not a module name"),
    ("zero2 + zero3", "both set the engine"),
    ("zero2 + mixed", "zero2 cannot be combined with mixed"),
    ("zero3 + adamw8bit", "cannot be combined with adamw8bit"),
    ("adamw8bit + paged_adamw8bit", "both set the optimizer"),
    ("expandable_segments + max_split_size", "expandable_segments and max_split_size both set the allocator"),
    ("max_split_size(mb=20)", "max_split_size: option mb=20 is outside (20, inf)"),
    ("expandable_segments + garbage_collection_threshold",
     "garbage_collection_threshold cannot be combined with expandable_segments"),
    ("garbage_collection_threshold(fraction=1)", "garbage_collection_threshold: option fraction=1 is outside (0, 1)"),
])
def test_impossible_stack_is_refused(text: str, rule: str) -> None:
    with pytest.raises(StackError, match=re.escape(rule)):
        parse_stack(text)


def test_a_stacks_allocator_settings_are_one_variable_and_each_technique_finds_its_own_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reads PYTORCH_CUDA_ALLOC_CONF as comma-separated settings: the field's recipe
    (garbage_collection_threshold with max_split_size) sets both, and each technique's check in the
    worker finds its own among them; a worker without it fails the cell rather than measuring without it."""
    stack = parse_stack("max_split_size + garbage_collection_threshold(fraction=0.8)")
    assert stack.env == {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8,max_split_size_mb:128"}
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", stack.env["PYTORCH_CUDA_ALLOC_CONF"])
    for use in stack.uses:
        _, evidence = use.technique.apply(None, use.opts)
        assert evidence == {"alloc_conf": "garbage_collection_threshold:0.8,max_split_size_mb:128"}
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:1280")
    with pytest.raises(RuntimeError, match="max_split_size: PYTORCH_CUDA_ALLOC_CONF is 'max_split_size_mb:1280'"):
        stack.uses[1].technique.apply(None, stack.uses[1].opts)


def test_test_only_technique_is_refused_outside_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BENCH_TEST_TECHNIQUES")
    with pytest.raises(StackError, match="fault"):
        parse_stack("fault(mode=raise)")


def test_stack_labels_are_canonical() -> None:
    assert parse_stack("lora(r=8) + gc").label == parse_stack("gc+lora( r = 8 )").label
    assert parse_stack("baseline").uses == ()


def test_cli_exits_2_on_bad_input_before_running(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_matrix(tmp_path, GOOD.replace("stacks: [baseline, gc + lora(r=8)]", "stacks: [baseline, zero9]"))
    code = cli.main(["--matrix-file", str(tmp_path / "matrix.yaml"), "--results-dir", str(tmp_path / "r"), "run", "m"])
    assert code == 2
    assert "zero9" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # nothing ran, nothing written


def test_unknown_matrix_name(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_matrix(tmp_path, GOOD)
    assert cli.main(["--matrix-file", str(tmp_path / "matrix.yaml"), "list", "mm"]) == 2
    assert "'mm'" in capsys.readouterr().err


@pytest.mark.parametrize(("ladder", "message"), [
    ("[baseline, gc + lora(r=8), gc]", "matrices.m.ladder[2]: 'gc' does not add to the rung before it"),
    ("[baseline, lora]", "matrices.m.ladder[1]: 'lora' is not one of this matrix's stacks"),
])
def test_bad_ladder_names_the_rung(tmp_path: Path, ladder: str, message: str) -> None:
    body = GOOD.replace("stacks: [baseline, gc + lora(r=8)]", f"stacks: [baseline, gc, gc + lora(r=8)]\n    ladder: {ladder}")
    with pytest.raises(spec.SpecError, match=re.escape(message)):
        spec.get(write_matrix(tmp_path, body), "m")


def test_good_ladder_is_kept_in_order(tmp_path: Path) -> None:
    body = GOOD.replace("stacks: [baseline, gc + lora(r=8)]",
                        "stacks: [baseline, gc, gc + lora(r=8)]\n    ladder: [baseline, gc, lora(r=8) + gc]")
    assert spec.get(write_matrix(tmp_path, body), "m").ladder == ("baseline", "gc", "gc + lora(r=8)")
