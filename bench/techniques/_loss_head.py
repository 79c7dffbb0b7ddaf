"""The causal LM's forward with its loss computed another way: from the last hidden states and the
output layer, without the (tokens x vocabulary) logits a plain forward makes (chunked_ce, cce).

The replacement returns the loss only: no logits leave the model, which is what saves the memory.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

IGNORE = -100  # transformers' ignore_index: a label that is not predicted

# (last hidden states, lm_head module, labels) -> the mean next-token loss over the labels not ignored
LossFn = Callable[[Any, Any, Any], Any]


def replace_loss(model: Any, technique: str, loss: LossFn) -> str:
    """Replaces the forward of the innermost causal LM (found through LoRA wrappers) by one that
    computes `loss`; returns the causal LM's class name, for the evidence."""
    causal_lm = causal_lm_of(model, technique)
    causal_lm.forward = types.MethodType(_forward(loss), causal_lm)
    return type(causal_lm).__name__


def causal_lm_of(model: Any, technique: str) -> Any:
    """The causal LM inside `model` (itself, or under peft's wrappers): the module whose own
    submodules are `model` and `lm_head` (peft's wrappers only pass those attributes through)."""
    causal_lm = next((m for m in model.modules() if {"lm_head", "model"} <= set(m._modules)), None)
    if causal_lm is None:
        raise RuntimeError(f"{technique}: no causal LM with `model` and `lm_head` found")
    return causal_lm


def _forward(loss: LossFn) -> Any:
    def forward(self: Any, input_ids: Any = None, labels: Any = None, attention_mask: Any = None,
                position_ids: Any = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            **kwargs).last_hidden_state
        return CausalLMOutputWithPast(loss=loss(hidden, self.lm_head, labels))

    return forward
