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
])
def test_bad_matrix_names_the_problem(tmp_path: Path, bad: str, good: str, message: str) -> None:
    path = write_matrix(tmp_path, GOOD.replace(bad, good))
    with pytest.raises((spec.SpecError, StackError)) as err:
        spec.get(path, "m")
    assert message in str(err.value)


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
    ("packing(min_doc_frac=1.5)", "packing(min_doc_frac=1.5): min_doc_frac must be in (0, 1]"),
    ("grad_accum(steps=1)", "grad_accum(steps=1): steps must be at least 2"),
    ("zero3 + offload(optimizer=false)", "offloads nothing"),
    ("zero2 + zero3", "both set the engine"),
    ("zero2 + mixed", "zero2 cannot be combined with mixed"),
    ("zero3 + adamw8bit", "cannot be combined with adamw8bit"),
    ("adamw8bit + paged_adamw8bit", "both set the optimizer"),
])
def test_impossible_stack_is_refused(text: str, rule: str) -> None:
    with pytest.raises(StackError, match=re.escape(rule)):
        parse_stack(text)


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
