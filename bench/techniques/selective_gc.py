"""Selective activation checkpointing: checkpoint some of the work, keep the rest (torchtitan's
"selective" modes).

Two policies. `every=n` checkpoints every n-th decoder layer and keeps all activations of the others
(n=1 is `gc`). `ops=matmuls` checkpoints every layer but saves the outputs of its matrix products
and attention (`torch.utils.checkpoint.create_selective_checkpoint_contexts`): backward recomputes
only the cheap element-wise ops (norms, activations, rotary embeddings) between them.
Saves: activation memory between `gc` (the least) and none. Costs: recompute between none and `gc`'s
(one forward per checkpointed layer): the point of the table is memory against tokens/s. Exact: the
same math, so the losses must track the baseline's.
"""

from __future__ import annotations

import functools
from typing import Any

from .. import models
from .base import Evidence, Options, Phase, Technique

# sdpa's kernels on a GPU and on a CPU (where the smoke matrix and the predictor's fake run dispatch it): a
# policy that saved the GPU's attention but recomputed the CPU's would predict another step than the GPU runs.
SAVED_OPS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
             "_scaled_dot_product_flash_attention_for_cpu")


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if opts["ops"] == "matmuls":
        kwargs["context_fn"] = _save_matmuls
    # transformers >= 5.2x renamed the method; the GPU image's 5.17 only has the old name
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]  # the decoder layers
    if not layers:
        raise RuntimeError("selective_gc: no layer reports gradient_checkpointing=True after enabling it")
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index % opts["every"] == 0
    kept = sum(1 for layer in layers if layer.gradient_checkpointing)
    return model, {"selective_gc_layers": kept, "selective_gc_of": len(layers), "selective_gc_ops": opts["ops"]}


def _save_matmuls() -> Any:
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = {getattr(torch.ops.aten, name) for name in SAVED_OPS if hasattr(torch.ops.aten, name)}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op.overloadpacket in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(functools.partial(policy))


def _validate(names: frozenset[str], opts: Options) -> str | None:
    if opts["every"] == 1 and opts["ops"] == "all":
        return "every=1 with ops=all is `gc`: use gc"
    return None


TECHNIQUE = Technique(
    name="selective_gc",
    summary="checkpoint every n-th layer, or every layer but keep its matmul outputs: between gc and none",
    phase=Phase.PATCH,
    options={"every": 2, "ops": "all"},
    choices={"ops": ("all", "matmuls")},
    ranges={"every": "[1, inf)"},
    conflicts=("gc",),
    validate=_validate,
    apply=_apply,
    check_cell=lambda cell, opts: models.checkpointing_problem(cell.model),
)
