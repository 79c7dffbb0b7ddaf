"""The trainer: one cell's model, stack and engine, built the same way for every caller.

The worker (on a GPU or CPU, inside its measurement), the pytest-benchmark view (benchmarks/) and
the bare reference loop's model all come from here, so what is measured is what is built. The
build follows the stack's phase order:

1. setup: each technique's `configure` turns the baseline TrainSetup (pure bf16, fused AdamW, sdpa)
   into the stack's;
2. before_build: process-global patches (Liger's kernels replace the family's module classes);
3. the base model: from its shipped config with random weights, directly on the device (or a
   technique's `load`: quantized bases come from a cached random checkpoint);
4. apply: each technique changes the model (gc, LoRA, ...) and returns evidence that it did;
5. the engine (bench/engines/): plain PyTorch, DeepSpeed or FSDP2 wraps the model and owns
   backward, the optimizer step and checkpoint saves.

For FSDP2 and ZeRO-3 (`setup.build_on_meta`), steps 3-4 keep the parameters on the meta device and
record how they were initialised (bench/deferred.py); the engine shards the meta model and replays
the record into each shard, as real FSDP recipes build and as a checkpoint loads under ZeRO-3: no GPU
ever holds the whole model, and the weights are a plain build's.

`build_model` (1-4) and `wrap` (5) are separate so the worker can read the weights' footprint in
between; `build` does both. `Trainer.step` is one optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from . import data, deferred, distributed, measure, models
from .cells import Cell
from .engines import Engine, EngineJob
from .engines import wrap as wrap_engine
from .techniques import Technique, TrainSetup
from .techniques.base import Evidence, Options

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
Uses = tuple[tuple[Technique, Options], ...]
BASELINE_SETUP = TrainSetup()  # pure bf16 weights, sdpa, fused AdamW: what an empty stack trains with (Stack.setup)


class Phases(Protocol):
    """Told where a step is (`stage/phase`) as each phase begins: the worker's PhaseTracker, the predictor's counter."""

    def enter(self, where: str) -> None: ...


@dataclass(frozen=True)
class Built:
    """The model as built and adapted, before an engine wraps it (and, with a deferred build, gives it memory)."""

    model: Any
    device: str  # where it was built: the cell's device, or "meta" for a prediction
    setup: TrainSetup
    uses: Uses
    evidence: Evidence  # what each technique reported when applied
    deferred: deferred.Record | None  # parameters left on meta, their init recorded (FSDP2, ZeRO-3: the engine replays it)
    total_params: int
    trainable_params: int
    weights_gib: float  # bytes of all parameters
    grads_gib: float  # bytes the gradients of the trainable parameters will take
    flops_per_token: float | None  # None for a quantized base (no plain-bf16 FLOP count, no MFU)
    vocab_size: int


@dataclass(frozen=True)
class Trainer:
    cell: Cell
    device: str  # where its tensors live and what autocast is for (the cell's, or the predictor's fake "cpu")
    setup: TrainSetup
    uses: Uses
    engine: Engine
    evidence: Evidence  # the techniques' and the engine's; `around_step` hooks add to it during steps
    vocab_size: int

    def batches(self) -> list[data.Batch]:
        """This rank's batches for every step of the cell (warm-up first), seeded by the cell."""
        return cell_batches(self.cell, self.setup, self.vocab_size, self.device)

    def step(self, batch: data.Batch, tracker: Phases | None = None, stage: str = "") -> Any:
        """One optimizer step on one batch, in `micro_batches` forward/backward passes whose gradients
        accumulate; returns the batch's mean loss, detached. `tracker` (if given) enters the phases
        `stage/forward`, `stage/backward`, `stage/optimizer` as they begin."""
        micro_batches = self.setup.micro_batches
        total = 0.0
        for chunk in batch.chunk(micro_batches):
            with self._around_step():
                _enter(tracker, f"{stage}/forward")
                with self._autocast():
                    loss = self.engine.model(**chunk.model_inputs()).loss / micro_batches
                _enter(tracker, f"{stage}/backward")
                self.engine.backward(loss)
            total += loss.detach()
        _enter(tracker, f"{stage}/optimizer")
        self.engine.step()
        return total

    @contextlib.contextmanager
    def _around_step(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for technique, opts in self.uses:
                if technique.around_step is not None:
                    stack.enter_context(technique.around_step(self.cell, opts, self.evidence))
            yield

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed precision's forward under torch.autocast; backward runs outside it, as torch advises."""
        import torch

        if self.setup.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=getattr(torch, DTYPES[self.setup.autocast_dtype]))


