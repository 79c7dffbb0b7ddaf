"""Runs real checkpoint saves on the CPU and prints, for each, the storages every file write received.

`python tests/save_spy.py STACK:KIND ...` builds tiny-llama with each stack on the CPU (DeepSpeed on
one gloo rank), takes one training step, then saves (`model` or `full`) through the engine's own
save, with torch.save and safetensors' save_file wrapped to record the bytes of each distinct
storage they are handed. Prints {"STACK:KIND": [[bytes, ...] per file written], ...} as JSON.
tests/test_predict.py compares it with what bench/predict/save.py predicts for the same cell.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import peft.peft_model
import torch
import transformers.modeling_utils

from bench import spec, trainer
from bench.cells import make_cell
from bench.stacks import parse_stack

REPO = Path(__file__).resolve().parents[1]
WRITES: list[list[int]] = []


def _storages(obj: Any, found: dict[int, int]) -> dict[int, int]:
    """data pointer -> bytes of each distinct storage inside (nested dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    elif isinstance(obj, dict):
        for value in obj.values():
            _storages(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _storages(value, found)
    return found


def _spying(write: Any) -> Any:
    def wrapped(obj: Any, *args: Any, **kwargs: Any) -> Any:
        WRITES.append(sorted(_storages(obj, {}).values()))
        return write(obj, *args, **kwargs)
    return wrapped


def main(jobs: list[str]) -> None:
    torch.save = _spying(torch.save)  # DeepSpeed's checkpoint engine and the plain engine call torch.save
    for module in (transformers.modeling_utils, peft.peft_model):  # save_pretrained: safetensors
        module.safe_save_file = _spying(module.safe_save_file)  # type: ignore[attr-defined]
    matrix = spec.get(REPO / "matrix.yaml", "smoke")
    out = {}
    for job in jobs:
        stack, kind = job.split(":")
        cell = make_cell(matrix, "cpu", "tiny-llama", 64, 2, parse_stack(stack))
        run = trainer.build(cell)
        run.step(trainer.cell_batches(cell, run.setup, run.vocab_size, "cpu")[0])
        WRITES.clear()
        with tempfile.TemporaryDirectory() as tmp:
            run.engine.save(kind, Path(tmp))
        out[job] = list(WRITES)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
