"""tools/step_profile.py's summary of a recorded profile, on a profile written by hand: its kernels sorted into
classes by name, a step's share of each, the device's busy time, and the step time model's sums beside them."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tools")]

import step_profile  # noqa: E402

CELL = "tiny-llama_s256_b1_baseline_"


@pytest.mark.parametrize("name, label", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64>>", "attention"),
    ("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, unsigned char*, float*, __nv_bfloat16*, int)",
     "bitsandbytes"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "aten"),
    ("_rms_norm_forward_kernel", "triton and other"),
    ("triton_poi_fused_add_mul_0", "triton and other"),
])
def test_kernels_are_sorted_into_classes_by_name(name: str, label: str) -> None:
    assert step_profile.kernel_class(name) == label


def test_the_device_is_busy_for_the_union_of_its_kernels() -> None:
    """Overlapping kernels (two streams) count once; a gap between them not at all."""
    assert step_profile.busy_us([(0, 10), (5, 15), (20, 30), (22, 24)]) == 25
    assert step_profile.busy_us([]) == 0


def test_a_summary_sets_each_class_a_step_beside_the_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from bench import spec
    from bench.cells import make_cell
    from bench.stacks import parse_stack

    cell = make_cell(spec.get(REPO / "matrix.yaml", "smoke"), "cuda", "tiny-llama", 256, 1, parse_stack("baseline"))
    assert cell.cell_id.startswith(CELL)
    recorded = {"matrix": "smoke", "gpu": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "cells": [
        {"cell_id": cell.cell_id, "steps": 5, "status": "ok", "step_ms_p50": 12.0, "span_us": 55_000.0,
         "busy_us": 40_000.0, "kernels": [["sm90_xmma_gemm_bf16", 50, 25_000.0], ["_swiglu_forward_kernel", 10, 10_000.0],
                                          ["void at::native::reduce_kernel<512, 1>", 100, 5_000.0]]}]}
    path = tmp_path / "profile.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump(recorded, handle)
    step_profile.summary("smoke", [path], "h100")
    out = capsys.readouterr().out
    assert "its kernels span 11.0 ms a step, the device busy 8.0" in out
    lines = [line.split() for line in out.splitlines()]
    assert ["matmul", "10", "kernels", "5.0", "ms", "a", "step"] in lines
    assert ["triton", "and", "other", "2", "kernels", "2.0", "ms", "a", "step"] in lines
    assert ["aten", "20", "kernels", "1.0", "ms", "a", "step"] in lines
    model = next(line for line in out.splitlines() if line.strip().startswith("model (h100)"))
    assert "compute" in model and "device" in model and "host" in model and "ops" in model


def test_a_file_that_is_not_a_profile_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    with pytest.raises(SystemExit) as stopped:
        step_profile.summary("smoke", [tmp_path / "bad.json.gz"], "h100")
    assert stopped.value.code == 2


def test_an_unknown_gpu_kind_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    import subprocess

    proc = subprocess.run([sys.executable, str(REPO / "tools" / "step_profile.py"), "summary", "smoke",
                           str(tmp_path / "none.json.gz"), "--gpu", "h1000"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "unknown GPU kind 'h1000'" in proc.stderr and "h100" in proc.stderr
