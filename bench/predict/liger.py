"""Liger's kernels on fake tensors: its Python wrappers run as they are, its Triton kernels do not.

A Triton kernel allocates no memory: it reads and writes buffers that its Python wrapper allocated
with torch. So Liger's wrappers (RMSNorm, SwiGLU, RoPE, the fused linear cross-entropy) run on fake
tensors with every kernel launch a no-op, and allocate and save exactly what they do on a GPU.

Except where a wrapper picks its path by device type: the fake tensors here are CPU tensors. One
wrapper does so where it matters, the fused linear cross-entropy's forward. Its CPU path makes a new
(chunk x vocab) logits tensor per chunk and adds each chunk's weight gradient through an fp32
(vocab x hidden) temporary; on CUDA it writes the logits into one buffer and accumulates the weight
gradient in place. That forward is mirrored here, allocation for allocation, as liger-kernel
MIRRORED_VERSION does it on CUDA; another version is not predicted (`unsupported_reason`). The
other wrappers' device branches size scratch buffers only: RMSNorm's backward keeps a (SMs x hidden)
fp32 partial weight gradient, one row on a CPU and 132 on an H100 (1.5 MiB at hidden 3072), freed
at once.

Its work, for the step's time (bench/predict/flops.py): the Triton kernels each read or write their
tensors once, twice one they overwrite (SwiGLU's backward writes its inputs' gradients over them, RoPE
rotates q and k in place: bench/predict/triton_launch.py, fake-run/24); the cross-entropy kernel, which
the mirror counts as it runs (the logits read twice, written once); and the two matmuls the mirror
writes in place, counted with their bytes: a chunk's matmuls are memory-bound (fake-run/23; before,
counted by their FLOPs alone, which put Llama-3.2-3B's `liger` at seq 2048 batch 2 on the H100 13.5%
short of its measured 196.9 ms).

Data-dependent: the forward counts the labels that are not ignored (`.item()`), which scales the
loss and gradients but no allocation. Fake tensors hold no values, so the count is the token count.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from importlib import metadata
from typing import Any

from . import flops, triton_launch

MIRRORED_VERSION = "0.8.5"


def unsupported_reason() -> str | None:
    """Why Liger cells cannot be predicted with what is installed here, or None."""
    try:
        installed = metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        return "liger-kernel is not installed (the fake run runs its Python wrappers)"
    if installed != MIRRORED_VERSION:
        return (f"liger-kernel {installed}: the fake run mirrors the fused linear cross-entropy of "
                f"{MIRRORED_VERSION} only")
    return None


@contextlib.contextmanager
def predicting(family: str) -> Iterator[None]:
    """One Liger cell's prediction: its kernels faked while it runs, and its patch undone after it.
    Liger patches the family's modeling module and its model's forward with no undo (a measured cell
    has its own process); predictions share a process, so the module is restored as it was."""
    with _patch_undone(family), _fake_kernels():
        yield


def modeling_module(family: str) -> str:
    """The modeling module Liger patches for a family (model_type): gemma3_text's is gemma3's."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(family)
    return f"transformers.models.{name}.modeling_{name}"


@contextlib.contextmanager
def _patch_undone(family: str) -> Iterator[None]:
    import torch

    module = importlib.import_module(modeling_module(family))
    names = dict(vars(module))
    forwards = {cls: cls.__dict__["forward"] for cls in names.values()
                if isinstance(cls, type) and cls.__module__ == module.__name__ and "forward" in cls.__dict__}
    cross_entropy = torch.nn.functional.cross_entropy  # patched with the option cross_entropy=True
    try:
        yield
    finally:
        for added in set(vars(module)) - set(names):
            if not added.startswith("__"):  # torch.compile's globals for its code (`__builtins_dict___N`): it
                delattr(module, added)      # deletes them itself when the code is freed (a KeyError at exit, before)
        vars(module).update(names)
        for cls, forward in forwards.items():
            setattr(cls, "forward", forward)  # noqa: B010 (cls is any class of the module)
        torch.nn.functional.cross_entropy = cross_entropy


@contextlib.contextmanager
def _fake_kernels() -> Iterator[None]:
    """While predicting: every Triton kernel launch does nothing, and the fused linear cross-entropy
    takes its CUDA path (`_flce_forward_cuda_path`, `_flce_backward`)."""
    from liger_kernel.ops import fused_linear_cross_entropy as flce

    forward, backward = flce.fused_linear_cross_entropy_forward, flce.fused_linear_cross_entropy_backward
    flce.fused_linear_cross_entropy_forward = _flce_forward_cuda_path
    flce.fused_linear_cross_entropy_backward = _flce_backward
    try:
        with triton_launch.no_launches():
            yield
    finally:
        flce.fused_linear_cross_entropy_forward, flce.fused_linear_cross_entropy_backward = forward, backward


