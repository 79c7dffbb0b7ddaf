"""torch.compile of each decoder layer (torchtitan's per-block compile), or of the whole model.

Saves: activation memory and time where inductor fuses elementwise ops (norms, activations, residual
adds): a fused kernel keeps fewer intermediates for backward and reads memory fewer times. Costs:
compilation on the first step (reported in first_step_s, never in the measured steps; the warm-up
steps let recompiles settle, and the evidence counts the graphs compiled), and a dependency on the
inductor toolchain (Triton on a GPU, a C++ compiler on a CPU). `scope=layers` (default) compiles
each decoder layer once per distinct shape; `scope=model` compiles the model's forward in one
graph, loss included. Exact up to the rounding of fused kernels: losses track the baseline's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .base import Evidence, Options, Phase, Technique


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    if opts["scope"] == "model":
        model.compile()
        return model, {"compile_scope": "model", "compiled_modules": 1}
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]  # the decoder layers
    if not layers:
        raise RuntimeError(f"compile: {type(model).__name__} has no decoder layers to compile")
    for layer in layers:
        layer.compile()  # in place: gc and adapters applied later still wrap or live inside the compiled call
    return model, {"compile_scope": "layers", "compiled_modules": len(layers)}


@contextlib.contextmanager
def _count_graphs(cell: Any, opts: Options, evidence: Evidence) -> Iterator[None]:
    """After each step: the graphs dynamo has compiled in this worker so far (a recompile adds one, so
    a count that grows with the steps says the warm-up did not settle)."""
    from torch._dynamo.utils import counters

    yield
    evidence["compile_graphs"] = int(counters["stats"]["unique_graphs"])


TECHNIQUE = Technique(
    name="compile",
    summary="torch.compile per decoder layer (or the whole model): fused kernels, fewer saved intermediates",
    phase=Phase.PATCH,
    options={"scope": "layers"},
    choices={"scope": ("layers", "model")},
    not_predicted="inductor's fused kernels allocate differently than eager ops: not run on fake tensors yet",
    apply=_apply,
    around_step=_count_graphs,
)
