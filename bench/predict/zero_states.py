"""ZeRO-2/3's model states, as the hybrid (bench/predict/hybrid.py) counts DeepSpeed 0.19.8's: per GPU
and host, phase by phase (`model_states`: `phased`, or with the optimizer offloaded `zero2_offload`,
`zero3_offload`), and what each rank's GPU holds while the trainer builds the model (`Build`,
`build_events`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..cells import Cell
from . import allocator, bnb, zero_layout
from .counter import rounded
from .pinned import block_bytes
from .zero_layout import Layout, per_rank

MODEL_STATE_ROLES = ("weight", "gradient", "optimizer_state")  # what DeepSpeed's accounting replaces


@dataclass(frozen=True)
class ModelStates:
    """One cell's model states, bytes: per GPU phase by phase (`phased`, or with the optimizer offloaded
    `zero2_offload`, `zero3_offload`), DeepSpeed's estimator's figure for its stage, and the host's."""

    gpu_bytes: int  # per GPU, DeepSpeed's estimator: the stage's states at their most (model_states_gib)
    host_bytes: int  # the host's, all ranks of the cell together, at its most (in the step)
    bucket_bytes: int  # the gradient reduction bucket, per GPU
    training_bytes: int  # per GPU, alive through forward and backward, besides the bucket and `partition_bytes`
    step_bytes: int  # per GPU, at the optimizer step's peak
    after_step_bytes: int  # per GPU, alive between steps
    stage: int  # 2: the bucket made for each backward; 3: held from initialize on
    bucket_elements: int = 0  # the bucket's size in 16-bit gradients (the stack's `bucket`)
    partition_bytes: int = 0  # ZeRO-2's 16-bit gradient partition, from a backward's first reduction to its step
    to_host: bool = False  # the optimizer offloaded: a reduction sends each gradient to the host (`ZeroBackward`)
    host_training_bytes: int = 0  # the host's through forward and backward, all ranks together
    gathered_bytes: int = 0  # ZeRO-3's weights gathered whole through forward, 16-bit (not in training_bytes)
    persistent_bytes: int = 0  # ZeRO-3's persistent weights, gathered whole (in training_bytes and after_step_bytes)
    gathers: bool = False  # ZeRO-3 gathering its weights whole on the GPU (several ranks, or from the host)
    max_live_elements: int = 0  # ZeRO-3's `stage3_max_live_parameters`, where it gathers: what its prefetch tops up to
    weights_on_host: bool = False  # ZeRO-3's 16-bit partition offloaded (`offload(params=true)`)
    ranks: int = 1
    cpu_check: bool = False  # tools/hybrid_check.py: host and device one (copies between them no-ops), gloo's collectives

    @property
    def bucket_in_step(self) -> bool:
        return self.stage == 3


@dataclass(frozen=True)
class Build:
    """What each rank's GPU holds while the trainer builds the model, before training, bytes. ZeRO-2
    builds it whole, then flattens it into one buffer beside it (`_whole_then_flat`): twice its 16-bit
    weights for a moment. ZeRO-3 builds it on meta, then gives each parameter its memory
    whole and partitions it at once, then gathers each whole again for its init (bench/engines/
    deepspeed.py): its partitions (on the host if offloaded) plus one whole parameter at a time (offloaded,
    with its partition's copy while it is gathered: `_partitioned`)."""

    allocated_bytes: int
    reserved_bytes: int  # the same allocations through the allocator's model

    @classmethod
    def of(cls, model: Any, cell: Cell) -> Build:
        events = build_events(model, cell)
        made = allocator.replay(events)
        return cls(_peak_live(events), made.peak_reserved_bytes)