def _flce_forward_cuda_path(_input: Any, weight: Any, target: Any, ce_weight: Any = None, bias: Any = None,
                            ignore_index: int = -100, reduction: str = "mean", accum_dtype: Any = None,
                            compute_gradients: bool | None = None, weight_requires_grad: bool | None = None,
                            chunk_mem_const: int = 1, **options: Any) -> tuple[Any, ...]:
    """liger_kernel.ops.fused_linear_cross_entropy.fused_linear_cross_entropy_forward (0.8.5) as it
    allocates on CUDA (sm >= 80): the same buffers in the same order, kernels left out. The options this
    suite never sets (class weights, bias, z-loss, token scaling or accuracy, another CE implementation,
    per-token output gradients) are refused rather than guessed."""
    import torch
    import triton

    # softcap (gemma2's final logit softcapping) is applied inside the kernel, to the logits in place: no buffer
    refused = [k for k in ("lse_square_scale", "label_smoothing", "return_z_loss", "use_token_scaling",
                           "return_token_accuracy", "return_predicted_tokens", "ce_impl", "ce_mode",
                           "token_grad_output") if options.get(k)]
    if ce_weight is not None or bias is not None or refused:
        raise NotImplementedError(f"liger fused linear cross-entropy: {refused or ['ce_weight/bias']} not mirrored")
    input_requires_grad = _input.requires_grad if compute_gradients is None else compute_gradients
    weight_needs_grad = weight.requires_grad if weight_requires_grad is None else weight_requires_grad
    (tokens, _), vocab = _input.shape, weight.shape[0]
    chunk_size = min(triton.next_power_of_2(triton.cdiv(tokens, triton.cdiv(vocab, chunk_mem_const * _input.shape[1]))),
                     tokens)  # Liger's chunking, as it computes it

    grad_input = torch.zeros_like(_input)
    grad_weight = None
    if input_requires_grad and weight_needs_grad:
        grad_weight = torch.zeros_like(weight, dtype=accum_dtype or weight.dtype)
    loss_1d = torch.zeros(tokens, dtype=torch.float32, device=_input.device)
    target_mask = target != ignore_index  # alive to the end, as in Liger's forward
    target_mask.sum()  # Liger reads it with .item(): a scalar on the device
    # `_can_use_mm_out` on CUDA: the logits are written into one buffer, chunk after chunk
    device = _input.device.type  # the autocast that is on here stands for CUDA's on the GPU
    mm_out = _input.dtype == weight.dtype and _input.dtype in (torch.float16, torch.bfloat16, torch.float32) and (
        not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) == _input.dtype)
    logits_storage = torch.empty((chunk_size, vocab), dtype=_input.dtype, device=_input.device) if mm_out else None
    for start in range(0, tokens, chunk_size):
        input_chunk = _input[start:start + chunk_size]
        # the kernel overwrites the logits with their gradient, in place
        if logits_storage is not None:  # written by an mm(out=) there, which allocates nothing here either
            grad_logits = logits_storage[:len(input_chunk)]
            flops.count_undispatched_matmul(input_chunk, weight.t(), grad_logits)
        else:
            grad_logits = input_chunk @ weight.t()
        # Liger's cross-entropy kernel: reads the logits twice (their max and sum, then each one's gradient),
        # writes the gradient over them, reads the chunk's targets and writes its losses
        flops.count_undispatched_kernel([grad_logits] * 3 + [target[start:start + chunk_size],
                                                             loss_1d[start:start + chunk_size]])
        if input_requires_grad:
            if mm_out:
                torch.mm(grad_logits, weight, out=grad_input[start:start + chunk_size])
            else:
                grad_input[start:start + chunk_size] = grad_logits @ weight
        if grad_weight is not None and input_requires_grad:
            _accumulate_weight_grad(grad_weight, grad_logits, input_chunk)
        del grad_logits, input_chunk
    del logits_storage
    loss = torch.sum(loss_1d) if reduction != "none" else loss_1d
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return loss, None, None, None, grad_input, grad_weight, None


def _accumulate_weight_grad(grad_weight: Any, grad_logits: Any, input_chunk: Any) -> None:
    """grad_weight += grad_logits.t() @ input_chunk, as Liger does it on CUDA (sm >= 80, torch >= 2.8):
    with half-precision logits, `torch.addmm(..., out=grad_weight)` in place (its operands in one
    dtype); otherwise through a (vocab x hidden) product, made fp32."""
    import torch

    half = grad_logits.dtype in (torch.float16, torch.bfloat16)
    if half and grad_weight.dtype in (torch.float32, grad_logits.dtype):
        operand = input_chunk.to(grad_logits.dtype)  # a temporary where the dtypes differ, freed after the addmm
        flops.count_undispatched_matmul(grad_logits.t(), operand, grad_weight, accumulate=True)
        return
    grad_weight += torch.mm(grad_logits.t(), input_chunk).float()


def _flce_backward(grad_output: Any, grad_input: Any, grad_weight: Any, grad_bias: Any) -> tuple[Any, Any, Any]:
    """fused_linear_cross_entropy_backward (0.8.5): the gradients were computed in the forward; unless
    the loss's gradient is exactly 1 (Liger compares it with a new scalar tensor, `torch.equal`, a value
    fake tensors lack) they are scaled in place by a kernel. Either way nothing else is allocated."""
    import torch

    torch.tensor(1.0, device=grad_output.device)
    return grad_input, grad_weight, grad_bias
