"""The catalogue: every technique declares itself fully; on the CPU, each one that can run does,
and proves it applied; each that cannot is skipped with a reason naming the rule."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from bench.envinfo import OPTIONAL_PACKAGES
from bench.techniques import REGISTRY
from conftest import REPO, raw_rows, run_bench, write_matrix


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_technique_declares_what_it_saves_and_costs(name: str) -> None:
    t = REGISTRY[name]
    module = importlib.import_module(f"bench.techniques.{name}")
    assert module.__doc__ and len(module.__doc__) > 100, "module docstring: what it saves, what it costs"
    assert t.summary and len(t.summary) <= 110
    for option, allowed in t.choices.items():
        assert t.options[option] in allowed, f"{name}.{option}: default outside its choices"
    # the planner looks for a technique's packages among the optional ones only: one missing there
    # would make every cell of the technique "not installed", wherever it runs
    assert set(t.packages) <= set(OPTIONAL_PACKAGES), f"{name}: add its packages to envinfo.OPTIONAL_PACKAGES"
    assert {m.split(".")[0] for m in t.preload} <= set(t.packages), f"{name}: preloads a module of no package it needs"


def test_a_waiting_worker_imports_its_stacks_slow_modules_and_goes_on_past_a_missing_one() -> None:
    """The worker imports what the stack's builds import (Technique.preload) before its cell arrives; a module
    that fails to import is left for the build to meet and record. On a CPU host no context is asked about."""
    import subprocess
    import sys

    from bench.stacks import parse_stack

    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    assert parse_stack("gc + qlora + adamw8bit").preload == ("bitsandbytes", "peft")  # in order, each once
    probe = ("import sys; from bench import worker; worker._preload('no_such_module,peft,bitsandbytes'); "
             "print(sorted(m for m in ('peft', 'bitsandbytes') if m in sys.modules), worker._holds_cuda_context())")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['bitsandbytes', 'peft'] None"


@pytest.mark.parametrize("stack", ["lora(targets=q_proj|v_proj)", "dora(targets=q_proj|v_proj)"])
def test_lora_targets_are_module_names(stack: str) -> None:
    """`q_proj|v_proj` adapts each layer's q_proj and v_proj, and only those (peft would read the bare
    string as a regular expression over whole module paths, and match nothing)."""
    pytest.importorskip("peft")
    from bench import spec, trainer
    from bench.cells import make_cell
    from bench.stacks import parse_stack

    cell = make_cell(spec.get(REPO / "matrix.yaml", "smoke"), "cpu", "tiny-llama", 64, 2, parse_stack(stack))
    model = trainer.build_model(cell, device="meta").model
    adapted = sorted({name.split(".")[-2] for name, _ in model.named_modules() if name.endswith("lora_A")})
    layers = model.config.num_hidden_layers
    assert adapted == ["q_proj", "v_proj"]
    assert sum(name.endswith("lora_A") for name, _ in model.named_modules()) == 2 * layers


CATALOGUE = """
matrices:
  cat:
    device: cpu
    models: [tiny-llama]
    seq_lens: [64]
    batch_sizes: [2]
    stacks: [baseline, adamw(impl=foreach), adamw(impl=forloop), adamw8bit, eager_attention, gc + adamw8bit,
             grad_accum, grad_accum(steps=4), liger, expandable_segments, max_split_size,
             garbage_collection_threshold, paged_adamw8bit,
             chunked_ce(chunks=3), gc + chunked_ce, optimizer_in_backward, activation_offload(min_bytes=0),
             gc + activation_offload(min_bytes=0), selective_gc, "selective_gc(every=1, ops=matmuls)", lora, dora,
             torchao_adamw, torchao_adamw(state=int4), torchao_adamw(state=fp8), compile, gc + compile,
             galore(rank=8), "apollo(rank=1, scale_type=tensor)", cce, cce(impl=torch_compile),
             gc + cce(impl=torch_compile), compile(scope=model), "compile(scope=model, memory_budget=0)",
             adafactor, adafactor(impl=forloop), ddp + adafactor, muon, gc + muon(ns_steps=2)]
    steps: {warmup: 2, measure: 3}
    timeout_s: 120
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_catalogue_on_cpu(workdir: Path) -> None:
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("torchao")
    pytest.importorskip("galore_torch")
    pytest.importorskip("apollo_torch")
    pytest.importorskip("cut_cross_entropy")
    write_matrix(workdir, CATALOGUE)
    proc = run_bench(workdir, "run", "cat", "--run-id", "c", "--prefork", "on")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["stack"]: r for r in raw_rows(workdir, "c").values()}
    losses = {s: json.loads(r["losses_json"]) for s, r in rows.items() if r["status"] == "ok"}
    base = losses["baseline"]

    # Same math, other kernels: the same losses up to bf16 rounding.
    for exact in ("adamw(impl=foreach)", "adamw(impl=forloop)", "eager_attention", "grad_accum", "chunked_ce(chunks=3)",
                  "chunked_ce + gc", "optimizer_in_backward", "activation_offload(min_bytes=0)",
                  "activation_offload(min_bytes=0) + gc", "selective_gc", "selective_gc(every=1, ops=matmuls)",
                  "compile", "compile + gc", "cce(impl=torch_compile)", "cce(impl=torch_compile) + gc",
                  "compile(scope=model)", "compile(memory_budget=0, scope=model)"):
        assert losses[exact] == pytest.approx(base, rel=1e-3), exact
    assert json.loads(rows["chunked_ce(chunks=3)"]["evidence_json"])["chunked_ce_chunks"] == 3
    dora, lora = (json.loads(rows[s]["evidence_json"]) for s in ("dora", "lora"))
    assert dora["dora_magnitudes"] == dora["lora_modules"] == lora["lora_modules"] > 0
    assert rows["dora"]["trainable_params"] > rows["lora"]["trainable_params"]  # + a magnitude per output channel
    assert losses["dora"] == pytest.approx(losses["lora"], rel=1e-3)  # starts as the base model, as LoRA does
    cpu_flash = {"attention_ops": ["_scaled_dot_product_flash_attention_for_cpu"], "cudnn_version": None}  # bench/kernels.py
    assert json.loads(rows["selective_gc"]["evidence_json"]) == {  # tiny-llama: 2 decoder layers, every 2nd
        "selective_gc_layers": 1, "selective_gc_of": 2, "selective_gc_ops": "all", **cpu_flash}
    in_backward = json.loads(rows["optimizer_in_backward"]["evidence_json"])
    assert in_backward["optimizer_in_backward_optimizers"] == in_backward["optimizer_in_backward_hooks"] > 10
    assert rows["optimizer_in_backward"]["optimizer_state_gib"] == pytest.approx(rows["baseline"]["optimizer_state_gib"])
    offloaded = {s: json.loads(rows[s]["evidence_json"]) for s in ("activation_offload(min_bytes=0)",
                                                                    "activation_offload(min_bytes=0) + gc")}
    assert offloaded["activation_offload(min_bytes=0)"]["activation_offload_gib"] > \
        offloaded["activation_offload(min_bytes=0) + gc"]["activation_offload_gib"] > 0  # gc saves layer inputs only
    assert json.loads(rows["eager_attention"]["evidence_json"]) == {  # matmuls and a softmax: no attention kernel
        "attn_implementation": "eager", "attention_ops": [], "cudnn_version": None}
    assert json.loads(rows["baseline"]["evidence_json"]) == cpu_flash
    for compiled_forward in ("compile", "cce(impl=torch_compile)"):  # not recorded: it would run eager
        assert "attention_ops" not in json.loads(rows[compiled_forward]["evidence_json"]), compiled_forward
    for stack in ("compile", "compile + gc"):  # tiny-llama: 2 decoder layers, one shape
        compiled = json.loads(rows[stack]["evidence_json"])
        # settled: no recompile per step; and compiled at all (checkpointed, kernels' forward wrapper once kept
        # dynamo from tracing any layer: bench/techniques/compile.py)
        assert compiled["compiled_modules"] == 2 and 1 <= compiled["compile_graphs"] <= 4, stack
    assert rows["compile"]["first_step_s"] > rows["baseline"]["first_step_s"]  # compilation: the first step, not measured
    # the activation memory budget: at 0 the partitioner recomputes what it can, so far less is saved
    budgeted, free = (json.loads(rows[s]["evidence_json"]) for s in ("compile(memory_budget=0, scope=model)",
                                                                       "compile(scope=model)"))
    assert budgeted["compile_memory_budget"] == 0 and free["compile_memory_budget"] == 1.0
    assert budgeted["saved_for_backward_gib"] < free["saved_for_backward_gib"] / 10

    # 8-bit states: less optimizer memory than bf16 AdamW's two bf16 moments, same first loss.
    assert rows["adamw8bit"]["optimizer_state_gib"] < rows["baseline"]["optimizer_state_gib"]
    assert losses["adamw8bit"][0] == pytest.approx(base[0], rel=1e-3)
    assert rows["gc + adamw8bit"]["status"] == "ok"
    # torchao's: its quantized moments counted by the tensors inside them; same first loss; 4-bit smaller than 8
    torchao = {b: rows[f"torchao_adamw{b}"] for b in ("", "(state=int4)", "(state=fp8)")}
    for label, row in torchao.items():
        assert row["status"] == "ok", (label, row.get("error"))
        assert row["optimizer_state_gib"] < rows["baseline"]["optimizer_state_gib"], label
        assert losses[f"torchao_adamw{label}"][0] == pytest.approx(base[0], rel=1e-3)
    assert torchao["(state=int4)"]["optimizer_state_gib"] < torchao[""]["optimizer_state_gib"]
    assert json.loads(torchao[""]["evidence_json"])["torchao_optimizer"] == "AdamW8bit"
    # low-rank gradient optimizers: every decoder weight projected (tiny-llama: 2 layers x 7), the state smaller
    for stack, name in (("galore(rank=8)", "galore"), ("apollo(rank=1, scale_type=tensor)", "apollo")):
        assert json.loads(rows[stack]["evidence_json"])[f"{name}_projected_params"] == 14
        assert rows[stack]["optimizer_state_gib"] < rows["baseline"]["optimizer_state_gib"]
        assert losses[stack][0] == pytest.approx(base[0], rel=1e-3)

    # Adafactor: a row and a column per matrix (tiny-llama: 2 layers x 7, the embedding and output layer), a whole
    # second moment per norm (2 layers x 2, the final one); the first loss is before any update
    for stack in ("adafactor", "adafactor(impl=forloop)", "adafactor + ddp"):
        evidence = json.loads(rows[stack]["evidence_json"])
        assert (evidence["adafactor_factored_params"], evidence["adafactor_vector_params"]) == (16, 5), stack
        assert rows[stack]["optimizer_state_gib"] < rows["baseline"]["optimizer_state_gib"] / 50, stack
        assert losses[stack][0] == pytest.approx(base[0], rel=1e-3), stack
    assert losses["adafactor"] == pytest.approx(losses["adafactor(impl=forloop)"], rel=1e-3)  # the same update
    # Muon: tiny-llama's 2 x 7 decoder matrices, AdamW for the embedding, output layer and 5 norms; a momentum per
    # matrix (bf16: 2 B a value) where AdamW keeps two and a step count (4 B), so the state is smaller by 2 B per
    # matrix value and 4 B per matrix
    matrices = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 176 * 64)  # q and o, k and v, gate, up and down
    for stack in ("muon", "gc + muon(ns_steps=2)"):
        evidence = json.loads(rows[stack]["evidence_json"])
        assert (evidence["muon_matrices"], evidence["muon_adamw_params"]) == (14, 7), stack
        assert (rows["baseline"]["optimizer_state_gib"] - rows[stack]["optimizer_state_gib"]) * 2**30 == \
            pytest.approx(2 * matrices + 4 * 14), stack
        assert losses[stack][0] == pytest.approx(base[0], rel=1e-3) and losses[stack] != base, stack

    cut = json.loads(rows["cce(impl=torch_compile)"]["evidence_json"])
    assert (cut["cce_impl"], cut["cce_model"]) == ("torch_compile", "LlamaForCausalLM")
    assert rows["cce"]["skip_reason"] == \
        "cce: cce(impl=cce) runs Triton kernels on CUDA; cce(impl=torch_compile) runs on any device"
    assert rows["grad_accum(steps=4)"]["skip_reason"] == "grad_accum(steps=4): batch 2 does not split into 4 equal micro-batches"

    for gpu_only in ("liger", "expandable_segments", "max_split_size", "garbage_collection_threshold", "paged_adamw8bit"):
        assert rows[gpu_only]["status"] == "skipped"
        assert rows[gpu_only]["skip_reason"] == f"{gpu_only} needs CUDA (this cell runs on cpu)"


