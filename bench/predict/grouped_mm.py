"""A mixture of experts' grouped matmul as CUDA runs it, in bf16 and in fp32 (mixed precision's experts).

transformers 5 runs a layer's experts by torch's grouped matmul (`aten._grouped_mm`). CUDA runs it by one
CUTLASS kernel where both operands and the output are bf16 on an sm90 or sm100 GPU, and otherwise by a fallback:
the groups' offsets copied to the host (a device synchronisation), then one matmul a group, each into its slice of
the output both paths allocate alike (aten/src/ATen/native/cuda/GroupedBlas.cpp, `_grouped_mm_cuda`; torch 2.11's
CUDA library has the fallback). Under `mixed` the experts' weights are fp32 and autocast leaves the grouped matmul
alone (it has no autocast kernel), so the fallback runs. The meta kernel fake tensors run accepted bf16 alone until
torch 2.15 (torch 2.11 and 2.13: "Expected inputs of BF16 type"), so such a step failed to predict; within
`as_cuda_runs` it takes fp32 and fp16 as CUDA does, its output made as CUDA makes it (the same tensor either path
writes into: the memory is the fast path's). The step's work counts the calls that take the fallback
(bench/predict/flops.py, `takes_fallback`; the prediction's evidence, FALLBACK_CALLS), and such a step is not timed
(`UNTIMED`): a synchronisation a call, which the step time model's unsynchronised sides do not hold, and a kernel
an expert.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

OP = "_grouped_mm"
FALLBACK_CALLS = "grouped_mm_fallback_calls"  # the evidence's key: a step's grouped matmuls CUDA runs by its fallback
UNTIMED = ("its experts' grouped matmuls are not bf16, so CUDA runs them by its fallback (a device synchronisation "
           "and a matmul an expert, each call), which the step time model does not time")


def takes_fallback(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether CUDA runs this grouped matmul by its fallback on an sm90 or sm100 GPU: an operand or the output not
    bf16 (on other GPUs every call does)."""
    import torch

    if func._opname != OP:  # every op a step dispatches comes here: the cheap test first
        return False
    out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None) or args[0].dtype
    return not args[0].dtype == args[1].dtype == out_dtype == torch.bfloat16


@contextlib.contextmanager
def as_cuda_runs() -> Iterator[None]:
    """Within: the grouped matmul's meta kernel takes the fp32 and fp16 operands CUDA's fallback takes."""
    import torch
    from torch import _meta_registrations as meta

    original = getattr(meta, "_meta_grouped_mm_common", None)
    if original is None:  # a torch without it: its meta kernel as it is
        yield
        return
    fallback_dtypes = (torch.float32, torch.float16)

    def common(mat_a: Any, mat_b: Any, scale_a: Any, scale_b: Any, offs: Any = None, bias: Any = None,
               scale_result: Any = None, out_dtype: Any = None, use_fast_accum: bool = False) -> Any:
        if scale_a is None and scale_b is None and (mat_a.dtype in fallback_dtypes or mat_b.dtype in fallback_dtypes):
            return meta._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype or mat_a.dtype)
        return original(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum)

    meta._meta_grouped_mm_common = common
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = original


def untimed_reason(evidence: Mapping[str, Any]) -> str | None:
    """Why a prediction's step is not timed, where its grouped matmuls take CUDA's fallback (its evidence)."""
    return UNTIMED if evidence.get(FALLBACK_CALLS) else None
