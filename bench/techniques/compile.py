"""torch.compile of each decoder layer (torchtitan's per-block compile), or of the whole model.

Saves: activation memory and time where inductor fuses elementwise ops (norms, activations, residual
adds): a fused kernel keeps fewer intermediates for backward and reads memory fewer times. Costs:
compilation on the first step (reported in first_step_s, never in the measured steps; the warm-up
steps let recompiles settle, and the evidence counts the graphs compiled), and a dependency on the
inductor toolchain (Triton on a GPU, a C++ compiler on a CPU). `scope=layers` (default) compiles
each decoder layer once per distinct shape; `scope=model` compiles the model's forward in one
graph, loss included. Exact up to the rounding of fused kernels: losses track the baseline's.

`memory_budget` is AOTAutograd's activation memory budget (torch._functorch.config
.activation_memory_budget): 1 (the default) lets the partitioner save what is fastest to keep; lower
values make it recompute more in backward, down to 0 (save the least it can), so one number trades
activation memory for recompute within each compiled graph, as selective checkpointing does by hand.
The evidence gives what the last micro-batch saved for backward (`saved_for_backward_gib`, the
compiled graphs' and the eager ops' around them, parameters excluded).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .base import Evidence, Options, Phase, Technique


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    budget = {"compile_memory_budget": opts["memory_budget"]}
    if opts["scope"] == "model":
        model.compile()
        return model, {"compile_scope": "model", "compiled_modules": 1, **budget}
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]  # the decoder layers
    if not layers:
        raise RuntimeError(f"compile: {type(model).__name__} has no decoder layers to compile")
    for layer in layers:
        layer.compile()  # in place: gc and adapters applied later still wrap or live inside the compiled call
    return model, {"compile_scope": "layers", "compiled_modules": len(layers), **budget}


@contextlib.contextmanager
def _in_step(cell: Any, opts: Options, evidence: Evidence) -> Iterator[None]:
    """Around each micro-batch: the memory budget in force (graphs compile at their first call, which
    is inside the step), and what the step saves for backward counted. After it: the graphs dynamo
    has compiled in this worker so far (a recompile adds one, so a count that grows with the steps
    says the warm-up did not settle)."""
    from torch._dynamo.utils import counters
    from torch._functorch import config

    # Only the innermost saved-tensor hooks act: with activation_offload's own (it counts what it
    # moves), counting here would keep its hooks from seeing anything.
    counting = "activation_offload" not in cell.stack.names
    with config.patch(activation_memory_budget=opts["memory_budget"]), _checkpoint_side_effects_skipped(), \
            (_saved_bytes_counted(evidence) if counting else contextlib.nullcontext()):
        yield
    evidence["compile_graphs"] = int(counters["stats"]["unique_graphs"])  # 0: every layer ran eagerly


@contextlib.contextmanager
def _checkpoint_side_effects_skipped() -> Iterator[None]:
    """Lets dynamo trace a checkpointed layer whose forward writes Python state, without replaying the write when
    backward recomputes the layer (torchtitan sets the same whenever it compiles).

    Why: transformers (5.24 and 5.25 alike) checkpoints a layer's `forward` inside its (compiled) call, so dynamo
    traces torch.utils.checkpoint as one higher-order op, which refuses any Python side effect; and with the
    `kernels` package, which transformers 5.25 requires, the attention's forward is wrapped by one
    (`use_kernelized_func`: it sets and resets a global of the active kernel functions). Without this,
    `compile + gc` compiled no graph (`compile_graphs` 0): every layer ran eagerly, its predicted step time +90% on
    Llama-3.2-1B at seq 1024. That write is undone within the same forward and only picks functions at trace time,
    so skipping its replay changes nothing; a model whose checkpointed forward wrote state that backward reads
    would diverge from eager here, as under torchtitan. (Liger's RoPE is a `torch.compiler.disable`d call, which no
    setting lets dynamo trace in a checkpoint: `compile + gc + liger` still runs its layers eagerly.)"""
    from torch._dynamo import config

    if not hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        yield  # a torch without the setting
        return
    with config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        yield


@contextlib.contextmanager
def _saved_bytes_counted(evidence: Evidence) -> Iterator[None]:
    """The bytes the step saves for backward, parameters excluded, each storage once
    (`saved_for_backward_gib`; inside checkpointed layers gc's own hooks see them, not these).

    Counted without ever making a Python object of a storage (`tensor.untyped_storage()`): torch keeps such an
    object alive with its storage, and autograd then adds a later gradient to a saved one out of place (it sums in
    place only into a storage nothing else holds). Liger saves the tied lm_head's gradient, so this measurement
    once grew the step's peak by one such sum: the H200's `compile + gc + liger` (2026-11-29) peaked at 25.47 GiB
    where the step alone is predicted at 24.81, the embedding's gradient (0.73 GiB) added out of place
    (tests/test_techniques.py shows the effect on a CPU)."""
    import torch

    saved: dict[int, int] = {}  # storage id -> bytes of it up to the end of the furthest saved view

    def pack(tensor: Any) -> Any:
        if not isinstance(tensor, torch.nn.Parameter):
            storage = torch._C._storage_id(tensor)  # type: ignore[attr-defined]  # not in torch's stubs
            saved[storage] = max(saved.get(storage, 0), _bytes_to_end(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield
    evidence["saved_for_backward_gib"] = sum(saved.values()) / 2**30


def _bytes_to_end(tensor: Any) -> int:
    """A tensor's bytes from its storage's start to its last element: the storage's size for a tensor that is a
    whole allocation (what the step saves, nearly always), as its address and size are not at hand."""
    if tensor.numel() == 0:
        return 0
    spans = zip(tensor.shape, tensor.stride(), strict=True)
    last = tensor.storage_offset() + sum((size - 1) * stride for size, stride in spans)
    return int(last + 1) * tensor.element_size()


TECHNIQUE = Technique(
    name="compile",
    summary="torch.compile per decoder layer (or the whole model): fused kernels, fewer saved intermediates",
    phase=Phase.PATCH,
    options={"scope": "layers", "memory_budget": 1.0},
    choices={"scope": ("layers", "model")},
    ranges={"memory_budget": "[0, 1]"},
    compiles_forward=True,
    apply=_apply,
    around_step=_in_step,
)