PEER = """
matrices:
  peer:
    device: cpu
    models: [tiny-llama]
    seq_lens: [64]
    batch_sizes: [2]
    stacks: [baseline, lora(r=32), "unsloth(load_in_4bit=false)", unsloth]
    steps: {warmup: 2, measure: 3}
    timeout_s: 300
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiles_evidence_leaves_autograds_in_place_gradient_sums_alone() -> None:
    """A weight used twice (a tied embedding and lm_head), its lm_head gradient computed in forward and saved
    detached, as Liger's fused loss does: autograd sums the embedding's gradient into it in place, and counting
    what the step saves must not change that (keeping a Python object of the saved storage would: the sum goes
    out of place, a gradient's bytes more at the step's peak). The count itself: each storage once, whole."""
    import torch

    from bench.techniques.compile import _saved_bytes_counted

    vocab, hidden, tokens = 1000, 64, 32

    class FusedHead(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            weight_grad = torch.ones(vocab, hidden)
            FusedHead.weight_grad_address = weight_grad.data_ptr()
            ctx.save_for_backward(torch.zeros_like(x).detach(), weight_grad.detach())
            return (x @ weight.t()).sum()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x_grad, weight_grad = ctx.saved_tensors
            return x_grad, weight_grad

    weight = torch.nn.Parameter(torch.randn(vocab, hidden))
    evidence: dict[str, Any] = {}
    with _saved_bytes_counted(evidence):
        embedded = torch.nn.functional.embedding(torch.arange(tokens), weight)
        FusedHead.apply(embedded[:, :hidden // 2].pow(2).repeat(1, 2), weight).backward()
    summed_in_place = weight.grad is not None and weight.grad.data_ptr() == FusedHead.weight_grad_address
    assert summed_in_place
    # saved: the token ids (int64), pow's input (a view of the embedding's rows: their storage up to its last
    # element), the head's two tensors (fp32)
    view_elements = (tokens - 1) * hidden + hidden // 2
    assert evidence["saved_for_backward_gib"] * 2**30 == tokens * 8 + (view_elements + tokens * hidden + vocab * hidden) * 4


def test_unsloth_trains_the_same_cell_on_cpu(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsloth's own loader and LoRA (its CPU fallback) train the suite's cell: from the same random
    checkpoint and tokens, so its first loss is the baseline's, with as many trainable parameters as
    our LoRA at its rank on the same layers. Its 4-bit base is refused on a CPU, with the reason."""
    pytest.importorskip("unsloth")
    monkeypatch.setenv("BENCH_CACHE", str(workdir / "cache"))
    write_matrix(workdir, PEER)
    proc = run_bench(workdir, "run", "peer", "--run-id", "p", "--prefork", "on")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["stack"]: r for r in raw_rows(workdir, "p").values()}
    peer = rows["unsloth(load_in_4bit=False)"]
    assert peer["status"] == "ok", peer.get("error")
    evidence = json.loads(peer["evidence_json"])
    assert (evidence["lora_modules"], evidence["unsloth_gc"]) == (14, "unsloth")  # tiny-llama: 2 layers x 7
    assert peer["trainable_params"] == rows["lora(r=32)"]["trainable_params"]
    first = json.loads(peer["losses_json"])[0]
    assert first == pytest.approx(json.loads(rows["baseline"]["losses_json"])[0], rel=1e-4)
    assert rows["unsloth"]["skip_reason"] == \
        "unsloth: a 4-bit base needs CUDA (Unsloth's CPU fallback trains 16-bit LoRA: load_in_4bit=false)"


