"""DeepSpeed as the cell's engine: config assembled from the stack's fragments; world size 1, or
torchrun's ranks.

The base config is the suite's baseline translated to DeepSpeed: micro-batch = the cell's batch, no
accumulation, bf16 — which in DeepSpeed means bf16 weights with **fp32 master weights and fp32 Adam
states** in the optimizer (compare with the `mixed` stack, not only with the pure-bf16 baseline) —
and AdamW at the suite's learning rate, with `torch_adam: true`: torch's AdamW instead of DeepSpeed's
JIT-built FusedAdam / CPUAdam, so no kernel is compiled at run time (the engine techniques' option
`adam=deepspeed` selects those). DeepSpeed owns backward (loss scaling, gradient partitioning), the
step (which also zeroes the gradients) and its own checkpoint formats.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import deferred, distributed
from ..techniques.base import Evidence, Options, Technique, TrainSetup
from .base import EngineJob


@dataclass
class DeepSpeedEngine:
    model: Any  # the DeepSpeedEngine: forward, backward and step go through it
    optimizer: Any  # its ZeRO optimizer, which wraps torch's

    def backward(self, loss: Any) -> None:
        self.model.backward(loss)

    def step(self) -> None:
        self.model.step()

    def save(self, kind: str, directory: Path) -> None:
        """full: each rank its partition of fp32 master weights and optimizer state; model: the 16-bit
        weights (ZeRO-3 first gathers its partitions)."""
        if kind == "full":
            self.model.save_checkpoint(str(directory))
        elif not self.model.save_16bit_model(str(directory)):
            raise RuntimeError("DeepSpeed did not save the 16-bit model (stage3_gather_16bit_weights_on_model_save?)")

    def optimizer_state(self) -> Iterable[Any]:
        import torch

        inner = self.optimizer
        while hasattr(inner, "optimizer"):  # DeepSpeed's ZeRO optimizer -> torch's AdamW, which holds the state
            inner = inner.optimizer
        return (t for state in inner.state.values() for t in state.values() if torch.is_tensor(t))


def wrap(job: EngineJob) -> tuple[DeepSpeedEngine, Evidence]:
    """The engine, and evidence of what it reports it does."""
    import deepspeed
    import torch

    cuda = torch.cuda.is_available()
    distributed.init(cuda)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")  # adopts the group above
    ds_config = config(job.uses, job.setup, job.cell.batch_size)
    if job.deferred is not None:  # ZeRO-3: the partitions get their memory and the build's weights only now
        _partition_deferred(job, ds_config)
    trainable = [p for p in job.model.parameters() if p.requires_grad]  # a deferred build's are new objects
    engine, optimizer, _, _ = deepspeed.initialize(model=job.model, model_parameters=trainable,
                                                   config=copy.deepcopy(ds_config))
    offload_param = engine.zero_offload_param()
    evidence = {
        "zero_stage": engine.zero_optimization_stage(),
        "offload_optimizer": "cpu" if engine.zero_cpu_offload() else "none",
        "offload_param": offload_device(offload_param),
        "ds_world_size": torch.distributed.get_world_size(),
        "ds_optimizer": f"{type(optimizer).__name__}({type(getattr(optimizer, 'optimizer', None)).__name__})",
        "ds_init": "deferred" if job.deferred is not None else "whole model first",
    }
    return DeepSpeedEngine(engine, optimizer), evidence


def offload_device(offload_param: Any) -> str:
    """Where ZeRO-3 keeps the parameters: "none", "cpu" or "nvme". DeepSpeed's config holds the enum's value,
    a str, where its pydantic models keep enum values (0.19.8 does), else the enum member."""
    if offload_param is None:
        return "none"
    device = offload_param.device
    return str(getattr(device, "value", device))


def _partition_deferred(job: EngineJob, ds_config: dict[str, Any]) -> None:
    """A meta-built model (bench/deferred.py) partitioned as a checkpoint loads under ZeRO-3: module by
    module, each parameter is given its memory whole, uninitialised, and partitioned at once by
    DeepSpeed (as zero.Init given the module does: onto the GPU or, offloaded, the host); then the
    build's init is replayed into the partitions, each parameter gathered whole (GatheredParameters)
    and written in place. One whole parameter at most exists beside the partitions (and a temporary
    for a write in another dtype)."""
    import deepspeed

    made: dict[int, Any] = {}  # id(meta parameter) -> the parameter with memory (a tied one is made once)
    converter: Any = None  # DeepSpeed's first converted parameter: it converts the others as its zero.Init would
    for module in reversed(list(job.model.modules())):  # children first: each parameter is converted once
        own = [name for name, p in module._parameters.items() if p is not None and not hasattr(p, "ds_id")]
        for name in own:
            module._parameters[name] = _with_memory(module._parameters[name], job.device, made)
        params = [module._parameters[name] for name in own]
        if params and converter is None:
            deepspeed.zero.Init(module=module, config_dict_or_path=copy.deepcopy(ds_config))
            converter = params[0]
        elif params:
            converter.convert_to_zero_parameters(param_list=params)
    deferred.replay(job.model, job.deferred, job.device,
                    opened=lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=0))


def _with_memory(param: Any, device: str, made: dict[int, Any]) -> Any:
    """`param` with uninitialised memory on `device` if it is on meta (a new Parameter: meta data cannot
    be swapped in place), in bf16 as deepspeed.initialize casts the parameters of a model built whole."""
    import torch

    if id(param) not in made:
        dtype = torch.bfloat16 if param.is_floating_point() else param.dtype
        if param.is_meta:
            made[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                                 requires_grad=param.requires_grad)
        else:
            param.data = param.data.to(dtype)
            made[id(param)] = param
    return made[id(param)]


def config(uses: tuple[tuple[Technique, Options], ...], setup: TrainSetup, batch_size: int) -> dict[str, Any]:
    merged: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        # torch AdamW's implementation pinned (DeepSpeed passes only `foreach` through): the same
        # multi-tensor update on every host, never torch's device-dependent default
        "optimizer": {"type": "AdamW", "params": {"lr": setup.lr, "torch_adam": True, "foreach": True}},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    for technique, opts in uses:
        if technique.ds_config is not None:
            _merge(merged, technique.ds_config(opts))
    return merged


def _merge(into: dict[str, Any], fragment: dict[str, Any]) -> None:
    for key, value in fragment.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


JIT_OP_DIRS = {"CPUAdamBuilder": "cpu_adam", "FusedAdamBuilder": "fused_adam"}  # builder -> its build folder


def jit_ops(cell: Any) -> tuple[str, ...]:
    """The DeepSpeed op builders a cell's engine will JIT-compile on first use (none with the default
    `adam=torch`): CPUAdam when the optimizer is offloaded, FusedAdam (the CUDA or the CPU one) otherwise."""
    if not any(use.name in ("zero2", "zero3") and use.opts["adam"] == "deepspeed" for use in cell.stack.uses):
        return ()
    return ("CPUAdamBuilder",) if "offload" in cell.stack.names else ("FusedAdamBuilder",)
