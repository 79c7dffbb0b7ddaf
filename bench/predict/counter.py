"""Counting what a training step keeps alive, op by op, as the CUDA caching allocator would.

`MemoryCounter` is a TorchDispatchMode: every tensor an op returns is looked at once per storage,
its bytes rounded up to 512 B (the allocator's smallest block: every allocation is a multiple of
it) and added to the live total; when the storage dies (a weakref finalizer), they are subtracted.
It works the same over fake tensors (a prediction) and real ones (the test that the fake run is
faithful). Each allocation is a `Record` of the trace: bytes, when it was made and freed (event
indices), in which stage/phase and by which op, and its role, known once the step has shown it:

- weight: a parameter or buffer;
- gradient: a parameter's `.grad` when the optimizer phase begins;
- optimizer_state: a tensor the optimizer holds after its step;
- activation: made during a forward pass and still alive when backward begins (saved for
  backward, or kept as a checkpointed layer's input);
- input: the batches;
- workspace: cuBLAS workspaces (see `Workspaces`), which no fake kernel allocates;
- temporary: anything else (backward's intermediates, a step's scratch).

The peak is the largest live total after an allocation; the breakdown at the peak sums the roles of
the records alive at that event.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

BLOCK_BYTES = 512  # the caching allocator rounds every request up to a multiple of this
ROLES = ("weight", "gradient", "optimizer_state", "activation", "input", "workspace", "temporary")
# Ops that run a cuBLAS GEMM on CUDA: the first one in a thread makes that thread's handle and workspace.
CUBLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_scaled_mm",
                        "_addmm_activation"})


@dataclass
class Record:
    nbytes: int  # rounded up to BLOCK_BYTES
    made: int  # event index of the allocation
    where: str  # stage/phase it was made in
    op: str
    freed: int | None = None  # event index of the free; None: alive at the end
    role: str | None = None  # None until known: then "temporary"


@dataclass(frozen=True)
class Peak:
    nbytes: int = 0
    event: int = -1
    where: str = ""
    op: str = ""


@dataclass(frozen=True)
class Workspaces:
    """cuBLAS workspaces: PyTorch gives each (thread, stream) that runs a GEMM a cuBLAS handle with a
    workspace taken from the caching allocator and kept for the process's life (its size: 32 MiB on
    compute capability 9.0 and newer, 4096 KiB x 2 + 16 KiB x 8 before, unless CUBLAS_WORKSPACE_CONFIG
    says otherwise). A training step runs GEMMs on two threads: forward on the Python thread, backward
    on autograd's device thread, so the second workspace appears with the first GEMM of backward."""

    bytes_per_thread: int = 0  # 0: none (a real CPU run)

    def thread_of(self, where: str) -> str:
        return "backward" if where.endswith("/backward") else "forward"


class MemoryCounter(TorchDispatchMode):
    def __init__(self, workspaces: Workspaces = Workspaces()):
        super().__init__()
        self.records: list[Record] = []
        self._record_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> index in records
        self._threads_with_workspace: set[str] = set()
        self.workspaces = workspaces
        self.live_bytes = 0
        self.events = 0
        self.where = "build"
        self.peak = Peak()
        self.steady_peak = Peak()  # the measured stage's
        self.phase_peaks: dict[str, int] = {}  # stage/phase -> the most bytes alive in it
        self._forward_start = 0  # first record of the current forward pass
        self.on_optimizer: Callable[[], Iterable[Any]] = tuple  # the trainable parameters, asked when a step begins
        self.after_step: Callable[[], Iterable[Any]] = tuple  # the optimizer's state tensors, asked after a step

    # --- allocations ---

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        op = func.overloadpacket.__name__
        if self.workspaces.bytes_per_thread and op in CUBLAS_OPS:
            self._workspace_for(self.workspaces.thread_of(self.where))
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf, op)
        return out

    def track(self, tensor: torch.Tensor, op: str, role: str | None = None) -> None:
        """Counts the tensor's storage once (a view or an in-place result is not a new allocation)."""
        storage = tensor.untyped_storage()
        index = self._record_of.get(storage)
        if index is None:
            index = self._allocate(storage.nbytes(), op)
            self._record_of[storage] = index
            weakref.finalize(storage, self._free, index)
        if role is not None:
            self.records[index].role = role

    def _allocate(self, nbytes: int, op: str) -> int:
        rounded = -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES
        self.records.append(Record(rounded, self.events, self.where, op))
        self.live_bytes += rounded
        if self.live_bytes > self.peak.nbytes:
            self.peak = Peak(self.live_bytes, self.events, self.where, op)
        self.phase_peaks[self.where] = max(self.live_bytes, self.phase_peaks.get(self.where, 0))
        if self.where.startswith("measure/") and self.live_bytes > self.steady_peak.nbytes:
            self.steady_peak = Peak(self.live_bytes, self.events, self.where, op)
        self.events += 1
        return len(self.records) - 1

    def _free(self, index: int) -> None:
        record = self.records[index]
        record.freed = self.events
        self.live_bytes -= record.nbytes
        self.events += 1

    def _workspace_for(self, thread: str) -> None:
        if thread not in self._threads_with_workspace:
            self._threads_with_workspace.add(thread)
            index = self._allocate(self.workspaces.bytes_per_thread, f"cublas workspace ({thread} thread)")
            self.records[index].role = "workspace"

    # --- phases: the trainer calls enter() as each begins; roles become known at the boundaries ---

    def enter(self, where: str) -> None:
        before, self.where = self.where, where
        if where.endswith("/forward"):
            if before.endswith("/optimizer"):
                self._mark(self.after_step(), "optimizer_state")
            self._forward_start = len(self.records)
        elif where.endswith("/backward") and before.endswith("/forward"):
            for record in self.records[self._forward_start:]:
                if record.freed is None and record.role is None:
                    record.role = "activation"
        elif where.endswith("/optimizer"):
            self._mark((p.grad for p in self.on_optimizer() if p.grad is not None), "gradient")

    def finish(self) -> None:
        """After the last step: the optimizer's state of that step is known too."""
        if self.where.endswith("/optimizer"):
            self._mark(self.after_step(), "optimizer_state")
        self.where = "done"

    def _mark(self, tensors: Iterable[Any], role: str) -> None:
        for tensor in tensors:
            index = self._record_of.get(tensor.untyped_storage())
            if index is not None and self.records[index].role is None:
                self.records[index].role = role

    # --- what the trace says ---

    def alive_at(self, event: int) -> list[Record]:
        return [r for r in self.records if r.made <= event and (r.freed is None or r.freed > event)]

    def breakdown(self, peak: Peak) -> dict[str, int]:
        """Bytes per role of what was alive at this peak."""
        totals = dict.fromkeys(ROLES, 0)
        for record in self.alive_at(peak.event):
            totals[record.role or "temporary"] += record.nbytes
        return totals