def build_events(model: Any, cell: Cell, cpu_check: bool = False) -> list[tuple[str, int, int]]:
    """The build's allocations on one rank's GPU (`Build`), in order: buffers (ids below 0); ZeRO-2's
    parameters whole (ids 0 to P-1) and its flat buffer (`_whole_then_flat`); ZeRO-3's as `_partitioned`
    makes them (each partition's id P + i for the i-th parameter in reverse order). `cpu_check`: as on a
    CPU, where emptying the cache does nothing."""
    buffers = [("malloc", -i - 1, rounded(b.numel() * b.element_size())) for i, b in enumerate(model.buffers())]
    params = list(model.parameters())
    if "zero3" not in cell.stack.names:
        loaded = any(use.technique.load is not None for use in cell.stack.uses)  # no tied transient: see fake.py
        return buffers + _whole_then_flat(model, params, cpu_check, loaded)
    return buffers + _partitioned(params, cell.gpus, _uses(cell).get("offload", {}).get("params", False))


def _whole_then_flat(model: Any, params: list[Any], cpu_check: bool, loaded: bool = False) -> list[tuple[str, int, int]]:
    """ZeRO-2's build on each GPU: each parameter whole (a 4-bit weight as a load quantizes it: its packed
    bytes and statistics as one block here), and, built from the config (not `loaded` from a checkpoint),
    a tied output embedding made whole, then tied away (freed: transformers makes the layer, then ties its
    weight to the input embedding's); then deepspeed.initialize casts every parameter to bf16 (a LoRA's
    fp32 adapters: each copied, the original freed; a 4-bit weight is not a float: kept), empties the
    cache (stage_1_and_2.py; nothing on a CPU) and, since the GPU has room, flattens the trained 16-bit
    weights into one buffer beside them, and those become its views."""
    events = [("malloc", i, bnb.loaded_sizes(p)[1] if bnb.is_4bit(p) else rounded(p.numel() * p.element_size()))
              for i, p in enumerate(params)]
    tied = 0 if loaded else tied_output_bytes(model)
    events += [("malloc", len(params), tied), ("free", len(params), 0)] if tied else []
    current = list(range(len(params)))  # each parameter's id, a cast's copy past the others'
    for i, param in enumerate(params):
        if param.element_size() != 2 and not bnb.is_4bit(param):
            current[i] = len(params) + 2 + i
            events += [("malloc", current[i], rounded(2 * param.numel())), ("free", i, 0)]
    events += [] if cpu_check else [("release", 0, 0)]
    trained = [i for i, p in enumerate(params) if p.requires_grad]
    events.append(("malloc", len(params) + 1, rounded(sum(2 * params[i].numel() for i in trained))))
    return events + [("free", current[i], 0) for i in trained]


def tied_output_bytes(model: Any) -> int:
    """The output embedding's bytes where it is tied to the input embedding, else 0."""
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or inputs is None or output.weight is not inputs.weight:
        return 0
    return rounded(output.weight.numel() * output.weight.element_size())


def _partitioned(params: list[Any], ranks: int, offloaded: bool) -> list[tuple[str, int, int]]:
    """ZeRO-3's build on one rank's GPU: each parameter whole, its partition (unless offloaded), the whole
    freed; then each gathered whole for its init and freed; then the cache emptied. A partition's id:
    `partition_id`. DeepSpeed's gather (0.19.8, `_allgather_params_sequential`) fills a buffer of the padded
    whole from `ds_tensor.to(device)`: an offloaded partition is copied onto the GPU for the gather, beside
    the buffer (on one rank: the parameter twice, as the H200 measured); a partition on the GPU is not."""
    count = len(params)
    events: list[tuple[str, int, int]] = []
    for i, param in enumerate(reversed(params)):  # converted children first, as the engine walks the modules
        events.append(("malloc", i, rounded(2 * param.numel())))  # in bf16, fp32 adapters too (bench/engines/deepspeed.py)
        if not offloaded:
            events.append(("malloc", partition_id(count - 1 - i, count), rounded(2 * per_rank(param.numel(), ranks))))
        events.append(("free", i, 0))
    for i, param in enumerate(params):
        share = per_rank(param.numel(), ranks)
        events.append(("malloc", i, rounded(2 * share * ranks)))
        if offloaded:  # the partition's copy, freed when the gather returns
            events += [("malloc", 2 * count + i, rounded(2 * share)), ("free", 2 * count + i, 0)]
        events.append(("free", i, 0))
    return [*events, ("release", 0, 0)]


