"""A ZeRO cell's allocations as one trace, for the caching allocator's model: the hybrid's peak reserved.

bench/predict/hybrid.py counts what DeepSpeed's engine holds, moment by moment: peak allocated. What
the allocator reserves depends on the order of allocations too, and ZeRO's order leaves gaps a constant
slack does not know: on this CPU, DeepSpeed's real trace replayed through the allocator's model reserved
12% to 27% more than the hybrid's allocated plus its fake run's caching (tools/hybrid_check.py prints
both). One cause, seen in that trace: ZeRO-2 frees its 1 GB bucket at backward's end, the first step
then allocates Adam's moments inside the freed block, and the next backward's bucket needs a new
segment.

So the trace is rebuilt: the fake run's own allocations (activations, temporaries, the batch,
workspaces; not its model states, not its optimizer step), merged with the engine's, where and in the
order DeepSpeed 0.19.8 makes them (read in stage_1_and_2.py and stage3.py, and seen in its trace on a
CPU):

- the build (`zero_states.build_events`): ZeRO-2's whole weights, flattened into one buffer beside them (the
  cache emptied first on a GPU); ZeRO-3's partitions made one parameter at a time;
- at initialize: ZeRO-2's fp32 partition (4 B each, through a 16-bit clone, made on the GPU even where
  the partition goes to the host); ZeRO-3's partitions moved into one flat buffer (`_defragment`), its
  fp32 partition per optimizer sub-group (each through an fp32 copy, freed as the next is made), its
  bucket and its 16-bit gradient partition, then each trained weight gathered whole and freed as its
  gradient hook is registered; both, the transient fp32 gradient that initializes the optimizer's
  states. With the optimizer offloaded, only what stays on the GPU (`zero_states.zero2_offload`,
  `zero_states.zero3_offload`). What initialize frees stays cached: forward carves its first
  activations out of it;
- in each step's forward, on several ranks, ZeRO-3's gathered weights (on its all-gather stream): those it keeps
  into backward (`zero_layout.Layout`) each freed at its gradient's hook, the others after their module (in
  the first step, which has no trace of the modules' order, all of them); in backward, after the first
  step, backward's next weights prefetched as each module is done (`zero_backward.ZeroBackward.pass_module`),
  and a weight not gathered gathered again at its gradient's hook; its persistent weights kept, but for
  the optimizer step;
- in backward, at each gradient hook (`zero_backward.ZeroBackward`, the same bookkeeping): ZeRO-2's bucket at
  the first; the gradient, freed once copied into the bucket (held to the next reduction if larger);
  a reduction's temporaries, each a block (`zero_backward.Reduction`; ZeRO-3's on its reduce stream); ZeRO-2's
  16-bit gradient partition at the first reduction; ZeRO-2's bucket freed after the last;
- in the optimizer step, with the optimizer on the GPU: two passes of fp64 copies of each gradient
  (DeepSpeed's norms), then per sub-group (ZeRO-2: the partition) the gradients flattened (2 B each),
  cast to fp32 (4), the flat freed (ZeRO-2: its gradient partition too), Adam's moments at the first
  step (8), AdamW's temporary (4), and the fp32 gradients freed.

On a CPU check (`cpu_check`) every stream is the default one, as a CPU has; on a GPU, ZeRO-3's reduce
and all-gather streams keep pools of their own, as the allocator keeps one per stream. Not modelled: a
gradient freed after `record_stream` on the reduce stream is reusable only once that stream's work is
done; the replay reuses it at once.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from . import allocator
from .counter import GradientReady, MemoryCounter, Record
from .zero_backward import Reduction, ZeroBackward
from .zero_layout import Layout, per_rank
from .zero_states import MODEL_STATE_ROLES, ModelStates, partition_id, sub_groups

REDUCE_STREAM, ALLGATHER_STREAM = 101, 102  # past any stream the fake run numbers (counter.Record.stream)
Event = tuple[str, int, int, int]  # (malloc | free | release, id, bytes, stream), as allocator.replay takes them


@dataclass
class _Trace:
    """Events keyed by where they fall among the fake run's: (its event index, an order within it, a
    sequence number). The order, as allocator.trace sorts the fake run's: -1 the cache emptied, -0.5 the
    engine's (a hook runs before the event it precedes), 0 a free, 1 an allocation."""

    next_id: int
    keyed: list[tuple[tuple[float, float, int], Event]] = field(default_factory=list)
    at: tuple[float, float] = (-1.0, 0.0)
    sizes: dict[int, tuple[int, int]] = field(default_factory=dict)  # id -> (bytes, stream), until freed

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        ident, self.next_id = self.next_id, self.next_id + 1
        self._add(("malloc", ident, nbytes, stream))
        self.sizes[ident] = (nbytes, stream)
        return ident

    def free(self, ident: int) -> None:
        self._add(("free", ident, *self.sizes.pop(ident)))

    def release(self) -> None:
        """The cache emptied (torch.cuda.empty_cache)."""
        self._add(("release", -1, 0, 0))

    def transient(self, nbytes: int, stream: int = 0) -> None:
        self.free(self.malloc(nbytes, stream))

    def _add(self, event: Event) -> None:
        self.keyed.append(((*self.at, len(self.keyed)), event))


