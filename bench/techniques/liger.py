"""Liger kernels (liger-kernel): Triton kernels patched into the model family's modules.

Saves: the fused linear cross-entropy never materializes the (tokens x vocab) logits and their
gradient, computing the loss chunk by chunk: at a 128k vocabulary that is the largest activation of
a step. The RMSNorm, SwiGLU (GeGLU in the gemmas) and RoPE kernels save smaller intermediates and some time.
Costs: nothing in exactness (the losses must match the baseline's within bf16 noise); the logits are
not returned. The patch is process-global and has no undo, which is why each cell has its own
process. Needs CUDA (Triton) and a supported family.
Predicted: its Python wrappers run on fake tensors, its kernels launch nothing (bench/predict/liger.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import models
from ._loss_head import causal_lm_of
from .base import Evidence, Options, Phase, Technique

if TYPE_CHECKING:
    from ..cells import Cell

# Families whose Liger patch takes these kernels and applies all of them, and whose fake run runs it
# (tests/test_predict.py). Not granite (no fused linear cross-entropy), glm4 (no RoPE); not the mixtures of
# experts (qwen3_moe, mixtral): Liger's experts are dispatched by the router's values, which fake tensors do
# not have. gemma2 needs eager_attention too (transformers has no sdpa path for its attention softcapping).
FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "phi3", "olmo2", "olmo3", "smollm3", "ministral",
            "gemma", "gemma2", "gemma3_text")
# The MLP's kernel: SwiGLU, or GeGLU where the family's MLP is gated by a GELU (the gemmas). Each family's
# patch takes one of the two; the other option does nothing there.
GEGLU_FAMILIES = ("gemma", "gemma2", "gemma3_text")
KERNELS = ("rope", "rms_norm", "swiglu", "geglu", "fused_linear_cross_entropy")


def mlp_kernel(family: str) -> str:
    return "geglu" if family in GEGLU_FAMILIES else "swiglu"


def _before_build(cell: Cell, opts: Options) -> None:
    from liger_kernel.transformers import monkey_patch

    # Patches the family's module classes, so the model built next uses Liger's. Its plain cross-entropy is
    # off: the fused one replaces it (some families' patch turns it on by default, and refuses both).
    family = models.get(cell.model).family
    kernels = ("rope", "rms_norm", mlp_kernel(family), "fused_linear_cross_entropy")
    getattr(monkey_patch, f"apply_liger_kernel_to_{family}")(cross_entropy=False, **{k: opts[k] for k in kernels})


def _check_cell(cell: Cell, opts: Options) -> str | None:
    """An MLP kernel switched off that this family does not have: the asker meant the other one."""
    family = models.get(cell.model).family
    other = "swiglu" if mlp_kernel(family) == "geglu" else "geglu"
    if not opts[other]:
        return (f"{cell.model} ({family}) has a {mlp_kernel(family)} MLP, not {other}: its kernel is switched off "
                f"by liger({mlp_kernel(family)}=False)")
    return None


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    liger_modules = [type(m).__name__ for m in model.modules() if type(m).__module__.startswith("liger_kernel")]
    mlps = sum(name.endswith("GLUMLP") for name in liger_modules)  # LigerSwiGLUMLP, LigerGEGLUMLP, LigerPhi3SwiGLUMLP
    # the causal LM's class forward: a quantized base comes back already wrapped in peft's adapters
    fused_loss = type(causal_lm_of(model, "liger")).forward.__module__.startswith("liger_kernel")
    if opts["rms_norm"] and not liger_modules:
        raise RuntimeError("liger: no module of the built model is a Liger module")
    if opts["swiglu"] and opts["geglu"] and mlps == 0:  # one of them is the family's (the other is refused off)
        raise RuntimeError("liger: no MLP of the built model is Liger's")
    if opts["fused_linear_cross_entropy"] and not fused_loss:
        raise RuntimeError("liger: the model's forward is not Liger's fused linear cross-entropy forward")
    return model, {"liger_modules": len(liger_modules), "liger_mlps": mlps, "liger_fused_loss": fused_loss}


TECHNIQUE = Technique(
    name="liger",
    summary="Liger Triton kernels: fused linear cross-entropy (no logits tensor), RMSNorm, SwiGLU or GeGLU, RoPE",
    phase=Phase.PATCH,
    options={k: True for k in KERNELS},
    added_options=("geglu",),  # after the Llama cells were published: their ids stay
    requires_cuda=True,
    packages=("liger_kernel",),
    preload=("liger_kernel.transformers",),
    families=FAMILIES,
    before_build=_before_build,
    check_cell=_check_cell,
    apply=_apply,
)
