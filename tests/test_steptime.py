"""The step time model (bench/predict/steptime.py): what the fake run counts of a step's work, the model,
and its fit."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest
import torch

from bench import spec
from bench.cells import make_cell
from bench.predict import fake, flops, steptime, steptime_report
from bench.predict.counter import Workspaces
from bench.predict.steptime import StepRates, StepWork
from bench.stacks import parse_stack
from conftest import REPO


def test_a_view_is_dispatched_but_launches_no_kernel():
    x = torch.ones(64, 64)
    with flops.FlopCount() as counted:
        x.t()
        x.view(4096)
        torch.empty(8)
    work = counted.work()
    assert (work.ops, work.kernels, work.memory_bytes) == (3, 0, 0)


def test_an_elementwise_op_moves_its_inputs_and_outputs():
    a, b = torch.ones(1000), torch.ones(1000)
    with flops.FlopCount() as counted:
        a + b
    assert counted.work() == StepWork(flops=0, ops=1, kernels=1, compute_flops=0, memory_bytes=3 * 4000)


def test_an_expanded_input_is_read_once():
    x = torch.ones(4, 1, 1000)
    with flops.FlopCount() as counted:
        x.expand(4, 8, 1000) * 2.0
    assert counted.work().memory_bytes == 4 * 1000 * 4 + 4 * 8 * 1000 * 4  # the storage read, the output written


def test_a_void_in_place_op_writes_what_its_schema_marks():
    """`_foreach_add_` returns nothing: the lists it adds into are written (else an optimizer's steps would count
    their reads only)."""
    a, b = [torch.ones(1000) for _ in range(3)], [torch.ones(1000) for _ in range(3)]
    with flops.FlopCount() as counted:
        torch._foreach_add_(a, b)
    assert counted.work().memory_bytes == 3 * 3 * 4000


@pytest.mark.parametrize("grad_scale", [None, 1024.0])
def test_a_fused_optimizer_writes_its_gradients_only_under_a_grad_scaler(grad_scale):
    """Fused AdamW's schema marks its gradients written, but CUDA's kernel stores them only when handed a
    GradScaler's `grad_scale` to unscale them by: its step reads parameters, gradients and both moments and writes
    back three of the four (fake-run/26; before, four), or all four under the scaler."""
    params = [torch.ones(1000, requires_grad=True) for _ in range(2)]
    for p in params:
        p.grad = torch.ones(1000)
    optimizer = torch.optim.AdamW(params, fused=True)
    optimizer.step()  # the moments exist from here on
    scaled = {} if grad_scale is None else {"grad_scale": torch.tensor(grad_scale), "found_inf": torch.tensor(0.0)}
    with flops.FlopCount() as counted:
        torch._fused_adamw_(params, [p.grad for p in params], [optimizer.state[p]["exp_avg"] for p in params],
                            [optimizer.state[p]["exp_avg_sq"] for p in params], [],
                            [optimizer.state[p]["step"] for p in params], lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False, **scaled)
    arrays, steps = 2 * 1000 * 4, 2 * 4  # a list of two fp32 tensors' bytes; the two step counts, read
    scale_tensors = 0 if grad_scale is None else 2 * 4
    written = 3 if grad_scale is None else 4
    assert counted.work().memory_bytes == 4 * arrays + steps + scale_tensors + written * arrays


def test_a_roofline_sorts_a_projection_from_a_low_rank_matmul():
    """A square projection of 1024 rows does 2 x 1024^3 FLOPs over 3 x 1024^2 x 2 bytes (341 a byte: compute-
    bound); a rank-16 adapter's matmul of the same rows moves as many bytes for 1/64 of the FLOPs."""
    x, w = torch.ones(1024, 1024, dtype=torch.bfloat16), torch.ones(1024, 1024, dtype=torch.bfloat16)
    with flops.FlopCount() as counted:
        x @ w
    assert counted.work().compute_flops == 2 * 1024**3 and counted.work().memory_bytes == 0
    with flops.FlopCount() as counted:
        x @ w[:, :16]
    assert counted.work().compute_flops == 0 and counted.work().memory_bytes > 1024 * 1024 * 2


