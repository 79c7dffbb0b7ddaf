"""Deferred initialisation (bench/deferred.py): an FSDP2 or ZeRO-3 cell's model built on meta, its init
recorded and replayed into the shards or partitions, gives the weights of a plain build of the same
seed, bit for bit, and never holds the whole model; what cannot be replayed is refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench import deferred, spec, trainer
from bench.cells import make_cell
from bench.predict import fake, zero_states
from bench.predict.counter import Workspaces
from bench.stacks import parse_stack
from conftest import REPO

SMOKE = spec.get(REPO / "matrix.yaml", "smoke")


def _plain_twin(stack: str) -> str:
    """The stack without its engine: the plain build whose weights the deferred one must reproduce."""
    return stack.replace(" + fsdp", "").replace("fsdp", "baseline")


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
@pytest.mark.parametrize("stack", ["fsdp", "lora + fsdp", "gc + lora(adapter_dtype=bf16) + fsdp"])
def test_a_deferred_build_replays_to_the_weights_of_a_plain_build(model: str, stack: str) -> None:
    """The base's init drawn in its order from the seeded generator, LoRA's adapters drawn after it (fp32
    adapters rounded through the base's bf16 as peft rounds them): every parameter equal, bit for bit."""
    import torch

    cell = make_cell(SMOKE, "cpu", model, 64, 2, parse_stack(stack))
    built = trainer.build_model(cell)
    assert built.deferred is not None
    assert all(p.is_meta for n, p in built.model.named_parameters() if "lora_" not in n)  # nothing of the base made
    deferred.materialize(built.model, built.deferred, "cpu")
    plain = trainer.build_model(make_cell(SMOKE, "cpu", model, 64, 2, parse_stack(_plain_twin(stack)))).model
    got, want = dict(built.model.named_parameters()), dict(plain.named_parameters())
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_each_rank_gets_its_shard_of_the_plain_build() -> None:
    """Rank 0 of 4 (torch's fake process group: FSDP2 shards for real, collectives move nothing) holds
    exactly its torch.chunk of each parameter of the plain build."""
    import torch
    from torch.distributed.tensor import DTensor

    cell = dataclasses.replace(make_cell(SMOKE, "cpu", "tiny-llama", 64, 2, parse_stack("fsdp")), gpus=4)
    with fake._fake_process_group(cell):
        model = trainer.build(cell).engine.model
        local = {name: p.to_local().clone() for name, p in model.named_parameters()}
        assert all(isinstance(p, DTensor) for p in model.parameters())
    plain = trainer.build_model(make_cell(SMOKE, "cpu", "tiny-llama", 64, 2, parse_stack("baseline"))).model
    for name, tensor in plain.named_parameters():
        assert torch.equal(local[name], tensor.chunk(4)[0]), name


def test_an_fsdp_build_holds_its_shards_and_one_whole_parameter_at_most() -> None:
    """Counted on real CPU tensors, 4 ranks: the build's peak is this rank's shards plus the largest
    parameter made whole for its replay, never the whole model."""
    cell = dataclasses.replace(make_cell(SMOKE, "cpu", "tiny-llama", 64, 2, parse_stack("fsdp")), gpus=4)
    with fake._fake_process_group(cell):
        counter, built, _ = fake.counted_run(cell, Workspaces(), fake=False)
    model_bytes = built.weights_gib * 2**30
    largest = max(p.numel() * p.element_size() for p in built.model.parameters()) * 4  # a shard is a quarter
    shards = sum(p.to_local().untyped_storage().nbytes() for p in built.model.parameters())
    assert counter.phase_peaks["build"] <= shards + largest + 16 * 1024  # + buffers and 512 B blocks
    assert counter.phase_peaks["build"] < 0.6 * model_bytes


@pytest.mark.slow
@pytest.mark.parametrize(("model", "ranks", "tied"), [("tiny-llama", 1, False), ("tiny-qwen2", 8, False),
                                                      ("tiny-llama", 4, True)])
def test_a_zero3_build_partitions_a_plain_builds_weights_and_never_holds_the_whole_model(
        model: str, ranks: int, tied: bool) -> None:
    """ZeRO-3 on meta (tests/zero3_build.py): each rank's partitions are its slice of a plain build, bit
    for bit, a tied pair stays one parameter, and the engine never holds more than its partitions and
    one whole parameter (the one being initialised; 512 B blocks aside)."""
    pytest.importorskip("deepspeed")
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(REPO / "tests" / "zero3_build.py"), model, str(ranks),
                           *(["tied"] if tied else [])], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["differing"] == []
    assert found["distinct_params"][0] == found["distinct_params"][1]
    assert found["partition_bytes"] == pytest.approx(found["model_bytes"] / ranks, rel=0.01)
    assert found["partition_bytes"] <= found["peak_bytes"] <= \
        found["partition_bytes"] + found["largest_param_bytes"] + 8 * 1024
    if ranks > 1:
        assert found["peak_bytes"] < 0.75 * found["model_bytes"]
    # what the hybrid prediction (bench/predict/hybrid.py) says the build holds, its buffers aside
    cell = dataclasses.replace(make_cell(SMOKE, "cuda", model, 64, 2, parse_stack("zero3")), gpus=ranks)
    meta = trainer.build_model(cell, device="meta").model
    if tied:
        meta.lm_head.weight = meta.model.embed_tokens.weight
    buffers = sum(-(-b.numel() * b.element_size() // 512) * 512 for b in meta.buffers())
    assert zero_states.Build.of(meta, cell).allocated_bytes - buffers == pytest.approx(found["peak_bytes"], abs=1024)


def _record(build) -> deferred.Record:
    with deferred.recording(seed=0) as record:
        model = build()
        record.base_built()
    record.finish(model)
    return record


def test_what_cannot_be_replayed_is_refused_by_name() -> None:
    import torch

    class Scaled(torch.nn.Module):  # reads the old values
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(8, 8))
            torch.nn.init.normal_(self.weight)
            self.weight.data.mul_(2)
    with pytest.raises(NotImplementedError, match="mul_ writes into a parameter \\[8, 8\\] from its old values"):
        _record(Scaled)

    class Drawn(torch.nn.Module):  # draws at its making, outside an init call
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8))
    with pytest.raises(NotImplementedError, match="drew random numbers outside an init call"):
        _record(Drawn)

    class Large(torch.nn.Module):  # too large to keep the values it was made with, never initialised
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.ones(deferred.KEPT_VALUES_MAX_NUMEL + 1))
    with pytest.raises(NotImplementedError, match="parameter table \\[1048577\\] was made with values and never"):
        _record(Large)


def test_small_parameters_keep_the_values_they_were_made_with() -> None:
    """A norm's ones (made with values, not written by an init call) come back as made."""
    import torch

    class Norm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((16,), 3.0))
            self.proj = torch.nn.Linear(16, 16)

    with deferred.recording(seed=7) as record:
        model = Norm()
        record.base_built()
    record.finish(model)
    assert model.weight.is_meta and model.proj.weight.is_meta
    deferred.materialize(model, record, "cpu")
    torch.manual_seed(7)
    plain = Norm()
    assert torch.equal(model.weight, plain.weight)
    assert torch.equal(model.proj.weight, plain.proj.weight) and torch.equal(model.proj.bias, plain.proj.bias)
