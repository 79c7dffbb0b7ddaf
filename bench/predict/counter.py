"""Counting what a training step keeps alive, op by op, as the CUDA caching allocator would.

`MemoryCounter` is a TorchDispatchMode: every tensor an op returns is looked at once per storage,
its bytes rounded up to 512 B (the allocator's smallest block: every allocation is a multiple of
it) and added to the live total; when the storage dies (a weakref finalizer), they are subtracted.
It works the same over fake tensors (a prediction) and real ones (the test that the fake run is
faithful). Each allocation is a `Record` of the trace: bytes, when it was made and freed (event
indices), in which stage/phase, by which op and on which stream, and its role, known once the step
has shown it:

- weight: a parameter or buffer;
- gradient: a parameter's `.grad` when the optimizer phase begins;
- optimizer_state: a tensor the optimizer holds after its step;
- activation: made during a forward pass and still alive when backward begins (saved for
  backward, or kept as a checkpointed layer's input);
- input: the batches;
- workspace: cuBLAS workspaces (bench/predict/cublas.py), which no fake kernel allocates;
- temporary: anything else (backward's intermediates, a step's scratch, and a GPU kernel's own
  scratch that its fake kernel does not allocate: `KernelScratch`).

The peak is the largest live total after an allocation; the breakdown at the peak sums the roles of
the records alive at that event.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ..measure import storage_tensors
from . import cublas, rng_ops
from .cublas import Workspaces
from .pinned import PinnedHostCache
from .steptime import StepWork

BLOCK_BYTES = 512  # the caching allocator rounds every request up to a multiple of this
# Memory counted apart from the device allocator's: pinned host memory (bench/predict/pinned.py), pageable
# host memory (an optimizer stepping on the CPU), CUDA managed memory (a paged optimizer's state)
POOLS = ("pinned", "pageable", "managed")
ROLES = ("weight", "gradient", "optimizer_state", "activation", "input", "workspace", "temporary")


def rounded(nbytes: int) -> int:
    """A request's bytes as the caching allocator gives them: rounded up to a block."""
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


@dataclass
class Record:
    nbytes: int  # rounded up to BLOCK_BYTES
    made: int  # event index of the allocation (-1 until counted)
    where: str  # stage/phase it was made in
    op: str
    freed: int | None = None  # event index of the free; None: alive at the end
    role: str | None = None  # None until known: then "temporary"
    stream: int = 0  # the stream current when it was allocated: 0 the default, 1, 2, ... others as they appear
    takes_over: int | None = None  # a gradient summed in place: the record whose block it continues


@dataclass(frozen=True)
class Peak:
    nbytes: int = 0
    event: int = -1
    where: str = ""
    op: str = ""


@dataclass(frozen=True)
class Moment:
    """The bytes alive after one event of the trace: an allocation (made in `where` by `op`) or a free."""

    event: int
    live_bytes: int
    allocated: bool
    where: str = ""  # an allocation's stage/phase; "" for a free
    op: str = ""


@dataclass(frozen=True)
class GradientReady:
    """A parameter's gradient fully accumulated by autograd (its post-accumulate-grad hook ran): before
    event `event` of the trace; the gradient's bytes (512 B blocks) and elements, and the parameter's
    position among those watched (`MemoryCounter.watch_gradients`)."""

    event: int
    nbytes: int
    elements: int
    index: int


@dataclass(frozen=True)
class StepEnd:
    """Where a step ended in the trace: its stage, its batch's positions per row, the event count and
    the bytes alive then; and the work the step dispatched (bench/predict/flops.py: its FLOPs, matmuls and
    attention, recomputation included; its ops and kernels; None where not counted)."""

    stage: str
    positions: int
    event: int
    live_bytes: int
    work: StepWork | None = None


@dataclass(frozen=True)
class Scratch:
    """Bytes an op's GPU kernel allocates and frees inside the op, which its fake kernel does not, in
    the order it allocates them: `before` its outputs (bitsandbytes' 4-bit matmul dequantizes the
    weight, then multiplies: bench/predict/bnb.py) or `after` them (flash attention's backward makes
    dQ, dK, dV first, then its accumulators: bench/predict/attention.py). All are freed as it returns."""

    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()


