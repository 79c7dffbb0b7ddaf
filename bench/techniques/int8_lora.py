"""LLM.int8 base (bitsandbytes 8-bit weights) plus LoRA adapters.

Saves: base weights at 1 B/param instead of 2, and, as LoRA, no base gradients or optimizer states.
Costs: int8 matmuls with outlier columns decomposed to 16 bits (LLM.int8, threshold 6.0): usually
slower than bf16; plus the LoRA costs. Loaded from a cached random checkpoint. MFU left empty.

Random weights are not neutral here, unlike everywhere else in the suite. A column of a matmul's input
with any value of magnitude 6.0 or more (the threshold) runs in 16 bits, and its 16-bit slice is kept
for backward. In trained models LLM.int8's paper finds a few such feature dimensions (not measured
here). A random model (transformers' init, std 0.02) has them all over the MLP's down projection,
whose input is a product of two near-normal values: Llama-3.2-3B's first two layers at 2048 tokens
have 4479 and 5644 of 8192 such columns (55% and 69%), and none in any other projection (inputs of at
most 5.34 in magnitude; `tools/int8_outliers.py llama-3.2-3b`, torch 2.13.0+cpu, seed 0). So an
int8_lora cell measures a heavily decomposed down projection, in memory and in speed; and the fake run,
which has no values, cannot say how many columns a GPU run decomposes (not predicted).
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