def partition_id(position: int, count: int) -> int:
    """The id, in `_partitioned`'s events, of the partition of the parameter at `position` of `count`
    (past the ids of the whole parameters, in the order they are made: the last parameter's first)."""
    return 2 * count - 1 - position


def _peak_live(events: list[tuple[str, int, int]]) -> int:
    """The most bytes allocated at once along the events."""
    live: dict[int, int] = {}
    now = peak = 0
    for kind, ident, nbytes in events:
        if kind == "malloc":
            live[ident] = nbytes
            now += nbytes
            peak = max(peak, now)
        elif kind == "free":
            now -= live.pop(ident)
    return peak


def _uses(cell: Cell) -> dict[str, Any]:
    return {u.name: u.opts for u in cell.stack.uses}


def model_states(cell: Cell, layout: Layout, largest_layer_params: int, cpu_check: bool = False) -> ModelStates:
    """The cell's model states from its parameters' sizes and which train (`layout`). `cpu_check`: as
    DeepSpeed makes them on a CPU, whose host is its device (tools/hybrid_check.py). DeepSpeed's
    estimator (`gpu_bytes`) counts every parameter as trained."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    uses, total_params, ranks = _uses(cell), layout.total, cell.gpus
    offload = uses.get("offload", {})
    optimizer_offload, params_offload = bool(offload.get("optimizer")), bool(offload.get("params"))
    stage = 3 if "zero3" in uses else 2
    engine = uses[f"zero{stage}"]
    if stage == 3:
        _, gpu, _ = estimate_zero3_model_states_mem_needs(
            total_params, largest_layer_params, num_gpus_per_node=ranks, cpu_offload=optimizer_offload,
            cpu_offload_params=params_offload)
    else:
        _, gpu = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node=ranks, cpu_offload=optimizer_offload)
    # The stack's bucket (DeepSpeed's default unless set), allocated whole in 16 bits whatever the model's
    # size (ZeRO-3 at initialize, ZeRO-2 at each backward's first gradient; tests/zero_bucket.py sees it)
    elements = int(engine["bucket"])
    # ZeRO-3 gathers the weights whole for forward and backward on several ranks, or from the host (on a
    # CPU, one rank's "gathering" from the host is no copy)
    gathers = stage == 3 and (ranks > 1 or (params_offload and not cpu_check))
    base = ModelStates(gpu_bytes=int(gpu), host_bytes=0, bucket_bytes=2 * elements, training_bytes=0, step_bytes=0,
                       after_step_bytes=0, stage=stage, bucket_elements=elements, ranks=ranks, cpu_check=cpu_check,
                       gathered_bytes=2 * layout.held_for_backward if gathers else 0, gathers=gathers,
                       max_live_elements=zero_layout.max_live_parameters() if gathers else 0,
                       weights_on_host=stage == 3 and params_offload)
    return _with_persistent(_phased_states(cell, layout, base, optimizer_offload, params_offload),
                            layout.persistent_bytes if gathers else 0)


def _with_persistent(states: ModelStates, persistent_bytes: int) -> ModelStates:
    """ZeRO-3's persistent weights (`persistent_positions`) held through forward and backward and between
    steps, not in the optimizer step (released for it)."""
    return replace(states, persistent_bytes=persistent_bytes, training_bytes=states.training_bytes + persistent_bytes,
                   after_step_bytes=states.after_step_bytes + persistent_bytes)


def _phased_states(cell: Cell, layout: Layout, base: ModelStates, optimizer_offload: bool,
                   params_offload: bool) -> ModelStates:
    """`base` with its bytes phase by phase: the optimizer offloaded, the parameters alone, or neither."""
    stage, ranks, total_params, cpu_check = base.stage, base.ranks, layout.total, base.cpu_check
    engine = _uses(cell)[f"zero{stage}"]
    pin = (lambda nbytes: nbytes) if cpu_check else block_bytes  # a CPU does not pin
    cached = 0 if cpu_check or not params_offload else cached_partitions(layout)
    if optimizer_offload:  # the tensors DeepSpeed makes on the GPU and the host, checked on a CPU
        if stage == 2:
            trained = layout.trained_numels
            device, host, host_training = zero2_offload(layout.weight_bytes, sum(trained), max(trained), ranks,
                                                        engine["adam"], pin)
        else:
            device, host, host_training = zero3_offload(layout, engine["adam"], params_offload, pin)
        return replace(base, host_bytes=ranks * (host + cached), training_bytes=device, step_bytes=device,
                       after_step_bytes=device, to_host=True, host_training_bytes=ranks * (host_training + cached))
    if params_offload:  # ZeRO-3 with its parameters alone on the host: their 16-bit partition, pinned
        weights = 2 * per_rank(total_params, ranks)
        training, step, after = (nbytes - weights for nbytes in phased(cell, layout))
        host = pin(2 * per_rank(sum(layout.trained_numels), ranks)) + _frozen_on_host(layout, pin) + cached
        return replace(base, host_bytes=ranks * host, training_bytes=training, step_bytes=step,
                       after_step_bytes=after, host_training_bytes=ranks * host)
    training, step, after = phased(cell, layout)
    partition = 0 if stage == 3 else 2 * per_rank(sum(layout.trained_numels), ranks)
    return replace(base, training_bytes=training, step_bytes=step, after_step_bytes=after, partition_bytes=partition)


def zero2_offload(weight_bytes: int, trained: int, largest_trained: int, ranks: int, adam: str,
                  pin: Callable[[int], int] = block_bytes) -> tuple[int, int, int]:
    """(GPU, host in the step, host through forward and backward) bytes per rank of ZeRO-2's model
    states with the optimizer on the host, as DeepSpeed 0.19.8 makes them (stage_1_and_2.py; checked on
    a CPU, `tools/hybrid_check.py`). The GPU keeps the weights whole (`weight_bytes`: 16-bit, frozen
    ones too, or a frozen 4-bit base as loaded: `Layout.weight_bytes`) and a 16-bit buffer the size of
    the largest trained parameter, through which each gradient goes to the host. Each rank's host keeps,
    for its partition of the `trained` parameters, pinned (the suite's `pin_memory: true`; `pin`, each
    a block of the next power of two, bench/predict/pinned.py): fp32 master weights and their fp32
    gradients (4 B each), a 16-bit copy of the weights (2) and a 16-bit buffer of the largest gradient;
    and pageable, AdamW's two moments (8) and, in torch's AdamW step (`adam=torch`), one fp32 temporary
    (4; DeepSpeed's CPUAdam steps in place)."""
    part = per_rank(trained, ranks)
    training = pin(4 * part) + pin(4 * part) + pin(2 * part) + pin(2 * largest_trained) + 8 * part
    return weight_bytes + 2 * largest_trained, training + (4 * part if adam == "torch" else 0), training


def zero3_offload(layout: Layout, adam: str, params_offloaded: bool,
                  pin: Callable[[int], int] = block_bytes) -> tuple[int, int, int]:
    """(GPU, host in the step, host through forward and backward) bytes per rank of ZeRO-3's model
    states with the optimizer on the host, as DeepSpeed 0.19.8 makes them (stage3.py; checked on a CPU,
    `tools/hybrid_check.py`). Each parameter is partitioned alone: a rank holds ceil(n/N) of each.
    The GPU keeps the 16-bit partition (2 B/param), unless the parameters are offloaded too (and the
    weights it gathers: `ModelStates.gathered_bytes`). The host keeps, pinned (`pin`, as `zero2_offload`): the
    16-bit partition if offloaded (one block), the 16-bit gradient partition (one block), and the fp32
    gradients, one block per optimizer sub-group (`sub_groups`); pageable, the fp32 master weights (4)
    and AdamW's moments (8). DeepSpeed steps one sub-group at a time: torch AdamW's fp32 temporary
    (`adam=torch`) is the largest sub-group's (4 B each). All of it for the trained parameters
    (`Layout`): a frozen one is its 16-bit partition alone, on the GPU, or offloaded, on the host
    pinned in a block of its own (`_frozen_on_host`)."""
    ranks = layout.ranks
    parts = [per_rank(n, ranks) for n in layout.trained_numels]
    part, groups = sum(parts), sub_groups(parts)
    frozen = sum(per_rank(n, ranks) for n in layout.frozen_numels)
    device = 0 if params_offloaded else 2 * (part + frozen)
    weights = pin(2 * part) + _frozen_on_host(layout, pin) if params_offloaded else 0
    training = weights + pin(2 * part) + sum(pin(4 * g) for g in groups) + 12 * part
    return device, training + (4 * max(groups) if adam == "torch" else 0), training


def cached_partitions(layout: Layout) -> int:
    """Host bytes per rank that ZeRO-3 with its parameters offloaded leaves in torch's pinned-memory cache:
    partitioning pins each parameter's 16-bit partition alone (partition_parameters.py, a block of the next
    power of two, bench/predict/pinned.py); the engine then copies the trained ones into its flat pinned
    buffer and drops them, and torch's caching host allocator keeps their blocks, resident, for pinned
    requests of their size that never come. On the H200 (Llama-3.2-3B, `offload(params=True) + zero3`):
    8.44 GiB, where the prediction without them fell 7.98 GiB short of the measured host RSS peak (78.17
    GiB); with them it is 0.46 GiB over (+0.6%; `offload + zero2`, which pins no partitions: -0.6%)."""
    return sum(block_bytes(2 * per_rank(n, layout.ranks)) for n in layout.trained_numels)


def _frozen_on_host(layout: Layout, pin: Callable[[int], int]) -> int:
    """ZeRO-3's frozen parameters offloaded: each one's 16-bit partition pinned alone (DeepSpeed moves the
    trained ones' into one flat buffer, and leaves these where partitioning put them)."""
    return sum(pin(2 * per_rank(n, layout.ranks)) for n in layout.frozen_numels)


def sub_group_size() -> int:
    """DeepSpeed's `sub_group_size` (1e9 elements by default; the suite does not set it): ZeRO-3's
    optimizer steps one sub-group of a rank's partitions at a time."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return int(DeepSpeedZeroConfig().sub_group_size)


def sub_groups(parts: list[int]) -> list[int]:
    """The elements of each of ZeRO-3's optimizer sub-groups: the partitions, in order, closed when one
    reaches `sub_group_size`."""
    size, groups, now = sub_group_size(), list[int](), 0
    for n in parts:
        now += n
        if now >= size:
            groups, now = [*groups, now], 0
    return [*groups, now] if now else groups


def phased(cell: Cell, layout: Layout) -> tuple[int, int, int]:
    """(training, step, after step) bytes per GPU of a ZeRO stage without offload, bf16 with fp32 master
    weights and AdamW, as DeepSpeed's engine allocates them (checked on a CPU: bench/predict/hybrid.py's
    text). Per rank of N, a partition of P/N parameters holds fp32 master weights and both moments (12 B
    each); the step adds fp32 gradients and AdamW's temporary (8 B each). ZeRO-2 keeps the 16-bit weights whole (2 B/param;
    a 4-bit base as loaded, `Layout.weight_bytes`) and, from a backward's first reduction to the step,
    the 16-bit gradient partition (2 B each: `ModelStates.partition_bytes`, not in training's figure);
    its step takes the whole partition at once.
    ZeRO-3 keeps both 16-bit partitions throughout (4 B each; and, on several ranks, the weights it
    gathers: `ModelStates.gathered_bytes`); its step takes one optimizer sub-group at a time
    (`sub_groups`), so the fp32 gradients and the temporary are the largest sub-group's. Only the
    trained parameters (`Layout`) have the fp32 and gradient states; a frozen one is its 16-bit weight
    (ZeRO-2: whole, ZeRO-3: its partition)."""
    params, ranks, trained = layout.total, cell.gpus, layout.trained_numels
    partition = per_rank(sum(trained), ranks)
    if "zero3" in cell.stack.names:
        after = 2 * per_rank(params, ranks) + 14 * partition
        return after, after + 8 * max(sub_groups([per_rank(n, ranks) for n in trained]), default=0), after
    after = layout.weight_bytes + 12 * partition
    return after, after + 8 * partition, after

