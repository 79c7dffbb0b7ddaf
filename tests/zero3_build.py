"""Builds a tiny model under ZeRO-3 on the CPU, as rank 0 of RANKS, and prints what the build held.

`python tests/zero3_build.py MODEL RANKS [tied]` builds MODEL with the stack `zero3` as the trainer and
the DeepSpeed engine build it (on meta, then partitioned and its init replayed: bench/engines/deepspeed.py),
the engine's part under a MemoryCounter over real tensors. One real gloo rank, or rank 0 of torch's fake
process group of RANKS (collectives move nothing; each rank replays the whole init itself, so rank 0's
partitions are complete). `tied`: the embeddings tied to the output layer, as Llama-3.2's are.
Prints JSON: that part's peak bytes; the model's, its partitions' and its largest parameter's bytes;
the parameters whose partition on rank 0 differs from that rank's slice of a plain build of the same
seed (none, if right); and how many distinct parameters each build has.
tests/test_deferred.py asserts on it; a process of its own, since DeepSpeed's communication state is global.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch

from bench import distributed, models, spec, trainer
from bench.cells import make_cell
from bench.engines import EngineJob
from bench.engines import deepspeed as deepspeed_engine
from bench.predict.counter import MemoryCounter
from bench.stacks import parse_stack

REPO = Path(__file__).resolve().parents[1]


def _differing(model: Any, plain: Any) -> list[str]:
    """Parameters whose partition on this rank is not this rank's slice of the flattened plain weights."""
    wrong = []
    for name, want in plain.named_parameters():
        part = model.get_parameter(name).ds_tensor  # DeepSpeed's partition: a flat slice, the last one padded
        start = part.ds_numel * distributed.rank()
        have = want.detach().flatten()[start:start + part.ds_numel]
        if part.dtype != want.dtype or not torch.equal(part.flatten()[:have.numel()], have):
            wrong.append(name)
    return wrong


def _tie_embeddings() -> None:
    """Every config built from now on ties the input embeddings to the output layer (one parameter)."""
    hf_config = models.hf_config

    def tied(spec: Any, attn_implementation: str) -> Any:
        config = hf_config(spec, attn_implementation)
        config.tie_word_embeddings = True
        return config

    models.hf_config = tied  # type: ignore[assignment]


def main(model_name: str, ranks: int) -> None:
    matrix = spec.get(REPO / "matrix.yaml", "smoke")
    os.environ.update(distributed.SINGLE_RANK_ENV, WORLD_SIZE=str(ranks))
    if ranks > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    cell = make_cell(matrix, "cpu", model_name, 64, 2, parse_stack("zero3"))
    distributed.init(cuda=False)
    deepspeed.init_distributed(dist_backend="gloo")
    built = trainer.build_model(cell)
    job = EngineJob(cell, built.setup, built.uses, built.model, (), built.device, built.deferred)
    with MemoryCounter() as counter:  # what the engine makes: the partitions, and what it makes whole for a while
        deepspeed_engine._partition_deferred(job, deepspeed_engine.config(built.uses, built.setup, 2))
    params = list(built.model.parameters())
    plain = trainer.build_model(make_cell(matrix, "cpu", model_name, 64, 2, parse_stack("baseline"))).model
    print(json.dumps({
        "peak_bytes": counter.peak.nbytes,
        "model_bytes": sum(p.ds_numel * p.element_size() for p in params),
        "largest_param_bytes": max(p.ds_numel * p.element_size() for p in params),
        "partition_bytes": sum(p.ds_tensor.numel() * p.element_size() for p in params),
        "differing": _differing(built.model, plain),
        "distinct_params": [len(params), len(list(plain.parameters()))],  # a tied pair is one parameter in both
    }))


if __name__ == "__main__":
    if sys.argv[3:] == ["tied"]:
        _tie_embeddings()
    main(sys.argv[1], int(sys.argv[2]))