ENGINES = """
matrices:
  ds:
    device: cpu
    models: [tiny-llama]
    seq_lens: [64]
    batch_sizes: [2]
    stacks: [baseline, zero2, zero3, gc + zero3, lora + zero2, zero3 + offload(params=true)]
    steps: {warmup: 2, measure: 3}
    timeout_s: 180
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deepspeed_zero_on_cpu_with_gloo(workdir: Path) -> None:
    """Real DeepSpeed ZeRO-2/3 engines, world size 1 on gloo: they run, say what they are, and start
    from the baseline's loss (same bf16 weights, same data); later steps differ only by DeepSpeed's
    fp32 master weights."""
    pytest.importorskip("deepspeed")
    write_matrix(workdir, ENGINES)
    proc = run_bench(workdir, "run", "ds", "--run-id", "ds", "--prefork", "on")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["stack"]: r for r in raw_rows(workdir, "ds").values()}
    base = json.loads(rows["baseline"]["losses_json"])
    for stack, stage in (("zero2", 2), ("zero3", 3), ("gc + zero3", 3), ("lora + zero2", 2)):
        row = rows[stack]
        assert row["status"] == "ok", row["error"]
        evidence = json.loads(row["evidence_json"])
        assert evidence["zero_stage"] == stage and evidence["offload_optimizer"] == "none"
        assert evidence["ds_world_size"] == 1
        losses = json.loads(row["losses_json"])
        assert losses[0] == pytest.approx(base[0], rel=1e-4), stack
        if "lora" not in stack:
            assert losses == pytest.approx(base, rel=2e-2), stack
    assert json.loads(rows["lora + zero2"]["evidence_json"])["lora_modules"] > 0
    assert rows["zero2"]["optimizer_state_gib"] == pytest.approx(2 * rows["baseline"]["optimizer_state_gib"], rel=0.01)
    assert rows["offload(params=True) + zero3"]["skip_reason"] == "offload needs CUDA (this cell runs on cpu)"


def test_where_zero3_keeps_the_parameters_is_read_from_deepspeeds_own_config() -> None:
    """The evidence's offload_param, from DeepSpeed's offload config as the installed release makes it (a
    str in 0.19.8: `.value` on it raised at wrap, on the GPU only, where offload cells run), and from the
    enum member an older release holds."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum

    from bench.engines import deepspeed

    assert deepspeed.offload_device(DeepSpeedZeroOffloadParamConfig(device="cpu")) == "cpu"
    assert deepspeed.offload_device(DeepSpeedZeroOffloadParamConfig()) == "none"
    assert deepspeed.offload_device(None) == "none"
    older = DeepSpeedZeroOffloadParamConfig.model_construct(device=OffloadDeviceEnum.nvme)  # no validation: the member
    assert deepspeed.offload_device(older) == "nvme"


