"""FSDP2: torch's fully sharded data parallel (`fully_shard`), one unit per decoder layer.

Saves: on N GPUs, each holds 1/N of the weights, gradients and optimizer states (ZeRO-3's
partitioning, in torch itself); `reshard=false` keeps each layer's gathered weights from forward to
backward (ZeRO-2-like: less communication, more memory). `precision=mixed` keeps fp32 sharded
master weights and Adam states, computing in bf16 and reducing gradients in fp32 (what DeepSpeed
does: compare like with like); `pure` (default) keeps everything bf16, like the baseline. With
`offload(params=true)`, FSDP's CPUOffloadPolicy keeps the sharded parameters, gradients and
optimizer state in host RAM and steps the optimizer on the CPU.
Built as FSDP recipes build (bench/deferred.py): on the meta device, sharded, then each rank's
shards made and initialised, so no GPU ever holds the whole model (the weights are still a plain
build's of the same seed, bit for bit).
Costs: an all-gather per layer in forward and in backward and a reduce-scatter of gradients
(communication, on one GPU still the bookkeeping); with offload, PCIe traffic and a CPU optimizer step.
"""

from __future__ import annotations

from dataclasses import replace

from .base import Options, Phase, Technique, TrainSetup


def _configure(setup: TrainSetup, opts: Options) -> TrainSetup:
    master = "fp32" if opts["precision"] == "mixed" else setup.param_dtype
    return replace(setup, engine="fsdp", param_dtype=master, build_on_meta=True)


TECHNIQUE = Technique(
    name="fsdp",
    summary="FSDP2 fully_shard per layer: weights, grads and optimizer state sharded over GPUs; gathers",
    phase=Phase.ENGINE,
    slot="engine",
    options={"precision": "pure", "reshard": True},
    choices={"precision": ("pure", "mixed")},
    # mixed: FSDP's own policy replaces autocast; quantized bases and bitsandbytes' optimizers do not
    # take DTensor parameters.
    conflicts=("mixed", "qlora", "int8_lora", "adamw8bit", "paged_adamw8bit"),
    configure=_configure,
)
