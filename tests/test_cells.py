"""Cell expansion, stable ids, and plan-time skip reasons."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench import cells, cli, spec, stacks
from bench.envinfo import OPTIONAL_PACKAGES, HostCaps
from conftest import write_matrix

REPO_MATRIX = Path(__file__).resolve().parents[1] / "matrix.yaml"
CPU_HOST = HostCaps(cuda_devices=0, packages=frozenset())
GPU_HOST = HostCaps(cuda_devices=1, packages=frozenset(OPTIONAL_PACKAGES))


def test_cell_ids_are_pinned() -> None:
    """Changing what an id hashes would orphan every published result: do it on purpose only."""
    smoke = cells.expand(spec.get(REPO_MATRIX, "smoke"), CPU_HOST)
    assert smoke[0].cell_id == "tiny-llama_s256_b1_baseline_214f1a91"
    assert smoke[-1].cell_id == "tiny-mistral_s256_b4_gc+lora_418ed928"
    assert len({c.cell_id for c in smoke}) == len(smoke) == 3 * 2 * 5


def test_an_option_added_later_keeps_published_ids_at_its_default() -> None:
    """ZeRO's `bucket` came after llama3b's ZeRO cells were predicted and published: at its default
    their ids stay; another bucket is another cell."""
    llama3b = {c.stack.label: c for c in cells.expand(spec.get(REPO_MATRIX, "llama3b"), GPU_HOST)
               if (c.seq_len, c.batch_size) == (2048, 2)}
    assert llama3b["zero2"].cell_id == "llama-3.2-3b_s2048_b2_zero2_0d48768e"
    assert llama3b["offload + zero2"].cell_id == "llama-3.2-3b_s2048_b2_offload+zero2_e37fa491"
    smaller = dataclasses.replace(llama3b["zero2"], stack=stacks.parse_stack("zero2(bucket=50000000)"))
    assert smaller.cell_id == "llama-3.2-3b_s2048_b2_zero2-bucket-50000000_" + smaller.cell_id[-8:]
    assert smaller.cell_id[-8:] != "0d48768e"
    # Liger's `geglu` came after its Llama cells were measured and published
    assert llama3b["gc + liger"].cell_id == "llama-3.2-3b_s2048_b2_gc+liger_42b6b638"


def test_ids_depend_on_settings_not_on_spelling(tmp_path: Path) -> None:
    body = """
    matrices:
      a: {device: cpu, models: [tiny-llama], seq_lens: [32], batch_sizes: [1], stacks: ["%s"]}
    """
    ids = []
    for stack in ("lora(r=8) + gc", "gc+lora(r=8)", "gc + lora(r=16)", "gc + lora"):
        write_matrix(tmp_path, body % stack)
        ids.append(cells.expand(spec.get(tmp_path / "matrix.yaml", "a"), CPU_HOST)[0].cell_id)
    assert ids[0] == ids[1]
    assert ids[1] != ids[2]
    assert ids[2] == ids[3]  # r=16 is lora's default: the resolved options are hashed


def test_gpu_matrix_on_cpu_host_is_planned_as_skipped() -> None:
    llama3b = spec.get(REPO_MATRIX, "llama3b")
    planned = cells.plan(llama3b, CPU_HOST)
    assert len(planned) == 3 * 4 * len(llama3b.stacks)
    assert all(pc.skip_reason and "CUDA" in pc.skip_reason for pc in planned)
    on_gpu = {pc.skip_reason for pc in cells.plan(llama3b, GPU_HOST)}
    assert on_gpu == {None, "grad_accum: batch 1 does not split into 2 equal micro-batches"}


def test_gpus_axis_ids_and_skip_reasons(tmp_path: Path) -> None:
    """One-GPU ids stay as published; several GPUs show in the id and need GPUs and an engine."""
    write_matrix(tmp_path, """
    matrices:
      a: {device: cuda, models: [tiny-llama], seq_lens: [32], batch_sizes: [1], gpus: [1, 2], stacks: [baseline, fsdp]}
    """)
    planned = cells.plan(spec.get(tmp_path / "matrix.yaml", "a"), GPU_HOST)
    by_id = {pc.cell.cell_id.rsplit("_", 1)[0]: pc.skip_reason for pc in planned}
    assert by_id == {
        "tiny-llama_s32_b1_baseline": None,
        "tiny-llama_s32_b1_fsdp": None,
        "tiny-llama_s32_b1_g2_baseline": "needs 2 GPUs: 1 visible on this machine",
        "tiny-llama_s32_b1_g2_fsdp": "needs 2 GPUs: 1 visible on this machine",
    }
    eight = HostCaps(cuda_devices=8, packages=GPU_HOST.packages)
    reasons = [pc.skip_reason for pc in cells.plan(spec.get(tmp_path / "matrix.yaml", "a"), eight)]
    assert reasons[2] == "2 GPUs need a multi-GPU engine in the stack (ddp, fsdp, zero2, zero3)"
    assert reasons[3] is None


def test_exclude_rules_skip_with_their_name(tmp_path: Path) -> None:
    write_matrix(tmp_path, """
    matrices:
      a:
        device: cpu
        models: [tiny-llama]
        seq_lens: [32, 64]
        batch_sizes: [1]
        stacks: [baseline]
        exclude: [{seq_len: 64}]
    """)
    planned = cells.plan(spec.get(tmp_path / "matrix.yaml", "a"), CPU_HOST)
    assert [pc.skip_reason for pc in planned] == [None, "excluded by a.exclude[0]"]


def test_gpu_only_matrix_says_so_and_points_to_runnable_ones(capsys: pytest.CaptureFixture) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["run", "llama3b"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "MATRIX=smoke" in err


def test_list_prints_runnable_cells_and_groups_the_skipped_by_reason(capsys: pytest.CaptureFixture) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["list", "llama3b"]) == 0
    out = capsys.readouterr().out
    total = 3 * 4 * len(spec.get(REPO_MATRIX, "llama3b").stacks)
    assert f"  skip  {total} cells, e.g. llama-3.2-3b_s1024_b1_baseline_" in out and "(needs a CUDA GPU" in out
    assert out.count("\n  ") == 1
    assert cli.main(["list", "smoke"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n  run   ") == 30


def test_a_cell_survives_the_handoff_to_its_worker() -> None:
    """The runner sends Cell.to_json() as JSON; the worker reads back the same typed Cell, every
    option as resolved (the id check in from_json fails on any lost setting)."""
    import json

    for matrix in ("llama3b", "smoke-ranks", "save3b"):
        for cell in cells.expand(spec.get(REPO_MATRIX, matrix), GPU_HOST):
            assert cells.Cell.from_json(json.loads(json.dumps(cell.to_json()))) == cell
    budgeted = cells.make_cell(spec.get(REPO_MATRIX, "fit3b"), "cuda", "llama-3.2-3b", 4096, 3,
                               cells.expand(spec.get(REPO_MATRIX, "fit3b"), GPU_HOST)[0].stack, budget_gib=24.0)
    assert cells.Cell.from_json(json.loads(json.dumps(budgeted.to_json()))) == budgeted
    tampered = budgeted.to_json() | {"seq_len": 2048}
    with pytest.raises(ValueError, match="lost a setting"):
        cells.Cell.from_json(tampered)


def test_shards_partition_a_matrix_evenly_without_splitting_a_group() -> None:
    planned = cells.plan(spec.get(REPO_MATRIX, "llama3b"), GPU_HOST)
    for count in (1, 3, 8, 100):
        shards = [{pc.cell.cell_id for pc in cells.Shard(i, count).select(planned)} for i in range(1, count + 1)]
        assert sum(map(len, shards)) == len(set().union(*shards)) == len(planned)  # each cell in exactly one
        owner = {cid: i for i, shard in enumerate(shards) for cid in shard}
        groups: dict[tuple, set[int]] = {}
        for pc in planned:
            groups.setdefault(pc.cell.group, set()).add(owner[pc.cell.cell_id])
        assert all(len(found) == 1 for found in groups.values())  # an OOM still prunes its group's larger batches
        per_shard = [len(s) // 4 for s in shards]  # llama3b: 4 batch sizes per group
        assert max(per_shard) - min(per_shard) <= 1, per_shard


@pytest.mark.parametrize("text", ["0/8", "9/8", "3", "a/b", "3/8/1", "-1/2", ""])
def test_a_bad_shard_is_named(text: str) -> None:
    with pytest.raises(spec.SpecError, match="--shard"):
        cells.Shard.parse(text)


def _a_causal_lm_without_sdpa() -> str:
    """A model_type whose causal LM class this transformers builds without sdpa (gpt-oss's attention
    sinks, Gemma 2's softcapping in some releases): found in the installed release, not named."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    likely = ("gpt_oss", "gemma2", "vaultgemma")  # looked at first: the scan imports every modeling module
    for model_type, config_class in sorted(CONFIG_MAPPING.items(), key=lambda item: item[0] not in likely):
        try:
            model_class = AutoModelForCausalLM._model_mapping[config_class]
        except (KeyError, ValueError, ImportError):
            continue
        if not getattr(model_class, "_supports_sdpa", True):
            return model_type
    pytest.skip("every causal LM of this transformers has sdpa attention")


def test_a_model_without_the_stacks_attention_is_skipped_saying_which_technique_builds_it(tmp_path: Path) -> None:
    """transformers would raise it in the worker's build, after the process and its imports: said at plan time."""
    import json

    from transformers import CONFIG_MAPPING

    from bench import models

    model_type = _a_causal_lm_without_sdpa()
    config = CONFIG_MAPPING[model_type]().to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    name = models.register_file(tmp_path / "config.json")
    smoke = spec.get(REPO_MATRIX, "smoke")
    plain, eager = (cells.make_cell(smoke, "cpu", name, 32, 1, stacks.parse_stack(s)) for s in ("gc", "gc + eager_attention"))
    reason = cells.skip_reason(plain, smoke, CPU_HOST)
    assert reason is not None and "has no sdpa attention" in reason and reason.endswith("add eager_attention to the stack")
    assert cells.skip_reason(eager, smoke, CPU_HOST) is None
    llama = cells.make_cell(smoke, "cpu", "tiny-llama", 32, 1, stacks.parse_stack("gc"))
    assert cells.skip_reason(llama, smoke, CPU_HOST) is None


def test_liger_on_a_family_it_does_not_name_is_skipped_saying_so() -> None:
    """A family Liger does not name (tiny-olmoe, a mixture of experts): skipped before anything runs, naming the
    families, not failed in the build."""
    smoke = spec.get(REPO_MATRIX, "smoke")
    gpu_host = HostCaps(cuda_devices=1, packages=frozenset({"liger_kernel"}))
    olmoe, llama = (cells.make_cell(smoke, "cuda", m, 32, 1, stacks.parse_stack("liger")) for m in ("tiny-olmoe", "tiny-llama"))
    reason = cells.skip_reason(olmoe, smoke, gpu_host)
    assert reason is not None and reason.startswith("liger supports the llama, qwen2, mistral, qwen3") and "not olmoe" in reason
    assert cells.skip_reason(llama, smoke, gpu_host) is None


def test_liger_refuses_switching_off_an_mlp_kernel_the_family_does_not_have() -> None:
    """The gemmas' MLP is GeGLU, the others' SwiGLU: `liger(swiglu=false)` on a Gemma would switch nothing
    off, so the cell is refused naming the option that does; the family's own kernel may be switched off."""
    smoke = spec.get(REPO_MATRIX, "smoke")
    gpu_host = HostCaps(cuda_devices=1, packages=frozenset({"liger_kernel"}))

    def reason(model: str, stack: str) -> str | None:
        return cells.skip_reason(cells.make_cell(smoke, "cuda", model, 32, 1, stacks.parse_stack(stack)), smoke, gpu_host)

    assert reason("gemma-3-1b", "liger(swiglu=false)") == (
        "liger(swiglu=False): gemma-3-1b (gemma3_text) has a geglu MLP, not swiglu: its kernel is switched off by "
        "liger(geglu=False)")
    assert reason("tiny-llama", "liger(geglu=false)") == (
        "liger(geglu=False): tiny-llama (llama) has a swiglu MLP, not geglu: its kernel is switched off by "
        "liger(swiglu=False)")
    assert reason("gemma-3-1b", "liger(geglu=false)") is None
    assert reason("tiny-llama", "liger(swiglu=false)") is None


def test_adapters_peft_refuses_are_skipped_with_peft_s_reason() -> None:
    """peft has no DoRA for a mixture of experts' fused 3-D experts (`all-linear` adapts them as parameters),
    and refuses targets that match no module: asked of peft on a meta build when planned, so the cell is
    skipped saying so rather than failed after a worker built the model. The same targets without DoRA, and
    DoRA on the attention alone, are planned as usual."""
    smoke = spec.get(REPO_MATRIX, "smoke")
    host = HostCaps(cuda_devices=0, packages=frozenset({"peft", "bitsandbytes"}))

    def reason(model: str, stack: str) -> str | None:
        return cells.skip_reason(cells.make_cell(smoke, "cpu", model, 32, 1, stacks.parse_stack(stack)), smoke, host)

    dora = reason("tiny-olmoe", "dora")
    assert dora is not None and dora.startswith("dora: peft ") and "ParamWrapper does not work with use_dora=True" in dora
    assert dora.endswith("targets=q_proj|k_proj|v_proj|o_proj adapts the attention alone")
    assert reason("tiny-olmoe", "dora(targets=q_proj|k_proj|v_proj|o_proj)") is None
    assert reason("tiny-olmoe", "lora") is None and reason("tiny-llama", "dora") is None
    for stack in ("lora(targets=qproj)", "dora(targets=qproj)", "int8_lora(targets=qproj)"):
        missing = reason("tiny-llama", stack)
        assert missing is not None and "targets=qproj" in missing and "qproj" in missing.rsplit(":", 1)[-1], (stack, missing)