QUANTIZED = """
matrices:
  q:
    device: cpu
    models: [tiny-llama]
    seq_lens: [64]
    batch_sizes: [2]
    stacks: [lora, qlora, gc + qlora(prepare_kbit=true), int8_lora]
    steps: {warmup: 2, measure: 3}
    timeout_s: 180
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quantized_bases_on_cpu(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bitsandbytes' CPU backend: a real NF4 / int8 base loaded from a cached random checkpoint,
    with LoRA adapters; the weights shrink as the format says."""
    pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("BENCH_CACHE", str(workdir / "cache"))
    write_matrix(workdir, QUANTIZED)
    proc = run_bench(workdir, "run", "q", "--run-id", "q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["stack"]: r for r in raw_rows(workdir, "q").values()}
    for stack, layers in (("qlora", 14), ("qlora(prepare_kbit=True) + gc", 14), ("int8_lora", 14)):
        row = rows[stack]
        assert row["status"] == "ok", row["error"]
        evidence = json.loads(row["evidence_json"])
        assert evidence["quantized_layers"] == layers and evidence["lora_modules"] == 14
        assert row["trainable_params"] == rows["lora"]["trainable_params"]
        assert row["flops_per_token"] is None  # no MFU for a quantized base
    assert json.loads(rows["qlora(prepare_kbit=True) + gc"]["evidence_json"])["prepare_kbit"] is True
    # tiny-llama's 14 decoder linears hold 92160 weights: 2 B each in bf16, 0.5 B in nf4, 1 B in int8;
    # embeddings, norms and lm_head stay bf16
    linear_weights = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176)
    saved = rows["lora"]["weights_gib"] - rows["qlora"]["weights_gib"]
    assert saved == pytest.approx(linear_weights * 1.5 / 2**30, rel=0.02)
    saved = rows["lora"]["weights_gib"] - rows["int8_lora"]["weights_gib"]
    assert saved == pytest.approx(linear_weights * 1.0 / 2**30, rel=0.02)
    [checkpoint] = (workdir / "cache" / "checkpoints").iterdir()  # the random checkpoint, reused by every cell
    assert {json.loads(r["evidence_json"])["base_checkpoint"] for r in rows.values() if r["stack"] != "lora"} == \
        {checkpoint.name}