def test_an_undispatched_kernel_counts_its_tensors():
    """A Triton launch (bench/predict/triton_launch.py) is a kernel reading or writing each tensor once."""
    tensors = [torch.ones(100), torch.ones(50, dtype=torch.bfloat16)]
    with flops.FlopCount() as counted:
        flops.count_undispatched_kernel(tensors)
    assert (counted.work().kernels, counted.work().memory_bytes, counted.work().ops) == (1, 500, 0)


@pytest.mark.parametrize("stack", ["baseline", "gc + lora"])
def test_a_fake_step_counts_the_work_a_real_step_counts(stack: str) -> None:
    """The same tiny-llama step on fake tensors and on real CPU tensors: the same FLOPs, and as many ops, kernels and
    bytes but for transformers' check whether the batch is packed, which the fake run answers without running it
    (bench/predict/fake.py `_packing_known`: a dozen small ops). A fake tensor's device questions, dispatched as
    `prim.device` (thousands a step), are no work."""
    cell = make_cell(spec.get(REPO / "matrix.yaml", "smoke"), "cpu", "tiny-llama", 64, 2, parse_stack(stack))
    faked = fake.counted_run(cell, Workspaces())[0].steps[-1].work
    real = fake.counted_run(cell, Workspaces(), fake=False)[0].steps[-1].work
    assert faked.flops == real.flops > 0
    assert 0 <= real.ops - faked.ops <= 16 and 0 <= real.kernels - faked.kernels <= 10
    assert 0 <= real.memory_bytes - faked.memory_bytes <= 16_384


