"""Triton kernels on fake tensors (bench/predict/triton_launch.py): launched, nothing runs, and each is counted for
the step's time as reading or writing its tensors once, and twice a tensor it overwrites in place."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from bench.predict import flops, triton_launch  # noqa: E402


@triton.jit
def _doubled_in_place(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(x_ptr + offsets, x * 2, mask=offsets < n)


@triton.jit
def _rows_gathered(index_ptr, source_ptr, out_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    source_row = tl.load(index_ptr + row)  # data, not a pointer: what it indexes is not where it is stored
    source = source_ptr + source_row * BLOCK
    out_ptr += row * BLOCK
    tl.store(out_ptr + tl.arange(0, BLOCK), tl.load(source + tl.arange(0, BLOCK)))


@triton.jit
def _block_copied(source_ptr, out_ptr, n, BLOCK: tl.constexpr):
    block = tl.make_block_ptr(base=source_ptr, shape=(n,), strides=(1,), offsets=(0,), block_shape=(BLOCK,),
                              order=(0,))
    copied = tl.load(block)
    target = tl.make_block_ptr(base=out_ptr, shape=(n,), strides=(1,), offsets=(0,), block_shape=(BLOCK,),
                               order=(0,))
    tl.store(target, copied)


def test_the_arguments_a_kernel_overwrites_are_read_from_its_source() -> None:
    """An argument loaded from and stored to through pointers made from it is overwritten in place; one only
    loaded or only stored is not, nor one whose loaded values index another (a gather writes its output, not its
    index); block pointers are pointers made from their base."""
    assert "x_ptr" in triton_launch.read_and_written(_doubled_in_place)
    for kernel in (_rows_gathered, _block_copied):
        assert not triton_launch.read_and_written(kernel) & {"index_ptr", "source_ptr", "out_ptr"}, kernel


def test_a_launch_counts_each_tensor_once_and_twice_one_overwritten_in_place() -> None:
    import torch

    x, index, source, out = (torch.empty(shape, device="meta") for shape in ((1024,), (8,), (64, 128), (8, 128)))
    with triton_launch.no_launches(), flops.FlopCount() as counted:
        _doubled_in_place[(8,)](x, x.numel(), BLOCK=128)
    assert (counted.kernels, counted.memory_bytes) == (1, 2 * 4096)
    with triton_launch.no_launches(), flops.FlopCount() as counted:
        _rows_gathered[(8,)](index, source, out, BLOCK=128)
    assert (counted.kernels, counted.memory_bytes) == (1, (8 + 64 * 128 + 8 * 128) * 4)


def test_ligers_swiglu_backward_counts_the_gradients_it_writes_over_its_inputs() -> None:
    """Liger's SwiGLU backward (Llama-3.2-3B's MLP at seq 2048 batch 2: 4,096 rows of 8,192) reads the output's
    gradient and the two saved inputs and writes the inputs' gradients over them: five tensors' bytes, 335 MB,
    where each tensor once (fake-run/23 and before) said three."""
    pytest.importorskip("liger_kernel")
    import torch
    from liger_kernel.ops.swiglu import swiglu_backward
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b, dc = (torch.empty(2, 2048, 8192, dtype=torch.bfloat16) for _ in range(3))
        with triton_launch.no_launches(), flops.FlopCount() as counted:
            swiglu_backward(a, b, dc)
    one = 4096 * 8192 * 2
    assert counted.memory_bytes == 5 * one


def test_dynamo_is_told_triton_runs_whichever_way_its_release_asks() -> None:
    """torch 2.15's dynamo asks `has_triton(include_cpu=True)`, 2.11-2.14's `has_triton()`: inside
    `traced_by_dynamo` both are yes; and 2.15's inductor asks the (CPU) device whether Triton has a backend for
    it before it writes a launch with options (Liger's num_warps): yes too. (Under torch 2.15 the fake run of
    compile + gc + liger failed on the first question, compile + liger on the second.)"""
    import torch.utils._triton
    from torch._dynamo.device_interface import CpuInterface

    with triton_launch.traced_by_dynamo():
        assert torch.utils._triton.has_triton() and torch.utils._triton.has_triton(include_cpu=True)
        CpuInterface.raise_if_triton_unavailable("cpu")