@pytest.mark.parametrize("stack", ["qlora", "int8_lora"])
def test_a_quantized_base_loads_without_the_hubs_kernels(stack: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.25's from_pretrained swaps layers for the Hub's kernels unless told not to (5.24's did not):
    under it every qlora and int8_lora step failed on a host without the `kernels` package, and with it would have
    run kernels no stack names. The load says `use_kernels=False`, and the model it returns is not kernelized."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from bench import spec
    from bench.cells import make_cell
    from bench.stacks import parse_stack

    monkeypatch.setenv("BENCH_CACHE", str(tmp_path))
    calls: list[dict[str, Any]] = []
    load = AutoModelForCausalLM.from_pretrained.__func__  # type: ignore[attr-defined]

    def spy(cls: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    cell = make_cell(spec.get(REPO / "matrix.yaml", "smoke"), "cpu", "tiny-llama", 64, 2, parse_stack(stack))
    [use] = [u for u in cell.stack.uses if u.technique.load]
    model = use.technique.load(cell, "cpu", "sdpa", use.opts)  # type: ignore[misc]
    assert [c.get("use_kernels") for c in calls] == [False]
    assert not getattr(model, "use_kernels", False)


def test_a_random_checkpoint_holds_the_plain_builds_weights_and_gpu_cells_prefer_the_gpu_drawn_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized base's random checkpoint holds the weights a plain build of the same model and seed
    draws on the same device (here the CPU; on a GPU, tests/test_gpu.py). A GPU cell loads the GPU-drawn
    one where there is one, else the CPU-drawn; a CPU cell always the CPU-drawn. `prepare` draws only for
    GPU cells whose stack loads a base, and on a host without a GPU says it could not and why."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from bench import checkpoints, spec, trainer
    from bench.cells import make_cell
    from bench.stacks import parse_stack

    monkeypatch.setenv("BENCH_CACHE", str(tmp_path))
    made_on_cpu = checkpoints.random_checkpoint("tiny-llama", 3)
    loaded = AutoModelForCausalLM.from_pretrained(made_on_cpu, dtype=torch.bfloat16).state_dict()
    plain = trainer.base_model("tiny-llama", "cpu", 3).state_dict()
    assert loaded.keys() == plain.keys()
    assert all(torch.equal(loaded[name], plain[name]) for name in plain)

    assert checkpoints.for_load("tiny-llama", 3, "cuda") == made_on_cpu  # no GPU-drawn one yet
    drawn_on_gpu = checkpoints._path("tiny-llama", 3, "cuda")
    assert drawn_on_gpu != made_on_cpu and drawn_on_gpu.name.startswith("tiny-llama-cuda-")
    shutil.copytree(made_on_cpu, drawn_on_gpu)  # stands in for one `prepare` drew on a GPU: only its folder matters
    assert checkpoints.for_load("tiny-llama", 3, "cuda") == drawn_on_gpu
    assert checkpoints.for_load("tiny-llama", 3, "cpu") == made_on_cpu

    smoke = spec.get(REPO / "matrix.yaml", "smoke")
    cells = [make_cell(smoke, device, model, 64, 2, parse_stack(stack)) for device, model, stack in
             (("cuda", "tiny-llama", "qlora"), ("cuda", "tiny-llama", "gc + int8_lora"), ("cpu", "llama-3.2-1b", "qlora"),
              ("cuda", "llama-3.2-1b", "lora"))]
    assert checkpoints.needed(cells) == [("tiny-llama", smoke.seed)]
    [line] = checkpoints.prepare(cells)
    if not torch.cuda.is_available():
        assert line == (f"the random checkpoint of tiny-llama (seed {smoke.seed}) not drawn on the GPU "
                        "(no CUDA device): its cells make it on the CPU")


SAVES = """
matrices:
  save_full:
    device: cpu
    models: [tiny-llama]
    seq_lens: [64]
    batch_sizes: [2]
    stacks: [baseline, lora, zero2, zero3]
    steps: {warmup: 1, measure: 2}
    checkpoint: full
  save_model:
    device: cpu
    models: [tiny-llama]
    seq_lens: [64]
    batch_sizes: [2]
    stacks: [baseline, lora, zero3]
    steps: {warmup: 1, measure: 2}
    checkpoint: model
"""


def test_resident_memory_now_follows_what_the_process_touches() -> None:
    import torch

    from bench import measure

    before = measure.host_rss_now_gib()
    block = torch.ones(256 * 2**20, dtype=torch.uint8)  # 256 MiB, every page written
    grown = measure.host_rss_now_gib() - before
    del block
    assert 0.2 < grown < 0.3
    assert measure.host_rss_peak_gib() >= before + grown - 0.01


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoint_save_is_measured(workdir: Path) -> None:
    """Real saves after the last step: model-only vs full state, plain torch and DeepSpeed (ZeRO-3
    gathers its shards for the model-only save); sizes on disk follow what each keeps."""
    pytest.importorskip("deepspeed")
    write_matrix(workdir, SAVES)
    for matrix in ("save_full", "save_model"):
        proc = run_bench(workdir, "run", matrix, "--run-id", matrix, "--prefork", "on")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    disk = {}
    for matrix in ("save_full", "save_model"):
        for row in raw_rows(workdir, matrix).values():
            assert row["status"] == "ok", row["error"]
            assert row["checkpoint"] == matrix.removeprefix("save_") and row["checkpoint_s"] > 0
            before, peak = row["checkpoint_host_rss_before_gib"], row["checkpoint_host_rss_peak_gib"]
            assert 0.1 < before <= row["host_rss_peak_gib"] + 0.01 and (peak is None or peak >= before)
            disk[(matrix, row["stack"])] = row["checkpoint_disk_gib"]
    assert disk[("save_model", "baseline")] == pytest.approx(disk[("save_model", "zero3")], rel=0.05)
    assert disk[("save_model", "lora")] < 0.5 * disk[("save_model", "baseline")]  # adapters only
    assert disk[("save_full", "baseline")] > 2.5 * disk[("save_model", "baseline")]  # + two bf16 Adam moments
    assert disk[("save_full", "zero2")] > 5 * disk[("save_model", "baseline")]  # + fp32 master and moments
    board = (workdir / "results" / "save_full" / "LEADERBOARD.md").read_text()
    assert "## Checkpoint save" in board and "| full |" in board
