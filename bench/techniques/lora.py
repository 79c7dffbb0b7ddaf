"""LoRA adapters (peft): the base weights are frozen, small rank-r adapters are trained.

Saves: gradients and optimizer states of the base model (only the adapters' r x (in + out)
parameters per targeted layer have them), which for a full AdamW fine-tune is most of the memory.
Costs: adapter matmuls in forward and backward, and the activations they save; the frozen base
still runs its full forward and the input-gradient part of backward.

Visible choices (peft's defaults, stated rather than hidden): adapters in fp32
(`adapter_dtype`), `dropout` (> 0 adds saved activations), targets `all-linear`. `targets` is
`all-linear` or module names joined by `|` (`q_proj|v_proj`): a name adapts every module whose name is
it or ends in `.name`, as peft matches a list (peft would read a bare string as a regular expression
matched against the whole module path, so `q_proj` alone would match nothing).
On a mixture of experts, whose experts transformers 5 fuses into 3-D parameters per layer, peft 0.21's
`all-linear` adapts every expert as well: Qwen3-30B-A3B at r=16 trains 0.997 B parameters, 0.981 B of them
in the experts (counted on the meta device, transformers 5.24.0, peft 0.21.2), about 11 GiB of fp32
gradients and AdamW moments; `targets=q_proj|k_proj|v_proj|o_proj` adapts the attention alone. peft has no DoRA for
fused experts (`lora.ParamWrapper`): `dora` on such a model is refused when planned (`peft_problem`).
What `all-linear` takes moves with peft: 0.22.0 adds what 0.21.2 left out, Qwen2-MoE's router and fused experts
(transformers 5.25.0's default Qwen2MoeConfig, 14.3 B: 15.9 M trainable -> 320.5 M at r=16) and DeepSeek's dense
MLPs and shared experts (DeepSeek-V3's default config: 7,645 M -> 7,675 M), counted on the meta device.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from .base import Evidence, Options, Phase, Technique

ALL_LINEAR = "all-linear"
ATTENTION = "q_proj|k_proj|v_proj|o_proj"  # the attention's projections, named as most families name them
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def _apply(model: Any, opts: Options) -> tuple[Any, Evidence]:
    return adapt(model, opts)


def target_modules(targets: str) -> str | list[str]:
    """peft's `target_modules` for the `targets` option: its `all-linear`, or the list of names."""
    return targets if targets == ALL_LINEAR else targets.split("|")


def targets_problem(opts: Options) -> str | None:
    """Why the `targets` option cannot be read, or None (checked when the stack is parsed)."""
    if opts["targets"] == ALL_LINEAR:
        return None
    bad = [name for name in opts["targets"].split("|") if not _MODULE_NAME.match(name)]
    if bad:
        return (f"targets={opts['targets']!r}: {bad[0]!r} is not a module name; write {ALL_LINEAR} or names "
                "joined by | (q_proj|v_proj)")
    return None


def _validate(names: frozenset[str], opts: Options) -> str | None:
    return targets_problem(opts)


def peft_problem(model_name: str, opts: Options, use_dora: bool = False) -> str | None:
    """Why peft refuses these adapters on this model, or None: a target it finds no module for, or DoRA on a
    mixture of experts' fused 3-D expert weights (peft 0.21 adapts those as parameters, `lora.ParamWrapper`,
    which has no DoRA). Asked of peft itself, on the model built on the meta device (no weights: about a
    second for a 3B model), so the refusal comes when the stack is planned, not after a worker built the model."""
    return _peft_refusal(model_name, opts["targets"], use_dora)


@cache
def _peft_refusal(model_name: str, targets: str, use_dora: bool) -> str | None:
    import peft

    refusal = _refused(model_name, targets, use_dora)
    if refusal is None:
        return None
    adapters = "DoRA" if use_dora else "LoRA"
    hint = _other_targets(model_name, targets, use_dora, refusal)
    return f"peft {peft.__version__} refuses {adapters} with targets={targets}: {refusal}{hint}"


