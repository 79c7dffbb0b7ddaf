"""Unsloth, as a peer: the cell trained through Unsloth's own loader and patches, with its recipe.

`FastLanguageModel.from_pretrained` loads the suite's random checkpoint of the cell's model (the same
weights every other stack starts from), patched by Unsloth; `get_peft_model` adds LoRA adapters to
every linear layer of the decoder (q, k, v, o, gate, up, down), with its gradient checkpointing:
`gc=unsloth` (its default and its headline) checkpoints each decoder layer and moves the layer's
input to host RAM asynchronously, `gc=plain` is plain checkpointing, `gc=none` none. `load_in_4bit`
quantizes the base to NF4 while loading (its QLoRA: the recipe of its long-context table, rank 32).
Its kernels (Triton RoPE, RMSNorm, SwiGLU, and cut cross-entropy for the loss) come with it.

Saves: what those parts save together (no base gradients or optimizer state, a 4-bit base, layer
inputs on the host instead of the GPU, no logits tensor). Costs: PCIe traffic for the offloaded
checkpoints, recompute of each layer in backward, host RAM; the stack is Unsloth's, so the suite's
own techniques cannot be added to it. Same tokens and first weights as our stacks, so the losses
compare; the losses are not expected to match the baseline's (LoRA trains other parameters).

Needs the `unsloth` package. On a GPU, Unsloth's CUDA path; on a CPU, its fallback (16-bit LoRA,
no 4-bit base), which is what the CPU tests run. Its import must precede transformers', so the
worker imports it first (`env`). Predicted: no: it loads from files and runs its own kernels.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .base import Evidence, Options, Phase, Technique

if TYPE_CHECKING:
    from ..cells import Cell

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GRADIENT_CHECKPOINTING: dict[str, Any] = {"unsloth": "unsloth", "plain": True, "none": False}


def _load(cell: Cell, device: str, attn_implementation: str, opts: Options) -> Any:
    import torch
    from unsloth import FastLanguageModel

    from .. import models
    from ..checkpoints import for_load, with_tokenizer

    vocab_size = models.hf_config(models.get(cell.model), attn_implementation).vocab_size
    path = with_tokenizer(for_load(cell.model, cell.seed, device), vocab_size)
    model, _ = FastLanguageModel.from_pretrained(model_name=str(path), max_seq_length=cell.seq_len,
                                                 dtype=torch.bfloat16, load_in_4bit=opts["load_in_4bit"],
                                                 local_files_only=True)
    model = FastLanguageModel.get_peft_model(model, r=opts["r"], lora_alpha=opts["alpha"], lora_dropout=0.0,
                                             target_modules=list(TARGETS), bias="none", random_state=cell.seed,
                                             use_gradient_checkpointing=GRADIENT_CHECKPOINTING[opts["gc"]])
    model.config.use_cache = False
    return model.train()


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    from importlib import metadata

    adapted = sum(1 for name, _ in model.named_modules() if name.endswith(".lora_A"))
    if adapted == 0:
        raise RuntimeError("unsloth: the loaded model has no LoRA adapters")
    return model, {"unsloth_version": metadata.version("unsloth"), "lora_modules": adapted,
                   "unsloth_gc": opts["gc"], "unsloth_4bit": opts["load_in_4bit"],
                   "attn_implementation": getattr(model.config, "_attn_implementation", None),
                   "base_checkpoint": Path(getattr(model.config, "_name_or_path", "")).name}  # drawn on the CPU or GPU


def _check_cell(cell: Cell, opts: Options) -> str | None:
    if opts["load_in_4bit"] and cell.device != "cuda":
        return "a 4-bit base needs CUDA (Unsloth's CPU fallback trains 16-bit LoRA: load_in_4bit=false)"
    return None


TECHNIQUE = Technique(
    name="unsloth",
    summary="Unsloth's recipe, as a peer: its loader, kernels, LoRA and offloaded checkpointing (4-bit base)",
    phase=Phase.LOAD,
    slot="base",
    options={"r": 32, "alpha": 32, "gc": "unsloth", "load_in_4bit": True},
    choices={"gc": tuple(GRADIENT_CHECKPOINTING)},
    ranges={"r": "[1, inf)", "alpha": "(0, inf)"},
    packages=("unsloth",),
    # Unsloth brings its own adapters, checkpointing, kernels and loss: ours would stack on its patches
    conflicts=("lora", "dora", "mixed", "gc", "selective_gc", "liger", "cce", "chunked_ce", "compile",
               "activation_offload", "zero2", "zero3", "fsdp", "ddp"),
    compiles_forward=True,
    not_predicted="Unsloth loads from files and runs its own Triton kernels: not run on fake tensors",
    env=lambda opts: {"BENCH_WORKER_FIRST_IMPORTS": "unsloth"},
    check_cell=_check_cell,
    load=_load,
    apply=_apply,
)
