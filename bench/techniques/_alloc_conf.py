"""PYTORCH_CUDA_ALLOC_CONF, the caching allocator's settings, as the allocator techniques set it
(expandable_segments, max_split_size, garbage_collection_threshold): in the worker's environment before
torch starts (a stack's settings joined with commas, as torch reads them: bench/stacks.py), and checked
in the worker once it has."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .base import Evidence, Options

VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"


def env(setting: str) -> dict[str, str]:
    return {VARIABLE: setting}


def check(technique: str, setting: str) -> Evidence:
    """The worker's PYTORCH_CUDA_ALLOC_CONF as evidence, once `setting` is seen among its settings."""
    seen = os.environ.get(VARIABLE, "")
    if setting not in seen.split(","):
        raise RuntimeError(f"{technique}: {VARIABLE} is {seen!r} in the worker")
    return {"alloc_conf": seen}


def hooks(technique: str, setting: Callable[[Options], str]) -> tuple[Callable[[Options], dict[str, str]],
                                                                     Callable[[Any, Options], tuple[Any, Evidence]]]:
    """A technique's env and apply hooks when all it does is one allocator setting: set before torch
    starts, found in the worker, the model untouched."""

    def env_hook(opts: Options) -> dict[str, str]:
        return env(setting(opts))

    def apply_hook(model: Any, opts: Options) -> tuple[Any, Evidence]:
        return model, check(technique, setting(opts))

    return env_hook, apply_hook