def build(cell: Cell) -> Trainer:
    """The cell's model with its stack applied, wrapped by its engine: ready to step."""
    return wrap(cell, build_model(cell))


def build_model(cell: Cell, device: str | None = None) -> Built:
    """Steps 1-4: the setup, patches, the base model (built or loaded), each technique's apply.
    On the cell's device unless `device` says otherwise (the predictor builds on "meta")."""
    device = device or cell.device
    uses = tuple((u.technique, u.opts) for u in cell.stack.uses)
    setup = cell.stack.setup
    for technique, opts in uses:
        if technique.before_build is not None:
            technique.before_build(cell, opts)
    recorded = deferred.recording(cell.seed) if setup.build_on_meta else None
    with recorded or contextlib.nullcontext() as record:
        model, flops = _base(cell, device, setup, uses)
        if record is not None:
            record.base_built()  # what the stack adds is made for real (bench/deferred.py)
        evidence: Evidence = {}
        # What techniques add (LoRA adapters) is made as a user's code makes it, on the CPU, then moved to
        # the model's device: also on meta, where peft would leave adapters made there in fp32 whatever
        # their asked dtype (it casts to the base layer's dtype only when it moves them).
        for technique, opts in uses:
            if technique.apply is not None:
                model, found = technique.apply(model, opts)
                evidence.update(found)
    if record is not None:
        record.finish(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return Built(model, device, setup, uses, evidence, record, total_params=sum(p.numel() for p in model.parameters()),
                 trainable_params=sum(p.numel() for p in trainable), weights_gib=measure.tensor_gib(model.parameters()),
                 grads_gib=measure.tensor_gib(trainable), flops_per_token=flops, vocab_size=model.config.vocab_size)


def _base(cell: Cell, device: str, setup: TrainSetup, uses: Uses) -> tuple[Any, float | None]:
    """Step 3: (the base model, its FLOPs per token): built from its config, or a technique's `load`
    (at most one: slot "base"; a quantized base has no FLOP count)."""
    loaders = [(t, opts) for t, opts in uses if t.load is not None]
    if loaders:
        loader, opts = loaders[0]
        return loader.load(cell, device, setup.attn_implementation, opts), None  # type: ignore[misc]
    model = base_model(cell.model, device, cell.seed, setup)
    return model, measure.flops_per_token(model, cell.seq_len)


def wrap(cell: Cell, built: Built) -> Trainer:
    """Step 5: the engine the stack selected (plain PyTorch if none) around the built model."""
    trainable = tuple(p for p in built.model.parameters() if p.requires_grad)
    engine, found = wrap_engine(EngineJob(cell, built.setup, built.uses, built.model, trainable, built.device,
                                          built.deferred))
    return Trainer(cell, built.device, built.setup, built.uses, engine, {**built.evidence, **found}, built.vocab_size)


def cell_batches(cell: Cell, setup: TrainSetup, vocab_size: int, device: str) -> list[data.Batch]:
    """This rank's batches for every step of the cell (warm-up first), seeded by the cell."""
    return data.batches(setup.data, vocab_size, cell.batch_size, cell.seq_len, cell.warmup_steps + cell.measure_steps,
                        cell.seed, device, setup.min_doc_frac, distributed.rank(), distributed.world_size(),
                        setup.doc_order)


def base_model(model_name: str, device: str, seed: int, setup: TrainSetup = BASELINE_SETUP) -> Any:
    """A registry model from its shipped config, random weights (seeded) initialised directly on
    `device` (no host copy), in the setup's weight dtype and attention, in train mode."""
    import torch
    from transformers import AutoModelForCausalLM

    config = models.hf_config(models.get(model_name), setup.attn_implementation)
    config.use_cache = False  # a training forward must not build a KV cache
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPES[setup.param_dtype]))
    return model.train()  # dropout and checkpointing act only in train mode


def _enter(tracker: Phases | None, phase: str) -> None:
    if tracker is not None:
        tracker.enter(phase)
