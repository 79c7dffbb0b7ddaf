"""LLM.int8 base (bitsandbytes 8-bit weights) plus LoRA adapters.

Saves: base weights at 1 B/param instead of 2, and, as LoRA, no base gradients or optimizer states.
Costs: int8 matmuls with outlier columns decomposed to 16 bits (LLM.int8, threshold 6.0): usually
slower than bf16; plus the LoRA costs. Loaded from a cached random checkpoint. MFU left empty.
"""

from __future__ import annotations

from typing import Any

from . import _quantized
from .base import Options


def _config(opts: Options) -> Any:
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True)


TECHNIQUE = _quantized.technique(
    "int8_lora", "LLM.int8 8-bit base + LoRA: 1 B/param of weights; int8 matmuls with fp16 outliers",
    _config, "Linear8bitLt", {},
    not_predicted="LLM.int8 decomposes outlier columns, found by value: data-dependent on fake tensors")
