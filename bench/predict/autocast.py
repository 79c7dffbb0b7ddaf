"""Mixed precision as CUDA's autocast casts, on the fake run's CPU tensors.

`mixed` runs its forward under torch.autocast. The fake run's tensors are CPU tensors, so CPU's autocast casts them,
and the two devices' policies differ (aten/src/ATen/autocast_mode.cpp and .h; each op's dispatch table says which
device has a kernel): CUDA runs these ops in fp32 where CPU leaves them in the input's dtype:

- fp32: layer_norm, rms_norm, group_norm, exp, log, rsqrt, pow, logsumexp, ... (CUDA's AT_FORALL_FP32): every
  floating input cast to fp32, so the output is fp32 and a bf16 input's fp32 copy is what backward keeps;
- fp32_set_opt_dtype: softmax, log_softmax, sum, cumsum, prod, the vector and matrix norms: run with dtype=fp32 where
  the caller gave none, so a bf16 input gives an fp32 output;
- norm: its fp32 overload (fp32_append_dtype).

A bf16 tensor reaching one of them (a LayerNorm over a projection's output, Persimmon's q/k norms; a softmax
without a dtype) is a different size on the GPU: within `as_cuda_casts` each such op, where CPU's autocast lets it
through, casts as CUDA's does, on fake and on real CPU tensors alike. What CUDA casts to bf16 that CPU does not
(einsum, mv, addmv: CPU casts the bmm or mm einsum becomes) and the ops CPU casts to fp32 that CUDA lets through
(cross_entropy_loss: transformers makes its logits fp32 before it) are left as CPU's autocast has them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

# CUDA's fp32_set_opt_dtype ops (AT_FORALL_FP32_SET_OPT_DTYPE): fp32 through their dtype argument, not a cast
SET_OPT_DTYPE = ("prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
                 "sum")
# CUDA's fp32 ops (AT_FORALL_FP32), by name: each overload CUDA registers and CPU lets through (`overloads`)
FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
        "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
        "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
        "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
        "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
        "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
        "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")
NORM_TO_FP32 = {"Scalar": "ScalarOpt_dtype", "ScalarOpt_dim": "ScalarOpt_dim_dtype"}  # norm's fp32_append_dtype
# What else CUDA's autocast casts and CPU's lets through, left as CPU's autocast has it: CUDA's lower_precision_fp
# ops CPU does not list (einsum, mv, addmv, dot, convolutions, RNN cells: an LLM's matmuls are mm, bmm and linear,
# which both cast) and its promote ops (addcmul, index_put, ...: their own type promotion widens alike)
LEFT_AS_CPU_CASTS = ("_convolution", "convolution", "cudnn_convolution", "cudnn_convolution_transpose",
                     "_scaled_dot_product_flash_attention", "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell",
                     "_cudnn_rnn", "gru_cell", "lstm_cell", "rnn_relu_cell", "rnn_tanh_cell", "addmv", "addr",
                     "chain_matmul", "einsum", "linalg_multi_dot", "mv", "dot", "vdot", "addcdiv", "addcmul", "atan2",
                     "bilinear", "cross", "index_put", "scatter_add", "tensordot")


def cuda_only(qualified_name: str) -> bool:
    """Whether CUDA's autocast has a kernel for this op overload ("aten::sum.dim_IntList") and CPU's lets it
    through."""
    import torch

    table = torch._C._dispatch_dump_table(qualified_name)
    entries = {line.split(":")[0].strip(): line for line in table.splitlines()}
    cuda, cpu = entries.get("AutocastCUDA", ""), entries.get("AutocastCPU", "")
    return bool(cuda) and "fallthrough" not in cuda and (not cpu or "fallthrough" in cpu)


def overloads(names: tuple[str, ...]) -> list[Any]:
    """Every overload of these aten ops that CUDA's autocast casts and CPU's lets through."""
    import torch

    found = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        for overload_name in packet.overloads() if packet is not None else ():
            overload = getattr(packet, overload_name)
            if cuda_only(overload.name()):
                found.append(overload)
    return found


def cuda_only_names() -> set[str]:
    """The aten ops (by name) with an overload CUDA's autocast casts and CPU's lets through, under this torch."""
    import torch

    return {name.split("::")[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and cuda_only(name)}


@contextlib.contextmanager
def as_cuda_casts() -> Iterator[None]:
    """Within: CPU's autocast casts as CUDA's does for the ops above (a kernel each, at CPU's autocast key)."""
    import torch

    library = torch.library.Library("aten", "IMPL")
    for overload in overloads(FP32):
        library.impl(overload.name().split("::")[1], _casting_to_fp32(overload), "AutocastCPU")
    for overload in overloads(SET_OPT_DTYPE):
        library.impl(overload.name().split("::")[1], _fp32_dtype(overload), "AutocastCPU")
    for overload in overloads(("norm",)):
        if overload._overloadname in NORM_TO_FP32:
            fp32_overload = getattr(torch.ops.aten.norm, NORM_TO_FP32[overload._overloadname])
            library.impl(overload.name().split("::")[1], _norm_in_fp32(overload, fp32_overload), "AutocastCPU")
    try:
        yield
    finally:
        library._destroy()


def _eligible(value: Any) -> bool:
    """A tensor CUDA's autocast would cast: floating point, not double."""
    import torch

    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _below_autocast(call: Callable[[], Any]) -> Any:
    """The op's next kernel, autocast's key excluded (as CUDA's wrapper redispatches)."""
    import torch

    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
        return call()


def _casting_to_fp32(overload: Any) -> Callable[..., Any]:
    import torch

    def cast(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        return value.to(torch.float32) if _eligible(value) and value.dtype != torch.float32 else value

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _below_autocast(lambda: overload(*cast(args), **{k: cast(v) for k, v in kwargs.items()}))
    return kernel


def _fp32_dtype(overload: Any) -> Callable[..., Any]:
    """dtype=fp32 where the caller gave none and the first argument is eligible."""
    import torch

    position = next(i for i, a in enumerate(overload._schema.arguments) if a.name == "dtype")
    keyword_only = overload._schema.arguments[position].kwarg_only

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if _eligible(args[0]):
            if keyword_only or position >= len(args):
                kwargs = {**kwargs, "dtype": kwargs.get("dtype") or torch.float32}
            elif args[position] is None:
                args = (*args[:position], torch.float32, *args[position + 1:])
        return _below_autocast(lambda: overload(*args, **kwargs))
    return kernel


def _norm_in_fp32(overload: Any, fp32_overload: Any) -> Callable[..., Any]:
    """norm of an eligible tensor by its overload with a dtype, fp32 (CUDA's fp32_append_dtype)."""
    import torch

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not _eligible(args[0]):
            return _below_autocast(lambda: overload(*args, **kwargs))
        return _below_autocast(lambda: fp32_overload(*args, **kwargs, dtype=torch.float32))
    return kernel
