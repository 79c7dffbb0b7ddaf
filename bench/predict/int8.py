"""LLM.int8 bases (int8_lora) on fake tensors: the 8-bit weights a load makes, and the outlier columns
each matmul runs in 16 bits, counted on a CPU beforehand.

A load quantizes each weight of a replaced linear layer (bitsandbytes 0.50, Int8Params._quantize): the weight
in fp16 on the GPU, then its row scales (fp32, one a row) and its int8 codes; the fp16 copy is freed
(`int8_weight`). The layer then holds the codes and the scales; its weight *is* the codes.

Each forward of such a layer (MatMul8bitLt, the weight frozen) casts its input to fp16 and quantizes it row
by row; a column of the input holding any value of magnitude 6.0 or more (the threshold) is an outlier
column. CUDA's quantization (backends/cuda/ops.py) makes the row scales and codes, the input's magnitudes
(fp16) compared with the threshold (a bool mask of the input's size, kept until it returns), the columns with
any outlier, and their indices (int64). Then `int8_mixed_scaled_mm` (backends/default/ops.py, which CUDA
runs): the outlier columns of the input in its own dtype (saved for backward), the weight's same columns
dequantized (fp32, then the input's dtype), the int8 matmul (int32 out, dequantized to fp16, cast to the
input's dtype), and the outlier columns' product added into a new output. Backward dequantizes the whole
weight into the input's dtype for the input's gradient.

Which columns are outliers depends on the values, which fake tensors do not have. Their number, a layer at
a time, is counted before on a CPU by a real forward of the same architecture with this suite's random
weights over random tokens of the cell's batch shape (`tools/int8_outliers.py ... --write`, into
results/int8-outliers/MODEL.json): another draw of the weights and tokens than the GPU run's, so the count is
the GPU's in expectation, not to the column. Llama-3.2-3B at seq 2048 batch 2 (torch 2.13 on a CPU): 81% of
the first layer's down projection's 8,192 columns, 90-93% of every later one's, and one column of the gate
and up projections' input in three layers. While a cell is predicted, each quantized layer's forward makes
that many indices (`predicting`). The adapters' training moves the down projection's input a little from step
to step: the count is the first step's. Not predicted: a cell whose model and batch shape have no count, padded
or packed batches (the counts' rows are full), and ZeRO (its hybrid does not model int8 weights).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

from .counter import NO_SCRATCH, Scratch

if TYPE_CHECKING:
    from ..cells import Cell

COUNTS_DIR = Path(__file__).resolve().parents[2] / "results" / "int8-outliers"
THRESHOLD = 6.0  # bitsandbytes' llm_int8_threshold, as transformers' BitsAndBytesConfig sets it


def counts_path(model: str) -> Path:
    return COUNTS_DIR / f"{model}.json"


def batch_key(seq_len: int, batch_size: int) -> str:
    return f"s{seq_len}_b{batch_size}"


def layer_key(module_name: str) -> str:
    """A linear layer's name from `layers.` on, without peft's `.base_layer`: the same in the plain model the
    counts come from and in the adapted one the fake run steps."""
    found = re.search(r"layers\.\d+\..*", module_name.removesuffix(".base_layer"))
    return found.group(0) if found else module_name


def forward_rows(cell: Cell) -> int:
    """Rows of the batch one forward sees: the cell's, or a micro-batch's under gradient accumulation."""
    accumulation = next((u for u in cell.stack.uses if u.name == "grad_accum"), None)
    return cell.batch_size // int(accumulation.opts["steps"]) if accumulation else cell.batch_size


def outlier_counts(cell: Cell) -> dict[str, int] | None:
    """Outlier columns a quantized layer (`layer_key`), counted for this cell's model and the shape of the batch
    a forward sees; None where not counted. A layer not listed has none."""
    path = counts_path(cell.model)
    if not path.exists():
        return None
    found = json.loads(path.read_text())["counts"].get(batch_key(cell.seq_len, forward_rows(cell)))
    return None if found is None else {str(k): int(v) for k, v in found.items()}


def unsupported_reason(cell: Cell) -> str | None:
    """Why an int8_lora cell cannot be predicted (under ZeRO; its outlier columns not counted), or None."""
    if "int8_lora" not in cell.stack.names:
        return None
    if {"zero2", "zero3"} & set(cell.stack.names):
        return "an LLM.int8 base under ZeRO: the hybrid's model states are not modelled for int8 weights"
    shaped = sorted({"padding", "packing", "dynamic_padding"} & set(cell.stack.names))
    if shaped:
        return f"LLM.int8's outlier columns are counted over full rows of random tokens, not {', '.join(shaped)}'s batches"
    if outlier_counts(cell) is not None:
        return None
    rows = forward_rows(cell)
    return (f"LLM.int8's outlier columns not counted for {cell.model} at seq {cell.seq_len}, {rows} row"
            f"{'s' if rows != 1 else ''} a forward: "
            f"python tools/int8_outliers.py {cell.model} --seq {cell.seq_len} --batch {rows} --write")


def is_int8(tensor: Any) -> bool:
    """A meta 8-bit weight, not quantized yet (bitsandbytes' Int8Params)."""
    try:
        from bitsandbytes.nn import Int8Params
    except ImportError:
        return False
    return isinstance(tensor, Int8Params) and tensor.CB is None


def int8_weight(meta_weight: Any) -> tuple[Any, Any]:
    """(codes, row scales) of a meta 8-bit weight as a GPU load makes them (the module's text); the codes are
    the parameter, carrying both as a loaded Int8Params does. Call in fake mode."""
    import torch

    rows = meta_weight.shape[0]
    half = torch.empty(meta_weight.shape, dtype=torch.float16)
    scales = torch.empty(rows, dtype=torch.float32)
    codes: Any = torch.nn.Parameter(torch.empty(meta_weight.shape, dtype=torch.int8), requires_grad=False)
    del half
    codes.CB, codes.SCB = codes, scales
    return codes, scales


@contextlib.contextmanager
def predicting(cell: Cell, model: Any) -> Iterator[None]:
    """For an int8_lora cell: each quantized layer's forward quantizes its input with its counted outlier
    columns, and the mixed matmul allocates as CUDA's does (the module's text)."""
    counts = outlier_counts(cell) if "int8_lora" in cell.stack.names else None
    if counts is None:
        yield
        return
    import bitsandbytes as bnb
    import torch
    from bitsandbytes import functional
    from bitsandbytes.autograd._functions import MatMul8bitLt

    current = {"columns": 0}  # the layer running forward's count, set by its pre-hook (recomputation too)

    def before_forward(module_name: str) -> Any:
        def hook(module: Any, inputs: Any) -> None:
            current["columns"] = counts.get(layer_key(module_name), 0)
        return hook

    def quantize(A: Any, threshold: float = 0.0) -> tuple[Any, Any, Any]:
        return _quantized_rows(A, threshold, current["columns"])

    def gpu_matmul(A: Any, B: Any, out: Any = None, state: Any = None, threshold: float = 0.0, bias: Any = None) -> Any:
        # the GPU's path: on a CPU device, which fake tensors are on, bitsandbytes trains through a dequantized matmul
        return MatMul8bitLt.apply(A, B, out, bias, state)

    handles = [module.register_forward_pre_hook(before_forward(name)) for name, module in model.named_modules()
               if isinstance(module, bnb.nn.Linear8bitLt)]
    cast_warning = logging.getLogger("bitsandbytes.autograd._functions")  # "inputs will be cast": every forward
    try:
        with mock.patch.object(functional, "int8_vectorwise_quant", quantize), \
                mock.patch.object(torch.ops.bitsandbytes, "int8_mixed_scaled_mm", _mixed_scaled_mm), \
                mock.patch.object(bnb, "matmul", gpu_matmul), mock.patch.object(cast_warning, "disabled", True):
            yield
    finally:
        for handle in handles:
            handle.remove()


def _quantized_rows(A: Any, threshold: float, columns: int) -> tuple[Any, Any, Any]:
    """CUDA's int8_vectorwise_quant's allocations, in its order, with `columns` outlier columns."""
    import torch

    rows = A.numel() // A.shape[-1]
    row_stats = torch.empty(rows, dtype=torch.float32)
    codes = torch.empty(A.shape, dtype=torch.int8)
    if threshold <= 0.0:
        return codes, row_stats, None
    mask = A.abs() >= threshold  # kept until the kernel returns
    any_in_column = mask.any(dim=0)
    outlier_cols = torch.empty((columns, 1), dtype=torch.int64).view(-1)  # argwhere's count, found by value
    del any_in_column
    if columns and rows > 1:
        codes[:, outlier_cols] = 0
    del mask
    return codes, row_stats, outlier_cols


def _mixed_scaled_mm(A: Any, CA: Any, CB: Any, SCA: Any, SCB: Any, outlier_cols: Any = None,
                     bias: Any = None) -> tuple[Any, Any]:
    """bitsandbytes::int8_mixed_scaled_mm as its kernel allocates (the module's text), its ops dispatched
    one by one so the counter sees each."""
    import torch

    ops = torch.ops.bitsandbytes
    if outlier_cols is None or outlier_cols.numel() == 0:
        return ops.int8_scaled_mm.default(CA, CB, SCA, SCB, bias=bias, dtype=A.dtype), torch.empty(0, dtype=A.dtype)
    sub_a = A[:, outlier_cols].contiguous()
    sub_b = ops.int8_vectorwise_dequant.default(CB[:, outlier_cols].contiguous(), SCB).to(A.dtype).t()
    output = ops.int8_scaled_mm.default(CA, CB, SCA, SCB, bias=bias, dtype=A.dtype)
    return output.addmm(sub_a, sub_b), sub_a


def kernel_scratch(op: str, args: Any, kwargs: Any) -> Scratch:
    """What CUDA's int8 kernels allocate inside the op that their fake kernels do not: the int8 matmul's int32
    product and its fp16 dequantization (before the output in the asked dtype); the dequantization of codes
    (codes times scales in fp32, then times 1/127: two fp32 tensors, the first freed)."""
    if op == "int8_scaled_mm":
        a, b = args[0], args[1]
        elements = a.numel() // a.shape[-1] * b.shape[0]
        dtype = kwargs.get("dtype", args[5] if len(args) > 5 else None)
        return Scratch(before=(elements * 4, elements * 2) if dtype not in (None, _fp16()) else (elements * 4,))
    if op == "int8_vectorwise_dequant":
        return Scratch(before=(args[0].numel() * 4,))
    return NO_SCRATCH


def _fp16() -> Any:
    import torch

    return torch.float16