def _refused(model_name: str, targets: str, use_dora: bool) -> str | None:
    """peft's refusal (its ValueError's message) of these adapters on a meta build of the model, or None; None too
    for a model that does not build: the cell's build meets that again, and records it."""
    import warnings

    import peft

    model = _meta_build(model_name)
    if model is None:
        return None
    config = peft.LoraConfig(r=1, target_modules=target_modules(targets), task_type="CAUSAL_LM", use_dora=use_dora)
    try:
        with warnings.catch_warnings():  # what peft warns of here, the worker's build warns of again
            warnings.simplefilter("ignore")
            peft.get_peft_model(model, config)
    except ValueError as err:  # peft's refusals; anything else only a real build can judge
        return str(err).rstrip(".")
    return None


def _other_targets(model_name: str, targets: str, use_dora: bool, refusal: str) -> str:
    """Targets peft takes instead, tried on peft like the asked ones, as a hint to end the refusal with (or ""):
    the attention's projections where DoRA met fused experts; `all-linear` less the modules peft names as
    incompatible (a Mamba mixer's `out_proj`, say)."""
    candidates = []
    if "ParamWrapper" in refusal:
        candidates.append((ATTENTION, "adapts the attention alone"))
    named = re.search(r"Incompatible modules: \{([^}]*)\}", refusal)
    if named and targets == ALL_LINEAR:
        rest = _linear_names(model_name) - set(re.findall(r"'([^']+)'", named.group(1)))
        candidates.append(("|".join(sorted(rest)), "adapts every other linear layer"))
    for other, what in candidates:
        if other and _refused(model_name, other, use_dora) is None:
            return f"; targets={other} {what}"
    return ""


def _linear_names(model_name: str) -> set[str]:
    """The names `all-linear` adapts modules by: every linear layer's last name, the output layer's aside."""
    import torch

    model = _meta_build(model_name)
    if model is None:
        return set()
    output = model.get_output_embeddings()
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not output}


def _meta_build(model_name: str) -> Any:
    """The registry model built on the meta device (no weights: about a second for a 3B model), or None where
    it does not build."""
    import torch
    from transformers import AutoModelForCausalLM

    from .. import models

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(models.hf_config(models.get(model_name), "eager"))
    except Exception:
        return None


def adapt(model: Any, opts: Options, use_dora: bool = False) -> tuple[Any, Evidence]:
    """The model with peft adapters on its targets (DoRA's magnitude vectors too, with `use_dora`)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=opts["r"],
        lora_alpha=opts["alpha"],
        lora_dropout=opts["dropout"],
        target_modules=target_modules(opts["targets"]),
        task_type="CAUSAL_LM",
        use_dora=use_dora,
    )
    # autocast_adapter_dtype=True is peft's default: adapters in fp32 even on a bf16 base
    model = get_peft_model(model, config, autocast_adapter_dtype=opts["adapter_dtype"] == "fp32")
    adapted = sum(1 for name, _ in model.named_modules() if name.endswith("lora_A"))
    if adapted == 0:
        raise RuntimeError(f"lora: no layer matched targets={opts['targets']!r}")
    return model, {"lora_modules": adapted}


TECHNIQUE = Technique(
    name="lora",
    summary="frozen base + rank-r adapters: no base gradients or optimizer states; adapter compute",
    phase=Phase.WRAP,
    options={"r": 16, "alpha": 32, "dropout": 0.0, "targets": "all-linear", "adapter_dtype": "fp32"},
    choices={"adapter_dtype": ("fp32", "bf16")},
    ranges={"r": "[1, inf)", "alpha": "(0, inf)", "dropout": "[0, 1)"},
    packages=("peft",),
    preload=("peft",),
    apply=_apply,
    validate=_validate,
    check_cell=lambda cell, opts: peft_problem(cell.model, opts),
)