def engine_trace(counter: MemoryCounter, states: ModelStates, layout: Layout,
                 build: list[tuple[str, int, int]]) -> tuple[list[Event], list[int]]:
    """The fake run's allocations besides its model states and optimizer step, merged with the ZeRO
    engine's on one rank (the most loaded: rank 0), in order, for allocator.replay; and for each of the
    fake run's steps, how many of the events precede its end (its optimizer step included)."""
    trace = _Trace(next_id=len(counter.records))
    _fake_run_events(counter, trace)
    engine = _Engine(states, layout, trace)
    engine.initialize(build)
    forward_starts = _forward_starts(counter)
    hooks = sorted(counter.gradients_ready, key=lambda g: g.event)
    markers = []  # where each step ends: after its optimizer step, before anything the next one makes
    previous_end = -1
    for number, step in enumerate(counter.steps):
        forward_start = forward_starts[number]
        if (states.gathered_bytes or states.persistent_bytes) and forward_start is not None:
            trace.at = (forward_start, -0.5)
            engine.gather(held=number > 0)
        engine.first_step = number == 0
        for gradient in hooks:
            if previous_end < gradient.event <= step.event:
                trace.at = (gradient.event, -0.5)
                engine.hook(gradient)
        trace.at = (step.event, -0.5)
        engine.backward_end()
        engine.optimizer_step(first=number == 0)
        markers.append((step.event, -0.5, len(trace.keyed)))
        previous_end = step.event
    ordered = sorted(trace.keyed, key=lambda item: item[0])
    keys = [key for key, _ in ordered]
    ends = [bisect.bisect_left(keys, marker) for marker in markers]
    return [event for _, event in ordered], ends


def live_at(events: list[Event], positions: list[int]) -> list[int]:
    """The bytes allocated after the first N events, for each N of `positions` in ascending order."""
    live, out, wanted = 0, [], sorted(positions)
    for index, (kind, _, nbytes, _) in enumerate(events):
        while wanted and wanted[0] == index:
            out.append(live)
            wanted.pop(0)
        live += nbytes if kind == "malloc" else -nbytes if kind == "free" else 0
    return out + [live] * len(wanted)


def _fake_run_events(counter: MemoryCounter, trace: _Trace) -> None:
    """The fake run's records that DeepSpeed's step keeps as they are (`_kept`), as the allocator sees
    them (allocator.record_events: a gradient summed in place keeps its operand's block)."""
    for (at, order), event in allocator.record_events(counter.records, _kept):
        trace.keyed.append(((at, order, len(trace.keyed)), event))
    for at in counter.releases:
        trace.keyed.append(((at, -1, len(trace.keyed)), ("release", -1, 0, 0)))


def _kept(record: Record) -> bool:
    """Not a model state, not made in the plain optimizer's step (DeepSpeed's own step replaces it), and
    not the plain build's temporaries (a tied output embedding: zero_states.build_events is the engine's build)."""
    role = record.role or "temporary"
    return role not in MODEL_STATE_ROLES and not record.where.endswith("/optimizer") \
        and not (record.where == "build" and role == "temporary")


