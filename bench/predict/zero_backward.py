"""What a ZeRO engine holds on one rank through forward and backward besides its model states, as the
hybrid (bench/predict/hybrid.py) counts DeepSpeed 0.19.8's: its bucket, what its gradient hooks hold
and reduce, and ZeRO-3's gathered weights (`ZeroBackward`, `Reduction`), placed where the same hooks fire
in the fake run's trace (`training_peak`): the hybrid's peak allocated in training.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .counter import GradientReady, MemoryCounter, Peak
from .zero_layout import Layout, per_rank, prefetched
from .zero_states import MODEL_STATE_ROLES, ModelStates

# The fake run's phases whose other bytes (activations) meet the training states: its optimizer phase is
# the plain AdamW's, whose temporaries DeepSpeed's step replaces with its own (`phased`).
TRAINING_PHASES = ("forward", "backward")


def training_peak(counter: MemoryCounter, states: ModelStates, layout: Layout) -> Peak:
    """The most bytes one rank holds in forward and backward: the training model states, plus the fake
    run's other bytes moment by moment (activations, temporaries, the batch, workspaces), plus the
    engine's own (`ZeroBackward`): its bucket, and what its gradient hooks hold and reduce, placed
    where the same hooks fire in the fake run's trace, so they meet the activations only where the
    trace says they do, not at their most."""
    # the gradients' hooks run between events: each sorts before the event it precedes
    timeline = sorted([((m.event, 1), m, None) for m in counter.moments_of_roles_except(MODEL_STATE_ROLES)]
                      + [((g.event, 0), None, g) for g in counter.gradients_ready], key=lambda item: item[0])
    peak, live, backward = Peak(), 0, None
    first_stage = counter.steps[0].stage if counter.steps else ""
    # ZeRO-3's bucket, from initialize on, and in forward its gathered weights
    outside_backward = (states.bucket_bytes if states.bucket_in_step else 0) + states.gathered_bytes
    where = ""
    for _, moment, gradient in timeline:
        if gradient is not None:  # a hook, in backward
            backward = backward or ZeroBackward(states, layout, first=where.startswith(f"{first_stage}/"))
            peak = _more(peak, states.training_bytes + live + backward.hook(gradient), where, "gradient hook")
            continue
        assert moment is not None
        phase = moment.where.rsplit("/", 1)[-1] if moment.allocated else None
        if backward is not None and phase not in (None, "backward"):  # backward has ended: its last reduction
            peak = _more(peak, states.training_bytes + live + backward.epilogue(), where, "reduce (backward's end)")
            backward = None
        if phase == "backward" and backward is None:
            backward = ZeroBackward(states, layout, first=moment.where.startswith(f"{first_stage}/"))
        live, where = moment.live_bytes, moment.where or where
        if moment.allocated and phase in TRAINING_PHASES:
            engine = backward.alive_bytes() if backward is not None else outside_backward
            peak = _more(peak, states.training_bytes + live + engine, where, moment.op, moment.event)
    if backward is not None:
        peak = _more(peak, states.training_bytes + live + backward.epilogue(), where, "reduce (backward's end)")
    return peak


def _more(peak: Peak, nbytes: int, where: str, op: str, event: int = -1) -> Peak:
    return Peak(nbytes, event, where, op) if nbytes > peak.nbytes else peak


NORM_CHUNK_ELEMENTS = 250_000_000  # ZeRO-3's gradient norm casts a partition to fp64 this many elements at a time


@dataclass
class ZeroBackward:
    """What a ZeRO engine holds on one rank through one backward, besides the training states, as its
    gradient hooks allocate it (DeepSpeed 0.19.8, stage_1_and_2.py and stage3.py: contiguous gradients,
    no overlap):

    - the bucket (`reduce_bucket_size` 16-bit elements): ZeRO-2 makes it at the first gradient's hook,
      ZeRO-3 holds it from initialize on;
    - ZeRO-3's gathered weights (`ModelStates.gathered_bytes` at backward's start): each is released
      after its module's backward, here at its gradient's hook (a frozen one's: `Layout.passing_at`),
      but for those held to backward's end (`gather_held_to_end`); a tied one whose next use is far,
      after its first module's backward, here at backward's first hook (`release_tied`);
      then, after the first step, its prefetch gathers backward's next weights while fewer than max_live
      elements are (`pass_module`); a weight not gathered is gathered at its hook (`regathered_bytes`);
    - each gradient autograd makes is copied into the bucket by its hook, and freed: alive until its
      hook. One larger than the bucket waits, alone, for the next reduction;
    - a gradient that would overflow the bucket first reduces it, and backward's end reduces what is
      left (`_reduce`).

    `layout`: the parameters, which train, and the ranks whose ZeRO-2 partitions each gradient falls in."""

    states: ModelStates
    layout: Layout
    bucket_bytes: int = 0
    partition_bytes: int = 0
    first: bool = False  # the first step's backward: nothing held from forward, no prefetch (no trace yet)
    filled: list[GradientReady] = field(default_factory=list)  # since the last reduction, in order
    gathered: set[int] = field(default_factory=set)  # ZeRO-3: the positions whose weights are gathered now
    passed: set[int] = field(default_factory=set)  # ZeRO-3: the positions whose modules backward has passed

    def __post_init__(self) -> None:
        if self.states.bucket_in_step:
            self.bucket_bytes = self.states.bucket_bytes
        if self.states.gathers and not self.first:
            self.gathered = set(self.layout.held_positions)

    def alive_bytes(self) -> int:
        held = sum(g.nbytes for g in self.filled if g.elements > self.states.bucket_elements)
        gathered = sum(2 * self.layout.numels[i] for i in self.gathered)
        return self.bucket_bytes + self.partition_bytes + held + gathered

    def hook(self, gradient: GradientReady) -> int:
        """A gradient is ready: the most bytes the engine holds in its hook, the gradient's included (and
        the weights backward gathered again for its module: `regathered_bytes`)."""
        self.bucket_bytes = self.states.bucket_bytes
        self.release_tied()
        self.gather_held_to_end(gradient)
        most, regathered = 0, self.regathered_bytes(gradient)
        if self.overflows(gradient):
            most = self._reduce(waiting_bytes=gradient.nbytes + regathered)
        most = max(most, gradient.nbytes + self.alive_bytes() + regathered)
        self.filled.append(gradient)
        self.pass_module(gradient.index)
        return most

    def release_tied(self) -> list[int]:
        """At backward's first hook (lm_head's backward done): ZeRO-3's tied weights released there
        (`Layout.released_in_backward`), if gathered: their positions."""
        if self.passed:
            return []
        released = sorted(self.layout.released_in_backward & self.gathered)
        self.gathered -= set(released)
        return released

    def gather_held_to_end(self, gradient: GradientReady) -> list[int]:
        """ZeRO-3's weights of this gradient's module that it keeps gathered until backward has ended
        (`Layout.held_to_backward_end`), gathered for its backward if they are not: their positions."""
        if not self.states.gathers:
            return []
        held_to_end = self.layout.held_to_backward_end - self.gathered
        gathered = [i for i in self.layout.passing_at(gradient.index) if i in held_to_end]
        self.gathered.update(gathered)
        return gathered

    def regathered_bytes(self, gradient: GradientReady) -> int:
        """ZeRO-3's weights of this gradient's module not gathered now (released after forward, not
        prefetched since), gathered again whole for its backward, 16-bit."""
        if not self.states.gathers:
            return 0
        return sum(2 * per_rank(self.layout.numels[i], self.states.ranks) * self.states.ranks
                   for i in self.layout.passing_at(gradient.index) if i not in self.gathered)

    def pass_module(self, index: int) -> tuple[list[int], list[int]]:
        """The `index`-th trained parameter's module done: ZeRO-3 releases its weights (not those held to
        backward's end), then (after the first step) prefetches backward's next ones, from the model's
        end, while fewer than max_live elements are gathered (`prefetched`). The positions released and
        gathered."""
        released = [i for i in self.layout.passing_at(index) if i in self.gathered - self.layout.held_to_backward_end]
        self.gathered -= set(released)
        self.passed.update(self.layout.passing_at(index))
        added: list[int] = []
        if self.states.gathers and not self.first:
            ahead = (self.layout.held_positions | self.layout.beyond_reuse) - self.passed - self.gathered
            added = sorted(prefetched(self.layout.numels, frozenset(self.gathered), ahead,
                                      self.states.max_live_elements), reverse=True)
            self.gathered.update(added)
        return released, added

    def overflows(self, gradient: GradientReady) -> bool:
        """Whether this gradient would overflow the bucket: the bucket is reduced before it goes in."""
        return sum(g.elements for g in self.filled) + gradient.elements > self.states.bucket_elements

    def epilogue(self) -> int:
        """Backward's last reduction: the most bytes the engine holds in it."""
        return max(self._reduce(waiting_bytes=0), self.alive_bytes())

    def _reduce(self, waiting_bytes: int) -> int:
        """The bucket reduced and this rank's share kept: the most bytes held meanwhile."""
        if not self.filled:
            return 0
        most = waiting_bytes + self.alive_bytes() + self.scratch_bytes()
        self.partition_bytes = self.states.partition_bytes  # ZeRO-2's, made at the first reduction
        most = max(most, waiting_bytes + self.alive_bytes())  # the partition made, a large gradient still held
        self.filled = []
        return most

    def scratch_bytes(self) -> int:
        """What reducing the gradients now in the bucket allocates besides what is alive, at its most."""
        return self.reduction().most_bytes

    def reduction(self) -> Reduction:
        """The temporaries of reducing the gradients now in the bucket."""
        return self._reduced_2() if self.states.stage == 2 else self._reduced_3()

    def _reduced_2(self) -> Reduction:
        """ZeRO-2's reduction, besides what is alive: on several ranks, gradients that span two partitions
        are first flattened into one temporary (within one partition the bucket's view is reduced). Then
        the rank's share is copied into its 16-bit gradient partition, or with the optimizer offloaded
        each of its gradients in turn goes to the host, through an fp64 copy on the GPU for its norm
        (DeepSpeed's norms accumulate in fp64): the largest's sets the moment (all of it: the
        most-loaded rank)."""
        ranks = {rank for g in self.filled for rank in self.layout.partitions_of[g.index]}
        flattened = 2 * sum(g.elements for g in self.filled) if len(ranks) > 1 else 0
        to_host = 8 * max(g.elements for g in self.filled) if self.states.to_host else 0
        return Reduction(copy=flattened, norm=to_host)

    def _reduced_3(self) -> Reduction:
        """ZeRO-3's reduction (`reduce_scatter_coalesced`), besides what is alive: the gradients
        interleaved by rank, each padded to a multiple of N, into one 16-bit temporary (none for a
        single gradient N divides), reduce-scattered; the rank's partitions are views of it. Without
        offload each is copied into the rank's gradient partition (in the training states). With the
        optimizer offloaded, each in turn is copied to the host's 16-bit partition, back to the GPU
        (2 B each), cast to fp64 for its norm 250M elements at a time (8 B each), then to fp32 (4 B
        each) for the host's fp32 gradients: the largest partition's sets the moment. A CPU check has no
        copies between host and device, and gloo's reduce-scatter copies its input."""
        ranks = self.states.ranks
        single = len(self.filled) == 1 and self.filled[0].elements % ranks == 0
        flat = 0 if single else 2 * sum(per_rank(g.elements, ranks) * ranks for g in self.filled)
        gloo = (flat or self.filled[0].nbytes) if self.states.cpu_check else 0
        if not self.states.to_host:
            return Reduction(flat=flat, copy=gloo)
        back = 0 if self.states.cpu_check else 2
        largest = max(per_rank(g.elements, ranks) for g in self.filled)
        return Reduction(flat=flat, copy=gloo, back=back * largest, norm=8 * min(largest, NORM_CHUNK_ELEMENTS),
                         cast=4 * largest)


@dataclass(frozen=True)
class Reduction:
    """A reduction's temporaries, bytes, in the order they come: `flat` through all of it; beside it
    first `copy`, freed; then `back`, beside which `norm` and then `cast` come and go."""

    flat: int = 0
    copy: int = 0
    back: int = 0
    norm: int = 0
    cast: int = 0

    @property
    def most_bytes(self) -> int:
        return self.flat + max(self.copy, self.back + max(self.norm, self.cast))
