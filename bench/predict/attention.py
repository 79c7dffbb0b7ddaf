"""The scratch of CUDA's flash attention backward, which the fake run's attention does not allocate.

The fake run's sdpa dispatches to flash attention for the CPU, which saves what CUDA's flash kernel
saves (the output and the log-sum-exp) and whose backward allocates dQ, dK and dV and nothing else.
CUDA's backward (FlashAttention-2 in PyTorch: `mha_bwd` in
aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, the same in torch 2.9 to 2.13)
first makes its inputs contiguous as the kernel takes them, (batch, seq, heads, head_dim):

- a copy of grad_out unless its transpose already is contiguous;
- a copy of out unless q's transpose is (the forward allocates out like q's transpose, `empty_like`):
  none in a model's attention, whose q is a transposed projection; one for a plain (batch, heads, seq,
  head_dim) tensor such as the GPU test's (seen on an H200, torch 2.11: two q-sized buffers before dQ);

then allocates dQ, dK, dV, then:

- `softmax_d`: fp32, (batch, heads, seq rounded up to 128); returned to `_flash_attention_backward`,
  which drops it;
- `dq_accum`: fp32, (batch, seq rounded up to 128, heads, head_dim rounded up to 32, or to 64 above
  128): the dQ accumulator;
- with grouped-query attention (fewer K/V heads than query heads): dK and dV for every query head
  (batch, seq, heads, head_dim, in q's dtype), then summed over each group into dK and dV.

All are freed as the op returns: no new allocated peak on the published cells, but they take cached
blocks, so what the caching allocator reserves can change. On the 61 published H100 cells
(Llama-3.2-1B/3B: grouped-query attention) the allocated peaks do not move and the reserved ones
move on 7 cells, by at most 0.66 points (gc + liger at seq 2048 batch 2: -0.45% -> -1.11%); the
median error stays 0.39%. Placing the same scratch before dQ, dK, dV instead would bring the three
gc cells at -3.0% to +0.1%: a sign that the allocation order matters there, not a reason to choose
an order the kernel does not have.

Which kernel the GPU runs is sdpa's choice per call: flash for a call without a mask in bf16/fp16
with head_dim at most 256 on sm80 and newer, unless cuDNN's kernel ranks first (torch 2.10 and newer
with a runtime cuDNN above 9.15.0 on sm90/sm100) and takes the call. Rows record the attention ops that
ran and the runtime cuDNN (evidence `attention_ops`, `cudnn_version`: bench/kernels.py): on the H200
(torch 2.11 for CUDA 13, cuDNN 9.19) every cell ran `_scaled_dot_product_cudnn_attention`, and so, from the
same image, did the H100 runs before the evidence was kept. There cuDNN's backward allocates, after dQ, dK
and dV, one workspace freed as it returns: in the H200's cell traces (Llama-3.2-3B, grouped-query) exactly
the bytes of FlashAttention-2's softmax_d, dq_accum and expanded dK and dV together, plus 512 B, at batch 2
x 2048 tokens (101,057,024 B, one per layer) and batch 1 x 1024 (25,264,640 B). `backward_scratch` picks
cuDNN's on sm90/sm100 under torch 2.10 and newer (a torch built for CUDA 12 with an older cuDNN runs
flash there: the prediction assumes the CUDA 13 builds' cuDNN), flash's elsewhere. Its contiguous copies
are taken to be flash's (a model's attention makes none). A call with a mask (padding, packing) runs
another kernel on the GPU: no scratch is modelled for it.
"""

from __future__ import annotations

from typing import Any

from .counter import NO_SCRATCH, KernelScratch, Scratch
from .gpus import GpuKind

FLASH_BACKWARD_OP = "_scaled_dot_product_flash_attention_for_cpu_backward"  # the fake run's sdpa backward
FLASH_DTYPES = ("torch.bfloat16", "torch.float16")
FLASH_MAX_HEAD_DIM = 256


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


CUDNN_EXTRA_BYTES = 512  # cuDNN's backward workspace beyond flash's pieces, in both traces
CUDNN_FIRST_CAPABILITIES = ((9, 0), (10, 0))  # where sdpa ranks cuDNN's kernel first (torch 2.10 on)


def backward_scratch(gpu: GpuKind) -> KernelScratch:
    """The attention backward's scratch on this GPU kind under the installed torch: cuDNN's where sdpa
    runs it first, else flash's (see the module's text)."""
    import torch

    major_minor = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if gpu.compute_capability in CUDNN_FIRST_CAPABILITIES and major_minor >= (2, 10):
        return cudnn_backward_scratch
    return flash_backward_scratch


def cudnn_backward_scratch(op: str, args: Any, kwargs: Any) -> Scratch:
    """cuDNN's attention backward: flash's pieces after dQ, dK, dV as one workspace, 512 B more."""
    flash = flash_backward_scratch(op, args, kwargs)
    if not flash.after:
        return flash
    return Scratch(before=flash.before, after=(sum(flash.after) + CUDNN_EXTRA_BYTES,))


def flash_backward_scratch(op: str, args: Any, kwargs: Any) -> Scratch:
    """What CUDA's flash attention backward allocates before dQ, dK, dV (its contiguous copies) and after
    them, and frees as it returns (see the module's text); nothing for another op or a call the GPU's
    flash kernel would not take."""
    if op != FLASH_BACKWARD_OP:
        return NO_SCRATCH
    # (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask, scale)
    grad_out, query, key, out = args[0], args[1], args[2], args[4]
    mask = args[8] if len(args) > 8 else kwargs.get("attn_mask")
    batch, heads, seq_q, head_dim = query.shape
    kv_heads, seq_k = key.shape[1], key.shape[2]
    if mask is not None or str(query.dtype) not in FLASH_DTYPES or head_dim > FLASH_MAX_HEAD_DIM:
        return NO_SCRATCH
    seq_q_rounded = _round_up(seq_q, 128)
    head_dim_rounded = _round_up(_round_up(head_dim, 8), 32 if head_dim <= 128 else 64)
    softmax_d = batch * heads * seq_q_rounded * 4
    dq_accum = batch * seq_q_rounded * heads * head_dim_rounded * 4
    expanded = (batch * seq_k * heads * head_dim * query.element_size(),) * 2 if kv_heads != heads else ()
    copies = tuple(out.numel() * out.element_size() for layout in (grad_out, query)
                   if not layout.transpose(1, 2).is_contiguous())
    return Scratch(before=copies, after=(softmax_d, dq_accum, *expanded))