def _forward_starts(counter: MemoryCounter) -> list[int | None]:
    """Each step's first event in forward (its first allocation there), None where it allocated nothing
    there. Steps of one stage (dynamic padding runs every step as "measure") are told apart by their ends."""
    ends = [step.event for step in counter.steps]
    starts: list[int | None] = [None] * len(ends)
    for record in sorted((r for r in counter.records if r.made >= 0 and r.where.endswith("/forward")),
                         key=lambda r: r.made):
        number = bisect.bisect_right(ends, record.made)  # the step it was made in: the first to end after it
        if number < len(starts) and starts[number] is None:
            starts[number] = record.made
    return starts


@dataclass
class _Engine:
    """DeepSpeed's allocations on one rank's GPU, emitted into `trace` as the engine makes them."""

    states: ModelStates
    layout: Layout
    trace: _Trace
    bucket: int | None = None  # the bucket's id while it lives (ZeRO-2: one backward)
    partition: int | None = None  # ZeRO-2's 16-bit gradient partition's, from the first reduction to the step
    gathered: dict[int, int] = field(default_factory=dict)  # parameter position -> its gathered weight's id
    persistent: list[int] = field(default_factory=list)  # ZeRO-3's persistent weights' ids while gathered
    held: list[int] = field(default_factory=list)  # gradients larger than the bucket, to the next reduction
    backward: ZeroBackward | None = None  # the hooks' bookkeeping, shared with the hybrid's count
    first_step: bool = True  # the first step's backward: nothing held from forward, no prefetch

    @property
    def stage3(self) -> bool:
        return self.states.stage == 3

    def stream(self, gpu_stream: int) -> int:
        return 0 if self.states.cpu_check else gpu_stream

    @property
    def part(self) -> int:
        """The rank's partition of the trained parameters: its fp32 master weights and gradients."""
        return per_rank(sum(self.layout.trained_numels), self.states.ranks)

    def groups(self) -> list[int]:
        trained = self.layout.trained_numels
        return sub_groups([per_rank(n, self.states.ranks) for n in trained]) if self.stage3 else [self.part]

    def initialize(self, build: list[tuple[str, int, int]]) -> None:
        """The build (zero_states.build_events: ZeRO-2's flat 16-bit weights included), then the model states
        made at initialize that stay on the GPU."""
        built, count = self._replay_build(build), len(self.layout.numels)
        if self.stage3:  # the trained parameters' partitions, where on the GPU
            ids = [partition_id(position, count) for position in self.layout.trained]
            self._initialize_3([built[i] for i in ids if i in built])
        else:
            self._initialize_2()

    def _initialize_2(self) -> None:
        """ZeRO-2: the fp32 partition (from a 16-bit clone) and the transient gradient with which the
        optimizer's states are initialized; with the optimizer offloaded, the fp32 partition is made on
        the host, but from a 16-bit clone on the GPU all the same (stage_1_and_2.py: `.clone().to(device=
        cpu, dtype=fp32)` clones first), and the buffer each gradient goes to the host through stays."""
        clone = self.trace.malloc(2 * self.part)
        if self.states.to_host:
            self.trace.free(clone)
            self.trace.malloc(2 * max(self.layout.trained_numels))
            return
        self.trace.malloc(4 * self.part)  # fp32 master weights
        self.trace.free(clone)
        self.trace.transient(4 * self.part)

    def _initialize_3(self, partitions: list[int]) -> None:
        """ZeRO-3: the built partitions flattened (`_defragment`); with the optimizer on the GPU, the fp32
        partition of each sub-group (`_fp32_partitions`) and the transient gradient of the largest; the
        bucket; with the optimizer on the GPU, the 16-bit gradient partition; then the gathers as its
        gradient hooks are registered (`_gather_for_hooks`)."""
        self._defragment(partitions)
        if not self.states.to_host:
            self._fp32_partitions()
            self.trace.transient(4 * max(self.groups()))
        self.bucket = self.trace.malloc(self.states.bucket_bytes)
        if not self.states.to_host:
            self.trace.malloc(2 * self.part)
        self._gather_for_hooks()

    def _gather_for_hooks(self) -> None:
        """ZeRO-3 registers each trained parameter's gradient hook between gathering it whole and
        partitioning it again (stage3.py `create_reduce_and_remove_grad_hooks`), one at a time, last at
        initialize. The gather (`_allgather_params_sequential`, as the build's: `zero_states._partitioned`)
        fills the whole from `ds_tensor.to(device)`: an offloaded partition is copied onto the GPU beside
        it; on a CPU that copy is none. The input embedding comes first: the blocks of its gather stay
        cached for what forward makes next (the H200's Llama-3.2-3B with offloaded parameters: two
        752 MiB segments that hold its first activations, where hybrid/18 made 64 MiB ones)."""
        for position in self.layout.trained:
            elements = self.layout.numels[position]
            whole = self.trace.malloc(self._whole(elements))
            if self.states.weights_on_host and not self.states.cpu_check:
                self.trace.transient(2 * per_rank(elements, self.states.ranks))
            self.trace.free(whole)

    def _fp32_partitions(self) -> None:
        """ZeRO-3's fp32 master weights, sub-group by sub-group, each cloned from an fp32 copy of its 16-bit
        partition (stage3.py `_create_fp32_partitions`: `converted = ....to(fp32)`, then `converted.clone()`).
        The copy is a loop variable: Python frees it only when the next sub-group's copy is bound to it, so
        two copies live at once, and the last one to the loop's end. The H200's Llama-3.2-3B `zero3` (four
        sub-groups, the last 732 MiB in fp32): that last copy needs a segment of its own, as the GPU made it
        (hybrid/19 freed each copy at once and carved the last out of the cache: +0.01%; now exact)."""
        copy = None
        for group in self.groups():
            previous, copy = copy, self.trace.malloc(4 * group)
            if previous is not None:
                self.trace.free(previous)
            self.trace.malloc(4 * group)  # fp32 master weights
        if copy is not None:
            self.trace.free(copy)

    def _defragment(self, partitions: list[int]) -> None:
        """ZeRO-3's 16-bit partitions of the trained parameters moved into one flat buffer (DeepSpeed's
        `defragment`): copied into a host buffer, freed, the cache emptied, the buffer copied back to the
        GPU whole. On a CPU the host buffer is the device's and emptying the cache does nothing. None
        with the parameters offloaded. A frozen parameter keeps its own partition."""
        if self.states.weights_on_host:
            return
        if self.states.cpu_check:
            self.trace.malloc(2 * self.part)
        for ident in partitions:
            self.trace.free(ident)
        if not self.states.cpu_check:
            self.trace.release()
            self.trace.malloc(2 * self.part)

    def _replay_build(self, build: list[tuple[str, int, int]]) -> dict[int, int]:
        """The build's events into the trace; its ids still alive -> theirs in the trace."""
        alive: dict[int, int] = {}
        for kind, ident, nbytes in build:
            if kind == "malloc":
                alive[ident] = self.trace.malloc(nbytes)
            elif kind == "free":
                self.trace.free(alive.pop(ident))
            else:
                self.trace.release()
        return alive

    def gather(self, held: bool) -> None:
        """ZeRO-3's weights gathered whole for forward, the ones it keeps for backward held. The first
        step has no trace of the modules' order yet: each weight is released after its module
        (`held` False), here as soon as it is gathered; so is one `Layout` says is released after forward
        in any step. A persistent weight is gathered in the first step and kept; later, the previous
        step gathered it again (`optimizer_step`)."""
        released = self.layout.without_backward | self.layout.beyond_reuse
        for index, elements in enumerate(self.layout.numels):
            if index in self.layout.persistent:
                if not held and self.states.persistent_bytes:
                    self.persistent.append(self.trace.malloc(self._whole(elements), self.stream(ALLGATHER_STREAM)))
            elif held and index not in released:
                self.gathered[index] = self.trace.malloc(2 * elements, self.stream(ALLGATHER_STREAM))
            else:
                self.trace.transient(2 * elements, self.stream(ALLGATHER_STREAM))

    def hook(self, gradient: GradientReady) -> None:
        """A gradient ready: the bucket (ZeRO-2's first), the gradient, a reduction if it overflows the
        bucket, the gradient copied in (or held), its gathered weight released (and the frozen ones
        backward has passed: `ZeroBackward.pass_module`), backward's next ones prefetched."""
        if self.backward is None:
            self.backward = ZeroBackward(self.states, self.layout, first=self.first_step)
        if self.bucket is None:
            self.bucket = self.trace.malloc(self.states.bucket_bytes)
        for position in self.backward.release_tied():
            self.trace.free(self.gathered.pop(position))
        for position in self.backward.gather_held_to_end(gradient):
            self.gathered[position] = self.trace.malloc(2 * self.layout.numels[position], self.stream(ALLGATHER_STREAM))
        regathered = self.trace.malloc(self.backward.regathered_bytes(gradient), self.stream(ALLGATHER_STREAM))
        made = self.trace.malloc(gradient.nbytes)
        if self.backward.overflows(gradient):
            self._reduce()
        self.backward.filled.append(gradient)
        if gradient.elements > self.states.bucket_elements:
            self.held.append(made)
        else:
            self.trace.free(made)
        self.trace.free(regathered)
        released, prefetched = self.backward.pass_module(gradient.index)
        for position in released:
            if position in self.gathered:
                self.trace.free(self.gathered.pop(position))
        for position in prefetched:
            self.gathered[position] = self.trace.malloc(2 * self.layout.numels[position], self.stream(ALLGATHER_STREAM))

    def backward_end(self) -> None:
        """The last reduction; ZeRO-2's bucket freed; weights still gathered released."""
        if self.backward is not None:
            self._reduce()
        self.backward = None
        if not self.stage3 and self.bucket is not None:
            self.trace.free(self.bucket)
            self.bucket = None
        for ident in self.gathered.values():
            self.trace.free(ident)
        self.gathered = {}

    def _reduce(self) -> None:
        """A reduction's temporaries (`ZeroBackward.reduction`), then ZeRO-2's gradient
        partition at the first, and the held gradients let go."""
        assert self.backward is not None
        if self.backward.filled:
            self._temporaries(self.backward.reduction(), self.stream(REDUCE_STREAM) if self.stage3 else 0)
            if not self.stage3 and not self.states.to_host and self.partition is None:
                self.partition = self.trace.malloc(2 * self.part)
        self.backward.filled = []
        for ident in self.held:
            self.trace.free(ident)
        self.held = []

    def _temporaries(self, reduction: Reduction, stream: int) -> None:
        """A reduction's temporaries, each a block of its own, in their order."""
        flat = self.trace.malloc(reduction.flat, stream)
        self.trace.transient(reduction.copy, stream)
        back = self.trace.malloc(reduction.back, stream)
        self.trace.transient(reduction.norm, stream)
        self.trace.transient(reduction.cast, stream)
        self.trace.free(back)
        self.trace.free(flat)

    def _whole(self, elements: int) -> int:
        """A weight gathered whole: its elements padded to a multiple of the ranks, 16-bit."""
        return 2 * per_rank(elements, self.states.ranks) * self.states.ranks

    def optimizer_step(self, first: bool) -> None:
        """ZeRO-3's persistent weights released, DeepSpeed's step, the persistent weights gathered again."""
        for ident in self.persistent:
            self.trace.free(ident)
        self._step_on_gpu(first)
        if self.persistent:
            self.persistent = [self.trace.malloc(self._whole(self.layout.numels[i]), self.stream(ALLGATHER_STREAM))
                               for i in sorted(self.layout.persistent)]

    def _step_on_gpu(self, first: bool) -> None:
        """DeepSpeed's step on the GPU, sub-group by sub-group (ZeRO-2: its whole partition at once)."""
        if self.states.to_host:
            return  # the step runs on the host; the GPU's 16-bit weights are written in place
        for _ in range(2):  # two passes of fp64 copies for norms, one gradient at a time (seen in its trace)
            for elements in self.layout.trained_numels:
                self.trace.transient(8 * per_rank(elements, self.states.ranks))
        for group in self.groups():
            flat = self.trace.malloc(2 * group)
            fp32 = self.trace.malloc(4 * group)
            self.trace.free(flat)
            if self.partition is not None:
                self.trace.free(self.partition)
                self.partition = None
            if first:
                self.trace.malloc(4 * group)  # Adam's moments, made at the first step
                self.trace.malloc(4 * group)
            self.trace.transient(4 * group)  # AdamW's temporary
            self.trace.free(fp32)
