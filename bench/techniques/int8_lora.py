"""LLM.int8 base (bitsandbytes 8-bit weights) plus LoRA adapters.

Saves: base weights at 1 B/param instead of 2, and, as LoRA, no base gradients or optimizer states.
Costs: int8 matmuls with outlier columns decomposed to 16 bits (LLM.int8, threshold 6.0): usually
slower than bf16; plus the LoRA costs. Loaded from a cached random checkpoint. MFU left empty.

Random weights are not neutral here, unlike everywhere else in the suite. A column of a matmul's input
with any value of magnitude 6.0 or more (the threshold) runs in 16 bits, and its 16-bit slice is kept
for backward. In trained models LLM.int8's paper finds a few such feature dimensions (not measured
here). A random model (transformers' init, std 0.02) has them all over the MLP's down projection,
whose input is a product of two near-normal values: Llama-3.2-3B at seq 2048 batch 2 has 81% of the
first layer's 8192 such columns and 90-93% of each later one's, and one column of the gate and up
projections' input in three layers, none in the attention's (`tools/int8_outliers.py llama-3.2-3b --seq
2048 --batch 2`, torch 2.13.0+cpu, seed 0). So an int8_lora cell measures a heavily decomposed down
projection, in memory and in speed. The fake run, which has no values, takes each layer's count from
that real forward on a CPU, made beforehand for the cell's model and batch shape (bench/predict/int8.py).
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
    _config, "Linear8bitLt", {})