@pytest.mark.parametrize("rows", [4096, 16])
def test_the_4bit_matmul_counts_the_kernels_its_cuda_path_runs(rows: int) -> None:
    """bitsandbytes' gemm_4bit is one op with a fake kernel; on an H100 at 4096 rows CUDA runs four kernels: the
    nested statistics to fp32 and their offset added, the weight dequantized to bf16 (memory-bound), F.linear
    (compute-bound); at 16 rows bitsandbytes' own kernel, one, reading the packed weight (memory-bound there).
    Sizes by hand: a 1024 x 512 weight, 8,192 statistics (one per 64 values)."""
    import bitsandbytes
    from bitsandbytes import functional
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.predict import bnb, gpus

    with bnb.real_quantization_maps(), FakeTensorMode():
        packed, state = functional.quantize_4bit(torch.empty(1024, 512, dtype=torch.bfloat16), compress_statistics=True,
                                                 quant_type="nf4")
        hidden = torch.empty(rows, 512, dtype=torch.bfloat16)
        with flops.FlopCount(bnb.gemm_4bit_kernels(gpus.get("h100"))) as counted:
            bitsandbytes.matmul_4bit(hidden, packed, quant_state=state)
    work, matmul, statistics = counted.work(), 2 * rows * 1024 * 512, 1024 * 512 // 64
    in_out = rows * (512 + 1024) * 2
    if rows == 4096:
        dequantized = statistics * 5 + statistics * 8 + (1024 * 512 // 2 + statistics * 4 + 1024 * 512 * 2)
        assert (work.flops, work.kernels, work.compute_flops, work.memory_bytes) == (matmul, 4, matmul, dequantized)
    else:
        own_kernel = in_out + 1024 * 512 // 2 + statistics
        assert (work.flops, work.kernels, work.compute_flops, work.memory_bytes) == (matmul, 1, 0, own_kernel)


RATES = StepRates(500.0, 2000.0, 3.0, 10.0, fitted_on="by hand")  # the two sides combined as the larger
MODEL = replace(RATES, overlap_p=steptime.OVERLAP_P)  # as the fit combines them


def test_close_sides_each_wait_on_the_other():
    """The fit's model combines the device's time and the host's as their p-norm: the larger where one dominates,
    more where they are close (equal: 2^(1/p) of either)."""
    assert steptime.combined(100.0, 100.0, 5.0) == pytest.approx(100 * 2 ** 0.2)
    assert steptime.combined(100.0, 50.0, 5.0) == pytest.approx(100 * (1 + 0.5**5) ** 0.2)  # +0.6%
    assert steptime.combined(100.0, 10.0, 5.0) == pytest.approx(100.0, rel=1e-5)
    assert steptime.combined(100.0, 99.0, float("inf")) == 100.0 and steptime.combined(0.0, 0.0, 5.0) == 0.0


def test_the_slower_of_device_and_host_sets_the_pace():
    busy = StepWork(flops=0, ops=1000, kernels=500, compute_flops=int(50e12), memory_bytes=int(4e9))
    # device: 100 ms of matmuls + 2 ms of bytes + 1.5 ms of kernels; host: 10 ms
    assert steptime.step_ms(busy, RATES) == pytest.approx(103.5)
    assert steptime.bound(busy, RATES) == "device"
    chatty = StepWork(flops=0, ops=20_000, kernels=15_000, compute_flops=int(1e12), memory_bytes=int(1e9))
    assert steptime.step_ms(chatty, RATES) == pytest.approx(200.0)  # host: 20,000 ops x 10 µs
    assert steptime.bound(chatty, RATES) == "host"


def _works() -> list[StepWork]:
    """Steps of many shapes, device- and host-bound, so that each rate shows in some."""
    return [StepWork(0, ops, kernels, int(tflop * 1e12), int(gb * 1e9))
            for ops, kernels, tflop, gb in ((30_000, 20_000, 100, 500), (30_000, 20_000, 20, 120), (5_000, 4_000, 400, 100),
                                           (60_000, 40_000, 10, 50), (10_000, 9_000, 5, 900), (40_000, 30_000, 50, 300),
                                           (20_000, 2_000, 200, 50), (80_000, 60_000, 30, 40), (15_000, 12_000, 300, 600))]


def test_the_fit_finds_the_rates_that_made_the_times():
    works = _works()
    measured = [steptime.step_ms(w, MODEL) for w in works]
    found = steptime.fit(works, measured, "synthetic")
    assert [steptime.step_ms(w, found) / m for w, m in zip(works, measured, strict=True)] == pytest.approx(
        [1.0] * len(works), abs=0.01)
    assert found.matmul_tflops == pytest.approx(500, rel=0.05) and found.op_us == pytest.approx(10, rel=0.05)


def test_a_cell_left_out_is_predicted_by_the_others():
    works = _works()
    measured = [steptime.step_ms(w, MODEL) for w in works]
    measured[0] *= 1.5  # a cell the model cannot explain: in-sample the fit splits its error with the others
    left_out = steptime.left_out_errors(works, measured)
    assert left_out[0] == pytest.approx(1 / 1.5 - 1, abs=0.02)  # the others' rates say what the model would
    assert max(abs(e) for e in left_out[1:]) > 0  # and each of the others is predicted with it in the fit


def test_a_stack_the_model_does_not_time_has_no_step_time():
    row = {"step_tflop": 100.0, "step_ops": 30_000, "step_kernels": 20_000, "step_compute_tflop": 100.0,
           "step_memory_gb": 500.0}
    saved = dict(steptime.RATES)
    steptime.RATES["h100"] = RATES
    try:
        gc = parse_stack("gc")
        assert steptime.predicted_ms(row, "h100", gc, 1) == pytest.approx(200.0 + 250.0 + 60.0)
        assert steptime.predicted_ms(row, "h100", parse_stack("zero3"), 1) is None
        assert "bitsandbytes' 4-bit path" in str(steptime.untimed_reason(parse_stack("qlora + gc"), 1))
        assert steptime.predicted_ms(row, "h100", parse_stack("fsdp"), 2) is None
        assert steptime.predicted_ms(row, "a100", gc, 1) is None  # no rates for the kind
        assert steptime.predicted_ms({**row, "step_ops": pd.NA}, "h100", gc, 1) is None
    finally:
        steptime.RATES.clear()
        steptime.RATES.update(saved)


def test_work_counted_by_an_older_method_is_not_read(monkeypatch):
    """Before fake-run/22 a fake tensor's device questions were counted as ops and kernels, before fake-run/25 causal
    attention's every score, before fake-run/26 a fused optimizer's gradients written: rates fitted to today's counts
    read a row's work only where it was counted as now (a fresh prediction's row names no method)."""
    row = {"step_tflop": 1.0, "step_ops": 100, "step_kernels": 50, "step_compute_tflop": 1.0, "step_memory_gb": 1.0}
    assert steptime.work_of({**row, "prediction_method": "fake-run/21"}) is None
    assert steptime.work_of({**row, "prediction_method": "fake-run/25"}) is None
    assert steptime.work_of({**row, "prediction_method": "fake-run/26"}) == StepWork(10**12, 100, 50, 10**12, 10**9)
    assert steptime.work_of(row) == steptime.work_of({**row, "prediction_method": "fake-run/27"}) is not None
    # a technique's work counted as now only since a later method: its cells' older rows are not read, others' are
    liger, gc = parse_stack("gc + liger"), parse_stack("gc")
    monkeypatch.setitem(steptime.TECHNIQUE_WORK_COUNTED_SINCE, "liger", 27)
    assert steptime.cell_work({**row, "prediction_method": "fake-run/27"}, liger) is not None
    assert steptime.cell_work({**row, "prediction_method": "fake-run/26"}, liger) is None
    assert steptime.cell_work({**row, "prediction_method": "fake-run/26"}, gc) is not None
    assert steptime.cell_work({**row, "prediction_method": "fake-run/25"}, gc) is None


def test_the_report_times_only_cells_it_can():
    row = {"cell_id": "c", "gpu_name": "NVIDIA H100 80GB HBM3", "step_ms_p50": 250.0, "gpus": 1, "step_tflop": 1.0,
           "step_ops": 10, "step_kernels": 5, "step_compute_tflop": 1.0, "step_memory_gb": 1.0,
           "trainable_params": 999, "trainable_params_predicted": 1000}
    both = pd.DataFrame([{**row, "stack": "gc"}, {**row, "stack": "zero2"}, {**row, "stack": "gc", "step_ops": None},
                         {**row, "stack": "gc", "gpu_name": "NVIDIA H200"}, {**row, "stack": "adamw8bit"}])
    timed = steptime_report.timed(both, "h100")
    assert list(timed["stack"]) == ["gc", "adamw8bit"] and timed["work"].iloc[0].ops == 10
    assert [w.optimizer_8bit_params for w in timed["work"]] == [0, 1000]  # the prediction's own parameters
    # rates without the 8-bit optimizer's cannot predict its cell: the report leaves it out
    assert list(steptime_report.timed(both, "h100", RATES)["stack"]) == ["gc"]


def test_selective_gc_under_its_op_policy_is_not_timed_and_by_layer_it_is():
    """The op policy sends every op through a Python dispatch mode, which the host's rate does not price (the
    H200: 380 ms measured, 237 predicted): its cells are left out of the fit and unpredicted; checkpointing every
    n-th layer is plain gc's work and is timed. DoRA's ops get a host factor of their own."""
    by_ops, by_layer = parse_stack("selective_gc(every=1, ops=matmuls)"), parse_stack("selective_gc(every=2)")
    assert steptime.untimed_reason(by_layer, 1) is None
    assert steptime.POLICY_GC in (steptime.untimed_reason(by_ops, 1) or "")
    assert steptime.POLICY_GC in (steptime.untimed_reason(parse_stack("selective_gc(ops=matmuls)"), 1) or "")
    row = {"cell_id": "c", "gpu_name": "NVIDIA H100 80GB HBM3", "step_ms_p50": 250.0, "gpus": 1, "step_tflop": 1.0,
           "step_ops": 10, "step_kernels": 5, "step_compute_tflop": 1.0, "step_memory_gb": 1.0}
    both = pd.DataFrame([{**row, "stack": by_ops.label}, {**row, "stack": by_layer.label},
                         {**row, "stack": "gc + dora"}])
    timed = steptime_report.timed(both, "h100")
    assert list(timed["stack"]) == [by_layer.label, "gc + dora"]
    assert timed["work"].iloc[1].host_techniques == {"gc", "dora"}


def test_a_techniques_host_factor_is_fitted_where_host_bound_cells_show_it():
    """gc's ops cost the host more than a plain op (the checkpoint's recomputation), LoRA's less: a factor a
    technique, found by the fit from cells made with known factors; a kind whose host side is another's keeps it."""
    works = _works()
    with_gc = [replace(w, host_techniques=frozenset({"gc"})) for w in works[:5]]
    with_lora = [replace(w, host_techniques=frozenset({"lora"})) for w in works[5:]]
    made = replace(MODEL, host_factors=(("gc", 1.3), ("lora", 0.75)))
    cells = [*with_gc, *with_lora, *works]
    measured = [steptime.step_ms(w, made) for w in cells]
    found = steptime.fit(cells, measured, "synthetic")
    assert dict(found.host_factors) == {"gc": 1.3, "lora": 0.75}
    assert found.op_us == pytest.approx(10, rel=0.02)
    far = replace(made, op_us=1.0, host_factors=(("gc", 0.6), ("lora", 1.5)))  # no cell host-bound from here: stuck
    assert dict(steptime.fit(cells, measured, "synthetic", far).host_factors) == {"gc": 1.3, "lora": 0.75}
    chatty = StepWork(flops=0, ops=20_000, kernels=15_000, compute_flops=int(1e12), memory_bytes=int(1e9))
    assert steptime.host_ms(replace(chatty, host_techniques=frozenset({"gc", "lora"})), made) == pytest.approx(
        200.0 * 1.3 * 0.75)  # both: their product
    kept = steptime.fit(works, [m * 1.1 for m in measured[-len(works):]], "device alone",
                        replace(made, host_fitted=False))
    assert (kept.op_us, kept.host_factors, kept.host_fitted) == (made.op_us, made.host_factors, False)


def test_the_8bit_optimizers_rate_is_fitted_to_its_cells_alone():
    """bitsandbytes' 8-bit step: a rate a trainable parameter, fitted once the four are fitted to the other cells
    (which it does not move), and each of its cells left out predicted by the others."""
    works = _works()
    measured = [steptime.step_ms(w, MODEL) for w in works]
    with_8bit = replace(MODEL, optimizer_8bit_ps=30.0)
    device_bound = [w for w in works if steptime.bound(w, MODEL) == "device"]  # as the fit takes these cells
    eight_bit = [replace(w, optimizer_8bit_params=params) for w, params in zip(device_bound[:4], (3e9, 1e9, 8e9, 2e9),
                                                                                strict=True)]
    eight_ms = [steptime.step_ms(w, with_8bit) for w in eight_bit]
    eight_ms[0] *= 1.05  # noise on one cell
    found = steptime.fit([*works, *eight_bit], [*measured, *eight_ms], "synthetic")
    alone = steptime.fit(works, measured, "synthetic")
    assert (found.matmul_tflops, found.memory_gbps, found.op_us) == (alone.matmul_tflops, alone.memory_gbps,
                                                                       alone.op_us)
    assert found.optimizer_8bit_ps == pytest.approx(30.0, rel=0.05) and found.optimizer_8bit_cells == 4
    assert alone.optimizer_8bit_ps is None and alone.cells == found.cells == len(works)
    left_out = steptime.left_out_errors([*works, *eight_bit], [*measured, *eight_ms])
    assert left_out[len(works)] < 0  # the noisy cell, predicted by the three exact ones: short
    assert max(abs(e) for e in left_out[len(works) + 1:]) > 0  # the others, with it in their fit
    assert steptime.unsupported_reason(parse_stack("adamw8bit"), 1, RATES) and not steptime.unsupported_reason(
        parse_stack("adamw8bit"), 1, with_8bit)


def test_a_prediction_keeps_its_step_time_at_the_rates_of_the_day():
    """A fake run of tiny-llama for an H100 records its work and the step time at the H100's rates as they stand
    (so a later fit, with the cell's own measurement in it, cannot make its prediction in-sample); a stack the
    model does not time records its work without a time; a kind without rates, no time."""
    from bench import spec
    from bench.cells import make_cell
    from bench.predict import fake, gpus
    from bench.stacks import parse_stack

    matrix = spec.from_mapping("t", {"models": ["tiny-llama"], "seq_lens": [64], "batch_sizes": [2],
                                     "stacks": ["gc"], "device": "cuda"})
    gc = fake.predict_cell(make_cell(matrix, "cuda", "tiny-llama", 64, 2, parse_stack("gc")), gpus.get("h100"))
    work = steptime.cell_work(gc, parse_stack("gc"))
    assert work is not None and work.kernels < work.ops and work.memory_bytes > 0
    assert work.host_techniques == {"gc"}  # a recomputed step's ops cost the host more (its factor)
    assert gc["step_ms"] == pytest.approx(steptime.step_ms(work, steptime.RATES["h100"]))
    eight_bit = fake.predict_cell(make_cell(matrix, "cuda", "tiny-llama", 64, 2, parse_stack("adamw8bit")),
                                  gpus.get("h100"))
    # bitsandbytes' 8-bit step: its counted work, and its own rate for each trainable parameter
    work = steptime.cell_work(eight_bit, parse_stack("adamw8bit"))
    assert work is not None and work.optimizer_8bit_params == eight_bit["trainable_params"] > 0
    h100 = steptime.RATES["h100"]
    assert eight_bit["step_ms"] == pytest.approx(steptime.step_ms(work, h100))
    assert steptime.device_ms(work, h100) - steptime.device_ms(steptime.work_of(eight_bit), h100) == pytest.approx(
        eight_bit["trainable_params"] * h100.optimizer_8bit_ps * 1e-9)
    assert fake.predict_cell(make_cell(matrix, "cuda", "tiny-llama", 64, 2, parse_stack("gc")),
                             gpus.get("a100"))["step_ms"] is None


def test_prediction_md_sets_each_timed_cell_beside_its_measured_step(monkeypatch: pytest.MonkeyPatch):
    """PREDICTION.md's step time section: per GPU kind with rates, each timed cell's measured and predicted
    step time, in sample and left out of the fit."""
    works = _works()
    rows = [{"cell_id": f"c{i}", "gpu_name": "NVIDIA H100 80GB HBM3", "gpus": 1, "stack": "gc", "seq_len": 1024,
             "batch_size": 1, "step_ms_p50": steptime.step_ms(w, RATES) * (1.1 if i == 0 else 1.0),
             "step_tflop": w.flops / 1e12, "step_ops": w.ops, "step_kernels": w.kernels,
             "step_compute_tflop": w.compute_flops / 1e12, "step_memory_gb": w.memory_bytes / 1e9}
            for i, w in enumerate(works)]
    # the step time kept by a prediction made before the GPU ran c1, at the rates of that day; c0's newest
    # prediction kept one too, made after (in sample): not shown
    before = pd.DataFrame([{"cell_id": "c1", "gpu_name": "NVIDIA H100 80GB HBM3", "step_ms": rows[1]["step_ms_p50"] * 1.25}])
    rows[0]["step_ms"] = rows[0]["step_ms_p50"]
    monkeypatch.setattr(steptime, "RATES", {"h100": RATES})
    lines = steptime_report.section(pd.DataFrame(rows), before)
    assert lines[0] == "## Step time (predicted)"
    table = [line for line in lines if line.startswith("| `c")]
    assert len(table) == len(works)
    assert table[0].split(" | ")[6] == "-9.1%"  # 1 / 1.1 - 1: the rates made the other times exactly
    assert table[1].split(" | ")[8] == "+25.0%" and table[0].split(" | ")[8] == ""
    device, host = steptime.device_ms(works[0], RATES), steptime.host_ms(works[0], RATES)
    assert table[0].split(" | ")[9] == f"{device:.0f} / {host:.0f}"  # the two sums the step combines
    assert "9 cells: abs error median 0.0%, max 9.1%" in "\n".join(lines)
    monkeypatch.setattr(steptime, "RATES", {"h200": RATES})
    assert steptime_report.section(pd.DataFrame(rows), before) == []  # no H200 cell measured


@pytest.mark.parametrize("values", ["", "1", "0.5,5", "five", "5,"])
def test_choosing_p_refuses_values_it_cannot_try(values: str, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    """tools/choose_overlap.py: p must be a number above 1 (1 would be the sum, below it no norm); exit 2, nothing fitted."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import choose_overlap

    monkeypatch.setattr(sys, "argv", ["choose_overlap.py", "--p", values])
    monkeypatch.setattr(choose_overlap.report, "checked", lambda _: pytest.fail("fitted on bad input"))
    assert choose_overlap.main() == 2
    assert "numbers above 1" in capsys.readouterr().err
