"""The technique catalogue: every module of this package that is not private (`_name.py`) or
`base.py` is one technique, found by its file and registered under its name. Adding a technique is
adding one file that defines `TECHNIQUE = Technique(name=<the file's name>, ...)`."""

from __future__ import annotations

import importlib
import pkgutil

from .base import Phase, Technique, TrainSetup


def _discover() -> dict[str, Technique]:
    found: dict[str, Technique] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module_info.name.startswith("_") or module_info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        technique = getattr(module, "TECHNIQUE", None)
        if not isinstance(technique, Technique):
            raise TypeError(f"bench/techniques/{module_info.name}.py defines no TECHNIQUE = Technique(...)")
        if technique.name != module_info.name:
            raise ValueError(f"bench/techniques/{module_info.name}.py declares technique {technique.name!r}: "
                             "a technique's file is named after it")
        found[technique.name] = technique
    return found


REGISTRY: dict[str, Technique] = _discover()

__all__ = ["REGISTRY", "Phase", "Technique", "TrainSetup"]