NO_SCRATCH = Scratch()
# (op, args, kwargs) -> the op's scratch on the GPU kind predicted for; none for a real CPU run
KernelScratch = Callable[[str, Any, Any], Scratch]


def no_scratch(op: str, args: Any, kwargs: Any) -> Scratch:
    return NO_SCRATCH


def all_scratch(*kernels: KernelScratch) -> KernelScratch:
    """One KernelScratch from several, each knowing its own ops."""
    def scratch(op: str, args: Any, kwargs: Any) -> Scratch:
        found = [kernel(op, args, kwargs) for kernel in kernels]
        return Scratch(tuple(n for s in found for n in s.before), tuple(n for s in found for n in s.after))
    return scratch


class MemoryCounter(TorchDispatchMode):
    supports_higher_order_operators = True  # compiled code's random-state wrappers (bench/predict/rng_ops.py)

    def __init__(self, workspaces: Workspaces = cublas.NONE, kernel_scratch: KernelScratch = no_scratch):
        super().__init__()
        self.kernel_scratch = kernel_scratch
        self.records: list[Record] = []
        self._record_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> index in records
        self._threads_with_workspace: set[tuple[str, str]] = set()  # (thread, cublas | cublaslt)
        self.workspaces = workspaces
        self.live_bytes = 0
        self.events = 0
        self.where = "build"
        self.peak = Peak()
        self.steady_peak = Peak()  # the measured stage's
        self.phase_peaks: dict[str, int] = {}  # stage/phase -> the most bytes alive in it
        self.phase_ends: dict[str, int] = {}  # stage/phase -> bytes alive when it ended
        self.steps: list[StepEnd] = []  # each step's end, in order
        self._forward_start = 0  # first record of the current forward pass
        self._pending: tuple[int, int] | None = None  # (sum, its first operand): see _is_gradient_sum
        self.sums: list[tuple[int, bool]] = []  # the engine's gradient sums: (bytes, done in place by a plain run)
        self.gradients_ready: list[GradientReady] = []  # in order, once `watch_gradients` is called
        self._hooks: list[Any] = []  # `watch_gradients` and `watch_backward_use`, removed at `finish`
        self.needs_backward: dict[int, bool] = {}  # a parameter's position -> whether backward runs a module of it
        self.fed_without_gradient: set[int] = set()  # positions held by a module with backward but no input needing a gradient
        self.on_optimizer: Callable[[], Iterable[Any]] = tuple  # the trainable parameters, asked when a step begins
        self.after_step: Callable[[], Iterable[Any]] = tuple  # the optimizer's state tensors, asked after a step
        # Memory counted apart from the caching allocator's (POOLS): "pinned" (pin_memory=True, or made inside
        # `apart("pinned")`), "pageable" and "managed" (made inside `apart(...)`): bytes alive and their peak,
        # per pool; pinned blocks as the host allocator rounds and caches them
        self.apart_live_bytes = dict.fromkeys(POOLS, 0)
        self.apart_peak_bytes = dict.fromkeys(POOLS, 0)
        self.pinned = PinnedHostCache()
        self.host_peak_bytes = 0  # the most host memory held at once: pinned blocks created + pageable alive
        self._apart: WeakIdKeyDictionary = WeakIdKeyDictionary()  # such storages -> their pool
        self._apart_pool: str | None = None
        self.releases: list[int] = []  # event counts at which torch.cuda.empty_cache() emptied the cache
        # The streams allocations were made on, in order of appearance (the default first). On a CPU,
        # torch.cpu.stream(s) sets a current stream as torch.cuda.stream(s) does on a GPU, so FSDP2's
        # all-gather and reduce-scatter streams, entered the same way, are seen here (the allocator
        # keeps a pool per stream: bench/predict/allocator.py).
        self.streams: list[Any] = [torch.cpu.current_stream()]

    def __enter__(self) -> MemoryCounter:
        # FSDP frees a unit's gathered parameters by resizing their storage to nothing, and gathers them
        # again into the same storage resized back: on a GPU a free and an allocation, which no op shows
        original = torch.UntypedStorage.resize_

        def resize_(storage: Any, nbytes: int) -> Any:
            out = original(storage, nbytes)
            self.resized(storage)
            return out
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        # the cache emptied (bench/deferred.py does, after its replay): the allocator replay releases it
        empty_cache = torch.cuda.empty_cache
        torch.cuda.empty_cache = lambda: self.releases.append(self.events)

        def unpatch() -> None:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
            torch.cuda.empty_cache = empty_cache
        self._unpatch = unpatch
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._unpatch()
        super().__exit__(*exc)

    # --- allocations ---

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if isinstance(func, HigherOrderOperator):
            return rng_ops.run(self, func, args, kwargs or {})
        self._settle()  # an accumulation the previous op left pending: its first operand outlived it
        op = func.overloadpacket.__name__
        scratch = self.kernel_scratch(op, args, kwargs or {})
        made = [self._scratch(nbytes, op) for nbytes in scratch.before]
        try:
            out = self._dispatch(func, op, args, kwargs or {})
            # a GEMM asks for its workspace once its outputs exist (the GPU's traces: the mm's output, then the
            # workspace): its thread's, kept, or (torch >= 2.15) one of its own, given back as it returns
            workspace = self.workspaces.of(op, args, kwargs or {})
            if workspace is not None:
                kind, nbytes, kept = workspace
                if kept:
                    self._workspace_for(self.workspaces.thread_of(self.where), kind, nbytes)
                else:
                    made.append(self._scratch(nbytes, op, f"{kind} workspace", role="workspace"))
            made += [self._scratch(nbytes, op) for nbytes in scratch.after]
            return out
        finally:
            for index in made:  # freed as the kernel returns, after its outputs were allocated
                self._free(index)

    def _dispatch(self, func: Any, op: str, args: Any, kwargs: Any) -> Any:
        out = func(*args, **kwargs)
        pool = "pinned" if kwargs.get("pin_memory") else self._apart_pool  # pinned host memory (activation offload)
        if pool is not None:
            for tensor in storage_tensors(leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)):
                self._track_apart(tensor, pool)
            return out
        if self._is_gradient_sum(op, args, kwargs, out):
            self._sum(out, args[0])
            return out
        # A wrapper subclass (FSDP2's DTensor) owns no memory: the tensors inside it do. Its op's own
        # allocations ran on those while this mode was off, so they are counted here, at their size.
        for tensor in storage_tensors(leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)):
            if tensor.untyped_storage() in self._apart:
                continue  # written in place into memory counted apart (a copy_ into pinned host memory)
            if tensor.is_meta:
                continue  # holds no memory (a deferred build's parameters)
            self.track(tensor, op)
        return out

    def _scratch(self, nbytes: int, op: str, what: str = "scratch", role: str | None = None) -> int:
        """An allocation a GPU kernel makes and frees inside its op, which its fake kernel does not."""
        self.records.append(Record(rounded(nbytes), -1, self.where, f"{op} ({what})", role=role,
                                   stream=self._stream()))
        self._count(len(self.records) - 1)
        return len(self.records) - 1

    def track(self, tensor: torch.Tensor, op: str, role: str | None = None) -> None:
        """Counts the tensor's storage once (a view or an in-place result is not a new allocation); a meta
        tensor holds no memory (a deferred build's parameters, bench/deferred.py)."""
        if tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        index = self._record_of.get(storage)
        if index is None:
            index = self._new_record(storage, op)
            self._count(index)
        if role is not None:
            self.records[index].role = role

    def resized(self, storage: Any) -> None:
        """A storage resized in place: to nothing, its record is freed (the storage lives on); from
        nothing, a new record of its new size is allocated."""
        if storage in self._apart:
            return
        index = self._record_of.get(storage)
        if storage.nbytes() == 0 and index is not None:
            del self._record_of[storage]
            self._free(index)
        elif storage.nbytes() and index is None:
            self._count(self._new_record(storage, "resize_"))

    @contextlib.contextmanager
    def apart(self, pool: str) -> Iterator[None]:
        """Storages made inside are counted in `pool` (one of POOLS), not the caching allocator's."""
        before, self._apart_pool = self._apart_pool, pool
        try:
            yield
        finally:
            self._apart_pool = before

    @property
    def host_bytes(self) -> int:
        """Host memory held now: every pinned block created (cached ones too) and pageable memory alive."""
        return self.pinned.created_bytes + self.apart_live_bytes["pageable"]

    def to_pool(self, tensor: torch.Tensor, pool: str) -> None:
        """The tensor's storage, counted so far as the device's, now lives in `pool`: what a copy to the
        host and the device copy's free do on a GPU, where the fake run's "device" and host are one."""
        storage = tensor.untyped_storage()
        index = self._record_of.pop(storage, None)
        if index is not None:
            self._free(index)
        self._track_apart(tensor, pool)

    def _track_apart(self, tensor: torch.Tensor, pool: str) -> None:
        storage = tensor.untyped_storage()
        if storage in self._apart:
            return
        nbytes = self.pinned.allocate(storage.nbytes()) if pool == "pinned" else storage.nbytes()
        self._apart[storage] = pool
        self.apart_live_bytes[pool] += nbytes
        self.apart_peak_bytes[pool] = max(self.apart_peak_bytes[pool], self.apart_live_bytes[pool])
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        weakref.finalize(storage, self._free_apart, pool, nbytes)

    def _free_apart(self, pool: str, nbytes: int) -> None:
        self.apart_live_bytes[pool] -= nbytes
        if pool == "pinned":
            self.pinned.release(nbytes)

    def _new_record(self, storage: Any, op: str) -> int:
        self.records.append(Record(rounded(storage.nbytes()), -1, self.where, op, stream=self._stream()))
        index = len(self.records) - 1
        self._record_of[storage] = index
        weakref.finalize(storage, self._free, index)
        return index

    def _stream(self) -> int:
        """The current stream's number (see self.streams)."""
        current = torch.cpu.current_stream()
        for number, stream in enumerate(self.streams):
            if stream is current:
                return number
        self.streams.append(current)
        return len(self.streams) - 1

    def _count(self, index: int) -> None:
        """The record's bytes become live now: an allocation event, and maybe a new peak."""
        record = self.records[index]
        record.made = self.events
        self.live_bytes += record.nbytes
        if self.live_bytes > self.peak.nbytes:
            self.peak = Peak(self.live_bytes, self.events, self.where, record.op)
        self.phase_peaks[self.where] = max(self.live_bytes, self.phase_peaks.get(self.where, 0))
        if self.where.startswith("measure/") and self.live_bytes > self.steady_peak.nbytes:
            self.steady_peak = Peak(self.live_bytes, self.events, self.where, record.op)
        self.events += 1

    def _free(self, index: int) -> None:
        record = self.records[index]
        if self._pending is not None and index in self._pending:
            self._resolve_pending(index)
            return
        if record.freed is not None:  # freed before its storage died: moved to a pool, or resized to nothing
            return
        record.freed = self.events
        self.live_bytes -= record.nbytes
        self.events += 1

    # --- gradient accumulation, as a run without a dispatch mode does it ---
    # When two gradients flow into one input, autograd's engine sums them. A plain run adds the new
    # one into the old in place when it holds the last reference to it and its storage
    # (can_accumulate_inplace, torch/csrc/autograd/input_buffer.cpp); with any Python dispatch mode
    # active (this counter, or fake tensors) it never does, and writes `old + new` to a new tensor,
    # then drops the old one: a transient allocation a GPU run does not make. So such an add is held
    # pending: if its first operand dies before the next op, the plain run would have reused it (the
    # bytes move over, no allocation); if it is still alive, the sum was a real allocation and is
    # counted then. An operand that is itself a view is summed out of place by a plain run too (seen
    # with torch's profiler: a tied bf16 embedding's gradient arrives from lm_head as a transposed view
    # and is added out of place; an fp32 one, cast back by autocast, in place), but not one `detach`
    # returned (Liger saves its lm_head gradient detached: added in place), nor a tensor some view of
    # which existed before and is gone (the H200's traces: every such sum in a Llama layer's backward
    # in place; counting those out of place moved the fake run's blocks away from the GPU's). A sum
    # taken in place continues its operand's block in the allocator's trace (`Record.takes_over`).

    def _is_gradient_sum(self, op: str, args: Any, kwargs: Any, out: Any) -> bool:
        """The engine's gradient sum: an add in backward, grad mode off, two tensors of the result's
        shape and dtype, no alpha (a recomputed forward under gc runs with grad mode on)."""
        return (op == "add" and not kwargs and self.where.endswith("/backward") and not torch.is_grad_enabled()
                and len(args) == 2 and all(isinstance(a, torch.Tensor) for a in args) and isinstance(out, torch.Tensor)
                and args[0].shape == args[1].shape == out.shape and args[0].dtype == out.dtype
                and self._record_of.get(args[0].untyped_storage()) is not None
                and self._record_of.get(out.untyped_storage()) is None)

    def _sum(self, out: torch.Tensor, operand: torch.Tensor) -> None:
        old = self._record_of[operand.untyped_storage()]
        if operand._is_view():  # out of place in a plain run too: a view shares its storage with its base
            self.track(out, "add")
            self.sums.append((self.records[self._record_of[out.untyped_storage()]].nbytes, False))
        else:  # pending: in place if the operand dies before the next op
            self._pending = (self._new_record(out.untyped_storage(), "add"), old)

    def _settle(self) -> None:
        if self._pending is not None:
            result, _ = self._pending
            self._pending = None
            self._count(result)
            self.sums.append((self.records[result].nbytes, False))

    def _resolve_pending(self, dying: int) -> None:
        result, operand = self._pending or (-1, -1)
        self._pending = None
        if dying == operand:  # reused in place by a plain run: the operand's bytes become the result's
            self.records[operand].freed = self.records[result].made = self.events
            self.records[result].takes_over = operand
            self.events += 1
            self.sums.append((self.records[result].nbytes, True))
        else:  # the sum itself died before the next op: it never counted
            self.records[result].made = self.records[result].freed = self.events
            self.events += 1

    def _workspace_for(self, thread: str, kind: str, nbytes: int) -> None:
        if (thread, kind) not in self._threads_with_workspace:
            self._threads_with_workspace.add((thread, kind))
            self.records.append(Record(nbytes, -1, self.where, f"{kind} workspace ({thread} thread)",
                                       role="workspace", stream=self._stream()))
            self._count(len(self.records) - 1)

    # --- phases: the trainer calls enter() as each begins; roles become known at the boundaries ---

    def enter(self, where: str) -> None:
        self._settle()
        self.phase_ends[self.where] = self.live_bytes
        before, self.where = self.where, where
        if where.endswith("/forward"):
            if before.endswith("/optimizer"):
                self.mark(self.after_step(), "optimizer_state")
            self._forward_start = len(self.records)
        elif where.endswith("/backward") and before.endswith("/forward"):
            for record in self.records[self._forward_start:]:
                if record.freed is None and record.role is None:
                    record.role = "activation"
        elif where.endswith("/optimizer"):
            self.mark((p.grad for p in self.on_optimizer() if p.grad is not None), "gradient")

    def watch_gradients(self, params: Iterable[Any]) -> None:
        """Note where in the trace each parameter's gradient is ready (`gradients_ready`): where an engine
        that takes gradients from the same hook as they come (DeepSpeed's ZeRO) would take it."""
        def ready(index: int, param: Any) -> None:
            if param.grad is None:  # taken by a hook before this one (optimizer_in_backward steps and frees it)
                return
            nbytes = rounded(param.grad.untyped_storage().nbytes())
            self.gradients_ready.append(GradientReady(self.events, nbytes, param.grad.numel(), index))
        trainable = [p for p in params if p.requires_grad]
        self._hooks += [p.register_post_accumulate_grad_hook(functools.partial(ready, i))
                                 for i, p in enumerate(trainable)]

    def watch_backward_use(self, model: Any) -> None:
        """Note, for each parameter (its position in `model.parameters()`), whether backward runs a module
        that holds it: whether any of its modules' outputs requires a gradient in forward
        (`needs_backward`). A frozen base's modules before its first trained one do not (an engine that
        gathers weights for a module's backward, DeepSpeed's ZeRO-3, never gathers theirs there). And
        whether such a module is called with no positional input that requires a gradient
        (`fed_without_gradient`: the input embedding, fed token ids): ZeRO-3 learns that a module's
        backward is done from its inputs' gradients, so it keeps that module's weights gathered until
        backward has ended."""
        position = {id(p): i for i, p in enumerate(model.parameters())}

        def needs_gradient(tensors: Any) -> bool:
            return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(tensors))

        def after_forward(module: Any, args: Any, output: Any) -> None:
            needed = needs_gradient(output)
            for param in module.parameters(recurse=False):
                if id(param) in position:
                    self.needs_backward[position[id(param)]] = needed or self.needs_backward.get(position[id(param)], False)
                    if needed and not needs_gradient(args):
                        self.fed_without_gradient.add(position[id(param)])
        self._hooks += [m.register_forward_hook(after_forward) for m in model.modules()
                                 if next(m.parameters(recurse=False), None) is not None]

    def step_done(self, stage: str, positions: int, work: StepWork | None = None) -> None:
        """A step ended (the trainer's Phases protocol, as the worker's tracker has it)."""
        self._settle()
        self.steps.append(StepEnd(stage, positions, self.events, self.live_bytes, work))

    def finish(self) -> None:
        """After the last step: the optimizer's state of that step is known too."""
        self._settle()
        self.phase_ends[self.where] = self.live_bytes
        if self.where.endswith("/optimizer"):
            self.mark(self.after_step(), "optimizer_state")
        self.where = "done"
        # Let go of the model and optimizer: the finalizers (held globally) reach this counter, so a
        # counter that kept them would keep every cell's tensors alive for the process's life.
        self.on_optimizer = self.after_step = tuple
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def mark(self, tensors: Iterable[Any], role: str) -> None:
        """The role of the records holding these tensors, where none is known yet."""
        for tensor in storage_tensors(tensors):
            index = self._record_of.get(tensor.untyped_storage())
            if index is not None and self.records[index].role is None:
                self.records[index].role = role

    # --- what the trace says ---

    def alive_at(self, event: int) -> list[Record]:
        return [r for r in self.records if r.made <= event and (r.freed is None or r.freed > event)]

    def moments_of_roles_except(self, roles: tuple[str, ...]) -> list[Moment]:
        """The live total of the records of the other roles after each of their allocations and frees, in
        the order of events (what a model of another engine adds its own bytes to, moment by moment)."""
        deltas = []
        for r in self.records:
            if (r.role or "temporary") not in roles and r.made >= 0:
                deltas.append((r.made, r.nbytes, r.where, r.op))
                if r.freed is not None:
                    deltas.append((r.freed, -r.nbytes, "", ""))
        moments, live = [], 0
        for event, delta, where, op in sorted(deltas):
            live += delta
            moments.append(Moment(event, live, delta > 0, where, op))
        return moments

    def peak_of_roles_except(self, roles: tuple[str, ...], phases: tuple[str, ...] | None = None) -> Peak:
        """The most bytes ever alive at once among records of the other roles, and the allocation that
        made it; with `phases` (e.g. ("forward", "backward")), the most at an allocation made in a phase
        of those names."""
        peak = Peak()
        for m in self.moments_of_roles_except(roles):
            in_phases = phases is None or m.where.rsplit("/", 1)[-1] in phases
            if m.allocated and m.live_bytes > peak.nbytes and in_phases:
                peak = Peak(m.live_bytes, m.event, m.where, m.op)
        return peak

    def breakdown(self, peak: Peak) -> dict[str, int]:
        """Bytes per role of what was alive at this peak."""
        totals = dict.fromkeys(ROLES, 0)
        for record in self.alive_at(peak.event):
            totals[record.role or "temporary"] += record.nbytes
        return totals

