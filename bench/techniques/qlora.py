"""QLoRA: a 4-bit NF4 base (bitsandbytes, double quantization, bf16 compute) plus LoRA adapters.

Saves: base weights at ~0.5 B/param plus small per-block constants (double quantization shrinks
those too) instead of 2 B/param in bf16, and, as LoRA, no base gradients or optimizer states.
Costs: dequantizing each weight block on every forward and backward matmul (slower steps), and the
LoRA costs. The recipe is spelled out (nf4, double quant, bf16 compute): bitsandbytes' defaults are not
QLoRA's. The base is loaded from a cached random checkpoint (quantization happens while loading).
MFU is left empty: the base compute is not a plain bf16 matmul.
Predicted: the base is quantized on fake tensors by bitsandbytes itself, and the scratch of CUDA's
4-bit matmul (a dequantized weight per layer, transient) is added (bench/predict/bnb.py).
"""

from __future__ import annotations

from typing import Any

from . import _quantized
from .base import Options


def _config(opts: Options) -> Any:
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=opts["double_quant"], bnb_4bit_compute_dtype=torch.bfloat16)


TECHNIQUE = _quantized.technique(
    "qlora", "4-bit NF4 base (double quant, bf16 compute) + LoRA: ~0.5 B/param of weights; dequant per matmul",
    _config, "Linear4bit", {"double_quant": True})
