"""torchao's low-bit AdamW (`torchao.optim`): AdamW8bit, AdamW4bit or AdamWFp8, beside bitsandbytes'.

Saves: optimizer state. Both moments are stored block-wise quantized as tensor subclasses: 8-bit
codes with a scale per 256 values (about 2 B/param for both moments), 4-bit codes with a scale per 128
(about 1 B/param), or float8 (e4m3) with a scale per 256 (about 2 B/param), against 4 B/param for
AdamW's two bf16 moments. Tensors under 4096 elements keep full-precision state (torchao's
`min_quant_size`). Costs: dequantize, update and requantize each step, a step torchao compiles with
torch.compile: the first step pays the compilation (first_step_s), later ones run the compiled
kernel. Not exact: the moments are rounded, so losses drift from the baseline's after the first
update. Runs on the CPU (the compiled step is C++ there), so its code path is tested without a GPU.
Predicted: its states made as torchao makes them, its compiled step as the GPU's kernels allocate
(bench/predict/torchao_optim.py); its step time is not.
"""

from __future__ import annotations

from typing import Any

from ._evidenced import Evidenced
from .base import Options, Phase, Technique, TrainSetup

OPTIMIZERS = {"int8": "AdamW8bit", "int4": "AdamW4bit", "fp8": "AdamWFp8"}  # the moments' format -> class


def make(params: list[Any], setup: TrainSetup, opts: Options) -> Evidenced:
    import torchao.optim

    name = OPTIMIZERS[opts["state"]]
    optimizer = getattr(torchao.optim, name)(params, lr=setup.lr)
    return Evidenced(optimizer, {"torchao_optimizer": name, "torchao_block_size": optimizer.block_size,
                                 "torchao_version": torchao.__version__})


TECHNIQUE = Technique(
    name="torchao_adamw",
    summary="torchao low-bit AdamW (int8, int4 or fp8 moments): ~2 or ~1 B/param of optimizer state",
    phase=Phase.OPTIMIZER,
    slot="optimizer",
    options={"state": "int8"},
    choices={"state": tuple(OPTIMIZERS)},
    packages=("torchao",),
    conflicts=("zero2", "zero3"),  # DeepSpeed owns the optimizer
    make_optimizer=make,
)
