"""What a technique is: a small declarative unit the trainer applies in phase order.

A technique never runs code when this package is imported; its hooks run in the process that
trains one cell (bench/trainer.py). Everything else (options, requirements, conflicts) is data the
planner checks before any cell runs. Each hook receives the typed `Cell` it acts on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..cells import Cell

Options = Mapping[str, Any]
Evidence = dict[str, Any]


class Phase(IntEnum):
    """When a technique acts; a stack is applied in this order."""

    ENV = 0  # process environment, set before torch is imported (allocator settings)
    LOAD = 1  # how the base model is built or loaded (precision, quantized bases)
    PATCH = 2  # changes inside the model (activation checkpointing, kernels)
    WRAP = 3  # wrappers around the model (LoRA adapters)
    OPTIMIZER = 4  # which optimizer and how it is implemented
    ENGINE = 5  # a training engine that owns the step (DeepSpeed, FSDP)
    DATA = 6  # how batches are laid out (variable-length documents, padded or packed)


@dataclass(frozen=True)
class TrainSetup:
    """How the trainer builds and trains one cell; techniques' `configure` return modified copies."""

    param_dtype: str = "bf16"  # dtype of the weights ("pure bf16" unless a technique changes it)
    autocast_dtype: str | None = None  # forward under torch.autocast in this dtype (mixed precision)
    attn_implementation: str = "sdpa"
    optimizer_impl: str = "fused"  # fused | foreach | forloop: pinned, since it moves the peak by GiBs
    lr: float = 1e-4
    engine: str = "plain"  # plain | deepspeed | fsdp: a module of bench/engines/ that owns backward, step, save
    cpu_offload: bool = False  # the engine keeps sharded state in host RAM (FSDP reads it; DeepSpeed gets a fragment)
    build_on_meta: bool = False  # the engine shards a meta-built model and replays its init (bench/deferred.py)
    micro_batches: int = 1  # forward/backward passes per optimizer step (gradient accumulation)
    data: str = "full"  # full | pad | dynpad | pack: batch layout (bench/data.py)
    min_doc_frac: float = 0.1  # pad / dynpad / pack: shortest document, as a fraction of seq_len
    doc_order: str = "shuffled"  # dynpad: documents in drawn order, or sorted by length (ascending)


@dataclass(frozen=True)
class Technique:
    name: str  # also its file's name: bench/techniques/<name>.py
    summary: str  # one line: what it saves and what it costs
    phase: Phase
    options: Mapping[str, Any] = field(default_factory=dict)  # name -> default (its type is the option's type)
    choices: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)  # allowed values per option
    ranges: Mapping[str, str] = field(default_factory=dict)  # numeric options' intervals, e.g. {"r": "[1, inf)"}
    # Options added after cells with this technique were published: at their default they are left out of
    # the cell id, so those cells keep their ids (as a budget, a checkpoint and ranks are: bench/cells.py)
    added_options: tuple[str, ...] = ()
    slot: str | None = None  # at most one technique per slot in a stack (one precision, one optimizer)
    requires_cuda: bool = False
    # Its forward pass runs torch.compile'd code (or may: an option chooses): the worker does not record the
    # attention kernels of such a cell, since dynamo does not compile under the recording's dispatch mode
    # (bench/kernels.py) and the first step would run eager
    compiles_forward: bool = False
    packages: tuple[str, ...] = ()  # import names that must be installed
    # Modules its build imports that take seconds (peft: 7 s on a 2-core CPU): a worker started ahead of its
    # cell imports them while it waits (bench/worker.py). Only modules whose import leaves the GPU alone:
    # each row says whether its worker held a CUDA context before its cell (context_before_cell).
    preload: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()  # techniques it cannot be stacked with
    needs_one_of: tuple[str, ...] = ()  # it only works on top of one of these
    families: tuple[str, ...] = ()  # model families it supports (empty: any); others are skipped with a reason
    test_only: bool = False  # fault injection: refused unless BENCH_TEST_TECHNIQUES=1
    # How `bench predict` treats it: None = the fake run of the training step covers it; else why
    # not yet (its cells are then predicted as "unsupported: <reason>", never guessed).
    not_predicted: str | None = None
    # Hooks, in the order the trainer calls them (all optional):
    env: Callable[[Options], dict[str, str]] | None = None  # env vars, set before torch is imported
    configure: Callable[[TrainSetup, Options], TrainSetup] | None = None  # how to build and train
    before_build: Callable[[Cell, Options], None] | None = None  # process-global patches (model classes)
    # Replaces the build: (cell, device, attention implementation, opts) -> model in train mode
    # (quantized bases); on "meta" (the predictor) the skeleton it would load, weights not quantized yet
    load: Callable[[Cell, str, str, Options], Any] | None = None
    apply: Callable[[Any, Options], tuple[Any, Evidence]] | None = None  # (model, opts) -> (model, evidence)
    make_optimizer: Callable[[list[Any], TrainSetup, Options], Any] | None = None  # (trainable params, setup, opts)
    ds_config: Callable[[Options], dict[str, Any]] | None = None  # DeepSpeed config fragment, deep-merged
    # During the step: a context around each micro-batch's forward and backward, entered anew each
    # time; it may add to the evidence, which is recorded after the last step.
    around_step: Callable[[Cell, Options, Evidence], AbstractContextManager[Any]] | None = None
    # A rule that needs the whole stack: (names in the stack, own options) -> why it cannot run, or None
    validate: Callable[[frozenset[str], Options], str | None] | None = None
    # A rule on the cell's shape: (cell, own options) -> why this cell cannot run, or None
    check_cell: Callable[[Cell, Options], str | None] | None = None
