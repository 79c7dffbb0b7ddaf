"""DeepSpeed ZeRO-2/3 (+ offload) cells, predicted as a hybrid (`prediction_method` hybrid/18: METHOD below).

The DeepSpeed engine cannot run on fake tensors (its flat buffers and partitioning read real storage),
so a ZeRO cell's memory is assembled from two sources:

- **model states** (16-bit weights, fp32 master weights, gradients, Adam's moments) per GPU, phase by
  phase, as DeepSpeed's engine allocates them (`phased`): through forward and backward, and at the
  optimizer step, which adds the fp32 gradient partition and AdamW's temporary beside every state.
  Only the trained parameters have the fp32 and gradient states (`Layout`): a LoRA's frozen base is its
  16-bit weights, a QLoRA's its 4-bit weights and statistics as the load left them. With the optimizer
  offloaded, the tensors DeepSpeed makes on the GPU and on the host (`zero2_offload`, `zero3_offload`;
  on a CPU, whose host is the device, checked with both together at their peak); with ZeRO-3's
  parameters alone offloaded, its 16-bit partition moves to the host. Host RAM adds one worker process
  per rank. DeepSpeed's estimator's GPU figure (`estimate_zero3_model_states_mem_needs`) stays
  in `model_states_gib`;
- **activations, temporaries, the batch and workspaces**: the fake run of the same cell with the
  engine techniques taken out (zero2/zero3/offload), moment by moment through forward and backward:
  DeepSpeed trains the bf16 model the same way, so what forward and backward allocate besides the
  model states is the same. In the step, only what it keeps between steps;
- plus what the engine makes in forward and backward (`ZeroBackward`), placed in the fake run's trace
  where its gradient hooks fire (`MemoryCounter.watch_gradients`): the **gradient reduction bucket**
  (`reduce_bucket_size` 16-bit elements, the stack's `bucket`; ZeRO-3's from initialize on, ZeRO-2's
  from backward's first gradient), each gradient until its hook, the reductions' temporaries, ZeRO-2's
  16-bit gradient partition, and ZeRO-3's gathered weights: on several ranks, those whose next use
  lies within its reuse distance, topped up to max_live by its prefetch, are held into backward and
  released there, the others gathered again for their module's backward (`beyond_reuse`,
  `prefetched`; the input embedding's kept to backward's end: `Layout.held_to_backward_end`; a tied one
  released after lm_head's backward: `released_in_backward`); and its
  persistent weights (small ones: `persistent_positions`), kept gathered but for the optimizer step.

Peak allocated is the more of training (`training_peak`) and the step (`hybrid_columns`). Peak reserved:
the same allocations as one trace, the fake run's own and the engine's in DeepSpeed's order
(bench/predict/hybrid_trace.py), replayed through the caching allocator's model. And the build (`Build`):
where it holds more, the peak is the build's (ZeRO-3 builds on meta and partitions one parameter at a
time, so it never does). All of it is an estimate until ZeRO cells are measured on a GPU: PREDICTION.md
reports its error as soon as they are.

Checked against DeepSpeed's real engine on a CPU (`tools/hybrid_check.py`: one or two gloo ranks, three
steps under the same counter, no GPU workspaces on either side; DeepSpeed 0.19.8, torch 2.13.0+cpu),
peak allocated (offload stacks: the GPU's and host's tensors together), hybrid/5 (hybrid/6 the same):

- a 62M-parameter Llama (hidden 1024, 4 layers) at seq 1024, batch 4, where every peak is in backward,
  on one and two ranks: `zero2`, `offload + zero2`, `zero3`, `zero3 + offload`, `zero3 +
  offload(params=true)`, `gc + zero3 + offload(params=true)` and `zero3(bucket=5000000) +
  offload(params=true)`: all within 0.05% (one rank 2.505, 2.882, 2.933, 3.164, 3.164, 2.522, 2.242 GiB);
- the same model at seq 256, batch 2: one rank, all exact too; two ranks, ZeRO-2 exact, ZeRO-3 -0.9% to
  -4.7% where DeepSpeed peaks in forward (below; -5.4% for `zero3(bucket=5000000)`, the smallest peak);
- Qwen2.5-0.5B, seq 256, batch 2, one rank: `zero2` 10.122 GiB, `zero3` 11.974, `zero3 +
  offload(params=true)` 12.068, each within 24 KB (hybrid/2 was +15.2% and -6.0% on the first two);
- ZeRO-3's step in optimizer sub-groups (`tools/hybrid_check.py --sub-group 20000000`: the 62M Llama
  stepped in four, as a rank of more than 1e9 parameters is), `zero3(bucket=5000000)` at seq 256, batch 2,
  one rank, peaking in the step: exact, with sub-groups of 2e7 and 4e7 (the whole partition at once was
  +11% with the default bucket);
- LoRA and DoRA under ZeRO (`Layout`: DeepSpeed is given the trained parameters only, so the adapters
  alone have fp32 master weights, moments, gradient partitions and hooks; the frozen base is 16-bit
  weights, whole under ZeRO-2, partitioned and gathered under ZeRO-3; deepspeed.initialize casts the
  adapters to bf16): the 62M Llama, one rank, seq 256, batch 2, `lora + zero2` 1.143 GiB and `lora +
  zero3` 1.189, equal; seq 1024, batch 4, `lora + zero2`, `lora + zero3`, `gc + lora + zero3`,
  `lora(r=64) + zero3`, `dora + zero2`, `gc + lora + zero2` equal, reserved too; two ranks at seq 256,
  `lora + zero2`, `gc + lora + zero2`, `dora + zero2` equal, and at seq 1024, batch 4 `lora + zero3` and
  `gc + lora + zero3` too (2.094, 1.545 GiB; `lora + zero3` was +0.9% while the embedding and the first
  layer's frozen projections, which backward never runs without gc, were counted gathered through
  backward: `Layout.without_backward`); Qwen2.5-0.5B (tied embeddings, frozen) one rank `lora + zero2`
  2.593, `lora + zero3` 3.472, equal (reserved +0.3% and 0.0%). ZeRO-3 on two ranks at seq 256 peaks in
  forward: `lora + zero3` -3.5%, `gc + lora + zero3` -4.6% (the all-gather buffers, below, weigh more
  beside LoRA's smaller states). With offload (the host's tensors and the GPU's together, seq 1024,
  batch 4): `lora + offload + zero2`, `lora + zero3 + offload`, `lora + zero3 + offload(params=true)`,
  `lora + zero3 + offload(optimizer=false, params=true)` on one rank (1.718, 2.065, 2.065, 2.061 GiB),
  `lora + offload + zero2`, `gc + lora + zero3 + offload(params=true)` and `lora + zero3 +
  offload(optimizer=false, params=true)` on two, within 0.05%. DoRA under ZeRO-3 (or FSDP2) is refused:
  its magnitudes are initialised from weights a deferred build does not have yet;
- peak reserved (hybrid/6), DeepSpeed's own allocations in their order replayed through the allocator's
  model against the hybrid's trace replayed alike (bench/predict/hybrid_trace.py), one stream as on a
  CPU: the 62M Llama at seq 1024, batch 4, `zero2`, `zero3`, `gc + zero2`, `gc + zero3`,
  `zero2(bucket=5000000)`, `zero3(bucket=5000000)`: one rank equal (3.420, 3.531, 2.947, 2.949, 2.254,
  2.615 GiB), two ranks equal but `zero3` -0.4%; with `--zero3-live 5000000`, -0.4% and 0.0%; at seq 256,
  batch 2 on two ranks `zero2`, `zero3`, `gc + zero3` equal, although the last two miss peak allocated
  by -2.4% and -1.0% (the all-gather buffers, below). Qwen2.5-0.5B (tied embeddings), seq 256, batch 2,
  one rank: `zero2` equal (12.410), `zero3` +0.1% (16.877 against 16.857).

What each version fixed: hybrid/2 added the estimator's states at their most to the activations' peak;
but the fp32 gradients exist only in the step, when the activations are gone, and the step makes what
the estimator leaves out (fp32 gradient partition and AdamW's temporary beside every state: ZeRO-3's
24 B/param on one rank). hybrid/3 counted ZeRO-2's bucket and gradient partition beside the activations'
peak; but the bucket comes at backward's first gradient, after the loss's backward, and the partition
at the first reduction (hybrid/4 placed them, +7.3% to +0.0%). hybrid/5 does the same for ZeRO-3 and
counts its offload's tensors: the estimator's x 1.5 put the host of Llama-3.2-3B's `zero3 +
offload(params=true)` at 82.3 GiB, the tensors at 70.2; it releases the gathered weights in backward
(without it two ranks were +3%); and ZeRO-3's step takes one optimizer sub-group (1e9 elements) at a
time, so its fp32 gradients and AdamW's temporary are the largest sub-group's, not the partition's
(Llama-3.2-3B on one GPU: 8 GB in the step, not 26). hybrid/6 replays its own trace for peak reserved:
hybrid/5 added its fake run's caching to peak allocated, 12% to 27% under DeepSpeed's trace replayed on
one rank (ZeRO-2's first step makes Adam's moments inside the block of the bucket it freed, so the next
bucket needs a segment of its own; the build's weights leave their segments cached). hybrid/7 counts
ZeRO-3's persistent weights on several ranks (DeepSpeed keeps every parameter of at most 1e5 elements
gathered on every rank): tiny-llama's are all persistent, and two ranks of `zero3` with its limits
scaled down went from -1.6% (330 KB) to -0.02%; on Llama-3.2-3B they are its norms (350 KB a rank).
hybrid/8 kept gathered into backward only the weights DeepSpeed's reuse distance keeps (`beyond_reuse`)
and gathered the others again at their gradient's hook. That is what DeepSpeed does when its prefetch
is idle, where those weights already number `stage3_max_live_parameters` or more: with both limits set to
N on two ranks (`tools/hybrid_check.py --zero3-live N`), a 7M Llama (hidden 256, 4 layers, vocab 8192)
at seq 1024, batch 4, N = 600,000 keeps its lm_head (4.2 MB) where hybrid/6 counted 2N: `zero3` -0.69%
(-4.6 MB) under hybrid/6, -0.45% under hybrid/7, 4 KB under since (reserved equal), `gc + zero3` too.
But at DeepSpeed's defaults a large model's prefetch tops what is gathered up to max_live at forward's
end (`prefetched`): a 14M Llama (hidden 256, 16 layers, vocab 4096, untied) on two ranks with every
limit scaled to Llama-3.1-8B's (live and reuse 1.73M, prefetch 86,600, persistence 300) held 1.79M
elements at its peak, where hybrid/8 counted lm_head's 1.05M (-0.63%, `gc + zero3` -1.25%). hybrid/9
holds both: the reuse distance's weights, topped up to max_live from the model's end, so at defaults
about hybrid/6's 2 GB (Llama-3.1-8B: 1.02e9 elements held into backward). The 14M Llama: `zero3` 4 KB
under DeepSpeed (reserved -0.16%), `gc + zero3` -1.25% (-2.1 MB). hybrid/10 lets the prefetch go on
through backward (`ZeroBackward.pass_module`): as each module is done, backward's next weights are
gathered while fewer than max_live are, so a peak in mid-backward (gc's) meets about max_live gathered,
not the few weights hybrid/9 still held there. The 14M Llama: `zero3` 4 KB under, reserved equal;
`gc + zero3` still -1.25% (2.1 MB, about one 1M-element embedding), reserved equal. It was the
embedding: DeepSpeed releases a module's weights when its inputs' gradients are made, and the input
embedding, fed token ids, has none, so its weight, gathered for its backward, stays gathered until
`release_backward_leftovers`, after backward's last reduction, which is gc's peak there. hybrid/11 holds
it so (`Layout.held_to_backward_end`, from the fake run's `fed_without_gradient`): `gc + zero3` -4,608 B,
reserved equal; `zero3` as before (its peak is earlier in backward). On Llama-3.1-8B (untied) that weight
is 1.05 GB, gathered on every rank through the last reduction. A tied embedding is lm_head's weight too:
hybrid/11 held it gathered from forward through backward, but DeepSpeed releases it after lm_head's
backward, its next use (the embedding's backward) being beyond the reuse distance, and its prefetch
gathers it again near backward's end (`released_in_backward`, hybrid/12; on Llama-3.2-3B, 788 MB not
gathered through most of backward). The same 14M Llama tied, limits scaled to Llama-3.2-3B's (live and
reuse 4M, prefetch 200,000, persistence 300), two ranks: peak allocated 4 KB under DeepSpeed's for
`zero3` and `gc + zero3` under both versions (their peaks fall where it is gathered anyway); reserved
-4 MiB under hybrid/11, -2 MiB under hybrid/12 (-0.16%).

What hybrid/12 still misses: the prefetch gathers its weights into one flat all-gather buffer, then
copies each weight out of it; the buffer lives until the last of its weights is fetched by its module.
Where DeepSpeed peaks in forward on several ranks, those buffers are the miss (the 62M Llama on two
ranks at seq 256: -2.4%; at its peak, in layer 3's MLP, one 101 MB buffer is alive beside the weights
copied out of it, and a 22.5 MB one not waited for yet). With the limits scaled to a large model's
(the 14M Llama at 8B's, its tied variant at 3B's; `zero3` and `gc + zero3`, two ranks) no such
buffer is alive at DeepSpeed's peak (`tools/hybrid_check.py --gathers`; the 8B-scaled test asserts
it). gc's recomputation gathers a layer's weights before its gradients' hooks; the hybrid gathers one
its prefetch has not only at its hook (no check has shown a miss from it: after the first step the
prefetch is ahead).
"""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .. import measure, trainer
from ..cells import Cell
from ..stacks import Stack, Use
from . import allocator, bnb, save
from .counter import GradientReady, MemoryCounter, Peak, Record, rounded
from .gpus import GpuKind
from .pinned import block_bytes

METHOD = "hybrid/18"  # bump when what it counts changes (2: flash attention backward's scratch in its fake run;
# 3: the model states phase by phase, checked against DeepSpeed's engine on a CPU; 4: ZeRO-2's bucket,
# gradients and partition moment by moment through backward, as its gradient hooks make them; 5: ZeRO-3's
# gradients and reductions too, and its offload's tensors on the GPU and host instead of the estimator's;
# 6: peak reserved from the replay of its own trace, not the fake run's caching added to peak allocated;
# 7: ZeRO-3's persistent weights on several ranks; 8: ZeRO-3's weights kept into backward by its reuse distance;
# 9: and topped up to max_live by its prefetch; 10: its prefetch through backward too; 11: the input
# embedding's weight kept gathered to backward's end; 12: a tied weight released after lm_head's backward;
# 13: an offloaded ZeRO-3 build's gather holds the partition's copy beside the whole, which moves only the
# build's peak: Llama-3.2-3B's 0.73 -> 1.47 GiB, against 22.9 GiB in training at seq 2048 batch 2; 14: with
# the parameters offloaded, each one's pinned partition left in torch's pinned cache (`cached_partitions`),
# which moves only the host figures of those stacks; 15: its fake run's fake-run/8 and /9: cuDNN's attention
# workspace, the column sums' buffer, and gradient sums in place unless their operand is a view; 16: an in-place
# sum keeps its operand's block in the hybrid's trace too (allocator.record_events), as in fake-run/9's: over
# llama3b's 60 ZeRO cells (H100, torch 2.11) no peak moved, one least card by 6 MiB; 17: its fake run's
# fake-run/10, the embedding backward's partial-sum buffer; 18: ZeRO-3's gathers at each step's own forward
# where steps share a stage (dynamic padding runs every step), not all at the first's: no published cell moves)
ENGINE_TECHNIQUES = ("zero2", "zero3", "offload")
# Host RSS of one worker process besides what it offloads: the median over the 56 ok cells of the
# published llama3b-h100-20261122 run (1.45 to 1.59 GiB; torch 2.11, CUDA 13).
WORKER_PROCESS_GIB = 1.53


@dataclass(frozen=True)
class Layout:
    """The model's parameters as a ZeRO engine meets them, in the model's order (`model.parameters()`):
    each one's elements, and which are trained. The engine is given the trained ones only (the trainer
    hands deepspeed.initialize those): its flat 16-bit buffers, fp32 master weights, moments, gradient
    partitions and gradient hooks cover them alone. A frozen one (a LoRA base) stays a 16-bit weight:
    whole on every rank under ZeRO-2, partitioned and gathered like the others under ZeRO-3. A gradient
    hook's index (`GradientReady.index`) is its parameter's rank among the trained. A frozen one whose
    modules backward never runs (`without_backward`: nothing before them trains, so their outputs need no
    gradient; seen in the fake run, `MemoryCounter.needs_backward`) is released by ZeRO-3 after its
    forward, once it has the trace of a step: it is not gathered through the rest of the step. So is
    one whose next use lies further than `stage3_max_reuse_distance` (`beyond_reuse`); backward gathers
    it again for its module. ZeRO-3's persistent parameters (`persistent_positions`) are gathered once
    and kept: they are not among the weights held for backward and released. A tied one is released
    after its first module's backward if its next use is beyond the reuse distance
    (`released_in_backward`), and gathered again for it. One whose module has no input that needs a
    gradient (`held_to_backward_end`: the input embedding's, fed token ids) is gathered for its backward
    and kept until backward has ended: DeepSpeed releases a module's weights when its inputs' gradients
    are made, and releases the others after backward's last reduction (`release_backward_leftovers`)."""

    numels: tuple[int, ...]
    trained: tuple[int, ...]  # the trained parameters' positions in `numels`, in order
    ranks: int = 1
    without_backward: frozenset[int] = frozenset()  # frozen parameters' positions whose modules backward never runs
    persistent: frozenset[int] = frozenset()  # ZeRO-3's persistent parameters' positions (`persistent_positions`)
    beyond_reuse: frozenset[int] = frozenset()  # released after forward, their next use too far (`beyond_reuse`)
    held_to_backward_end: frozenset[int] = frozenset()  # gathered for backward, kept to its end (no input gradient)
    released_in_backward: frozenset[int] = frozenset()  # tied ones released after their first module's backward
    # QLoRA's frozen 4-bit weights as a load leaves them: (position, packed elements, bytes of the packed
    # weight and its quantization state; bench/predict/bnb.py), where any other weight holds 2 B an element
    quantized: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def of(cls, model: Any, ranks: int, needs_backward: dict[int, bool] | None = None,
           fed_without_gradient: set[int] | None = None) -> Layout:
        """`needs_backward`, `fed_without_gradient`: from the fake run of the cell (`MemoryCounter`);
        without them, every parameter is taken to be gathered for backward and released at its hook.
        `model` built on meta (a 4-bit weight not quantized yet: its loaded sizes are a fake
        quantization's)."""
        params = list(model.parameters())
        trained = tuple(i for i, p in enumerate(params) if p.requires_grad)
        unused = frozenset(i for i, needed in (needs_backward or {}).items() if not needed and i not in trained)
        quantized = tuple((i, *bnb.loaded_sizes(p)) for i, p in enumerate(params) if bnb.is_4bit(p))
        numels = tuple(p.numel() for p in params)
        persistent = persistent_positions(numels)
        modules, distance = module_params(model), max_reuse_distance()
        far = beyond_reuse(numels, modules, unused | persistent, distance) - unused - persistent
        kept = frozenset(range(len(numels))) - far - unused - persistent
        far -= prefetched(numels, kept, far, max_live_parameters())
        to_end = frozenset(fed_without_gradient or ()) - unused - persistent
        tied = released_in_backward(numels, modules, unused | persistent, distance) - unused - persistent
        return cls(numels, trained, ranks, unused, persistent, far, to_end, tied, quantized)

    @classmethod
    def all_trained(cls, numels: list[int], ranks: int = 1) -> Layout:
        return cls(tuple(numels), tuple(range(len(numels))), ranks)

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def trained_numels(self) -> list[int]:
        return [self.numels[i] for i in self.trained]

    @property
    def frozen_numels(self) -> list[int]:
        trained = set(self.trained)
        return [n for i, n in enumerate(self.numels) if i not in trained]

    @property
    def weight_bytes(self) -> int:
        """The weights' bytes whole, as ZeRO-2 keeps them on every GPU: 16-bit, or a 4-bit weight's loaded bytes."""
        loaded = sum(nbytes for _, _, nbytes in self.quantized)
        return 2 * (self.total - sum(self.numels[i] for i, _, _ in self.quantized)) + loaded

    @property
    def loaded_total(self) -> int:
        """The parameters' elements as a loaded model counts them (a 4-bit weight: its packed elements)."""
        return self.total - sum(self.numels[i] - elements for i, elements, _ in self.quantized)

    @property
    def held_for_backward(self) -> int:
        """The elements of the weights ZeRO-3 keeps gathered from forward into backward, at most, and
        releases in backward (not the persistent ones)."""
        return self.total - sum(self.numels[i] for i in self._not_held)

    @property
    def _not_held(self) -> frozenset[int]:
        return self.without_backward | self.persistent | self.beyond_reuse

    @property
    def persistent_bytes(self) -> int:
        """ZeRO-3's persistent parameters gathered whole, 16-bit, each in its own buffer (padded to a
        multiple of the ranks)."""
        return sum(rounded(2 * per_rank(self.numels[i], self.ranks) * self.ranks) for i in self.persistent)

    @functools.cached_property
    def partitions_of(self) -> tuple[tuple[int, ...], ...]:
        """For each trained parameter, the ranks whose ZeRO-2 partition its gradient falls in."""
        return flat_partitions(self.trained_numels, self.ranks)

    def passing_at(self, index: int) -> list[int]:
        """The positions whose modules' backward ZeRO-3 runs where the `index`-th trained parameter's
        gradient is made, gathered, and releases after: its own, and the frozen ones after it up to the
        next trained one (not persistent ones)."""
        end = self.trained[index + 1] if index + 1 < len(self.trained) else len(self.numels)
        return [i for i in range(self.trained[index], end) if i not in self.without_backward | self.persistent]

    @property
    def held_positions(self) -> frozenset[int]:
        """The weights ZeRO-3 holds from forward into backward (`held_for_backward`)."""
        return frozenset(range(len(self.numels))) - self._not_held


def module_params(model: Any) -> list[tuple[int, ...]]:
    """Each module's own parameters (their positions in `model.parameters()`), modules in the order they
    were registered, which is the order a decoder runs them in forward (a norm or two aside); a tied
    weight appears in each module that holds it."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    out = [tuple(position[id(p)] for p in m.parameters(recurse=False)) for m in model.modules()]
    return [positions for positions in out if positions]


def beyond_reuse(numels: tuple[int, ...], modules: list[tuple[int, ...]], no_backward: frozenset[int],
                 distance: int) -> frozenset[int]:
    """The positions ZeRO-3 releases after their last forward use, on several ranks, once it has the trace
    of a step (DeepSpeed's `__params_to_release`): after a module's forward it looks at the modules that
    follow in the trace (forward's rest, then backward's, in reverse; modules whose parameters are all in
    `no_backward` have no backward), adding up their parameters' elements until they reach `distance`
    (`stage3_max_reuse_distance`, 1e9 by default); a weight of the module not among them is released.
    Llama-3.1-8B keeps only lm_head (525M elements) gathered into backward; Llama-3.2-3B its tied
    embedding and most of its last layer. Modules stand in for the trace at their registration order,
    and gc's recomputation in backward is not among them."""
    backward = _backward_order(modules, no_backward)
    trace = [*modules, *backward]
    kept: set[int] = set()
    for k, module in enumerate(modules):
        kept.update(set(module) & _met_within(numels, trace[k + 1:], distance))
    return frozenset(range(len(numels))) - kept


def released_in_backward(numels: tuple[int, ...], modules: list[tuple[int, ...]], no_backward: frozenset[int],
                         distance: int) -> frozenset[int]:
    """The tied weights ZeRO-3 releases after their first module's backward (a tied embedding, after
    lm_head's), on several ranks: their next use (the input embedding's backward) lies beyond the reuse
    distance, by the same walk as `beyond_reuse` through backward's trace; backward gathers them again
    for it. (An untied weight has no later use in the step: released after its module's backward, which
    the hybrid places at its gradient's hook.) A 14M Llama of 16 layers with tied embeddings, on two
    ranks, limits scaled to Llama-3.2-3B's: DeepSpeed held its embedding through lm_head's backward,
    released it, and its prefetch gathered it again five layers before the end."""
    backward = _backward_order(modules, no_backward)
    out: set[int] = set()
    for k, module in enumerate(backward):
        later = backward[k + 1:]
        tied = {i for i in module if any(i in other for other in later)} - out
        out |= tied - _met_within(numels, later, distance)
    return frozenset(out)


def _backward_order(modules: list[tuple[int, ...]], no_backward: frozenset[int]) -> list[tuple[int, ...]]:
    """The modules as backward runs them: in reverse, without those it does not run."""
    return [m for m in reversed(modules) if not set(m) <= no_backward]


def _met_within(numels: tuple[int, ...], trace: list[tuple[int, ...]], distance: int) -> set[int]:
    """The positions DeepSpeed's walk meets in `trace`: module by module, until the elements it has
    passed reach `distance` (a module's weights counted once met)."""
    met: set[int] = set()
    traversed = 0
    for module in trace:
        if traversed >= distance:
            break
        met.update(module)
        traversed += sum(numels[i] for i in module)
    return met


def prefetched(numels: tuple[int, ...], kept: frozenset[int], released: frozenset[int], max_live: int) -> frozenset[int]:
    """Of the weights the reuse distance releases after forward (`released`), those ZeRO-3's prefetch
    holds into backward all the same: at each module it gathers the weights of the modules ahead,
    `stage3_prefetch_bucket_size` elements (5e7) at a time, while fewer than `stage3_max_live_parameters`
    (1e9) are gathered (`kept` ones, held by the reuse distance, among them; persistent ones not), and
    at forward's end those ahead are backward's first. So what is held into backward is topped up to
    max_live from the model's end, whole weights (a 14M Llama of 16 layers on two ranks, every limit
    scaled to 8B's, held 1.79M elements at its peak: lm_head and its last layer, to 1.73M). Through
    backward the same rule tops up what is gathered as each module is done (`ZeroBackward.pass_module`:
    `kept` the weights gathered then, `released` the ones ahead)."""
    held = sum(numels[i] for i in kept)
    out = []
    for position in sorted(released, reverse=True):
        if held >= max_live:
            break
        out.append(position)
        held += numels[position]
    return frozenset(out)


def persistent_positions(numels: tuple[int, ...]) -> frozenset[int]:
    """ZeRO-3's persistent parameters (DeepSpeed's `mark_persistent_parameters`): each of at most
    `stage3_param_persistence_threshold` elements (1e5 by default; the suite sets none), in the model's
    order while their sum stays within `stage3_model_persistence_threshold` (no limit by default). On
    several ranks ZeRO-3 gathers them once and keeps them whole on every rank: it releases them only for
    the optimizer step (`_partition_all_parameters`) and gathers them again after it (`_post_step`).
    Norms and biases; every projection of a small model; a LoRA adapter of rank 16 beside a 3072-wide
    projection (49,152 elements). Two ranks of tiny-llama (223,552 parameters, all persistent) hold
    449,024 B of them, which the hybrid missed before (-1.6%)."""
    param_threshold, model_threshold = persistence_thresholds()
    out, total = [], 0
    for position, elements in enumerate(numels):
        if elements + total > model_threshold:
            continue
        if elements <= param_threshold:
            out.append(position)
            total += elements
    return frozenset(out)


def persistence_thresholds() -> tuple[int, int]:
    """DeepSpeed's `stage3_param_persistence_threshold` and `stage3_model_persistence_threshold` (1e5 and
    no limit by default; the suite sets neither)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    config = DeepSpeedZeroConfig()
    return int(config.param_persistence_threshold), int(config.model_persistence_threshold)


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


def per_rank(elements: int, ranks: int) -> int:
    """A rank's share of `elements` split N ways, rounded up (the last rank's is padded)."""
    return -(-elements // ranks)


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


def is_hybrid(cell: Cell) -> bool:
    return any(name in ("zero2", "zero3") for name in cell.stack.names)


ADAPTERS = ("lora", "dora", "qlora")  # a frozen base under the engine (qlora's 4-bit): `Layout` says which train


def unsupported_reason(cell: Cell) -> str | None:
    adapters = set(ADAPTERS).intersection(cell.stack.names)
    if adapters and cell.checkpoint != "none":
        return f"the save of {', '.join(sorted(adapters))} adapters under ZeRO is not modelled"
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return "ZeRO: the hybrid prediction reads DeepSpeed's defaults and estimator, and deepspeed is not installed here"
    return None


def activation_cell(cell: Cell) -> Cell:
    """The cell with its engine taken out: the plain engine runs the same bf16 forward and backward.
    deepspeed.initialize casts every floating-point parameter to bf16, so LoRA's adapters train in bf16
    under it (peft makes them fp32), and QLoRA's `prepare_kbit` upcast of norms, embeddings and lm_head
    to fp32 is undone: the activation cell has bf16 adapters and no upcast."""
    kept = tuple(_in_bf16(u) if u.name in ADAPTERS else u for u in cell.stack.uses if u.name not in ENGINE_TECHNIQUES)
    return replace(cell, stack=Stack(kept), gpus=1)


def _in_bf16(use: Use) -> Use:
    cast = {"adapter_dtype": "bf16", "prepare_kbit": False}
    return replace(use, options=tuple((k, cast.get(k, v)) for k, v in use.options))


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
                       max_live_elements=max_live_parameters() if gathers else 0,
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


def max_live_parameters() -> int:
    """DeepSpeed's `stage3_max_live_parameters` (1e9 by default; the suite sets none): on several ranks,
    up to how many elements ZeRO-3's prefetch keeps gathered (`prefetched`)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return int(DeepSpeedZeroConfig().max_live_parameters)


def max_reuse_distance() -> int:
    """DeepSpeed's `stage3_max_reuse_distance` (1e9 by default; the suite sets none): on several ranks, how
    far ahead ZeRO-3 looks for a weight's next use before it releases it (`beyond_reuse`)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return int(DeepSpeedZeroConfig().max_reuse_distance)


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
    weights and AdamW, as DeepSpeed's engine allocates them (checked on a CPU: the module's text). Per rank
    of N, a partition of P/N parameters holds fp32 master weights and both moments (12 B each); the step
    adds fp32 gradients and AdamW's temporary (8 B each). ZeRO-2 keeps the 16-bit weights whole (2 B/param;
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


def largest_layer_params(model: Any) -> int:
    """Parameters of the largest single module (its own, not its children's): what ZeRO-3 gathers at once."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


MODEL_STATE_ROLES = ("weight", "gradient", "optimizer_state")  # what DeepSpeed's accounting replaces
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


def flat_partitions(numels: list[int], ranks: int) -> tuple[tuple[int, ...], ...]:
    """The ranks whose ZeRO-2 partitions each parameter falls in: DeepSpeed flattens the 16-bit
    parameters in order into one buffer padded to 2N elements, and gives rank r its r-th Nth (its
    per-parameter alignment padding, at most 7 elements each, is left out)."""
    total = sum(numels)
    size = -(-total // (2 * ranks)) * 2
    out, start = [], 0
    for n in numels:
        out.append(tuple(range(start // size, (start + max(n, 1) - 1) // size + 1)))
        start += n
    return tuple(out)


def kept_between_steps(counter: MemoryCounter) -> int:
    """Bytes the fake run still holds after its last step besides the model states (the batch, workspaces)."""
    return sum(r.nbytes for r in counter.alive_at(counter.steps[-1].event) if r.role not in MODEL_STATE_ROLES)


def hybrid_columns(cell: Cell, training: Peak, kept_bytes: int, replayed: dict[str, Any], states: ModelStates,
                   gpu: GpuKind, build: Build | None = None) -> dict[str, Any]:
    """The hybrid figures. Peak allocated, the more of two moments: in forward and backward
    (`training`, from `training_peak`), the model states of training and the engine's bytes there, beside
    everything else the fake run allocated (activations, temporaries, the batches, workspaces); in the
    optimizer step, the step's model states (and ZeRO-3's bucket), plus what the fake run keeps between
    steps (`kept_bytes`: the batch, workspaces). Peak reserved and whether it fits: the replay of the same
    allocations as one trace (`replayed`, bench/predict/hybrid_trace.py). Or the build's, where it holds
    more (`Build`)."""
    step = states.step_bytes + (states.bucket_bytes if states.bucket_in_step else 0) + kept_bytes
    allocated = max(training.nbytes, step) / measure.GIB
    stage = training.where.rsplit("/", 1)[0] if "/" in training.where else "measure"
    out: dict[str, Any] = {
        **replayed,
        "prediction_method": METHOD,
        "peak_phase": training.where if training.nbytes >= step else f"{stage}/optimizer",
        "peak_op": training.op if training.nbytes >= step else None,
        "peak_allocated_gib": allocated,
        "peak_reserved_gib": max(replayed["peak_reserved_gib"], allocated),
        "model_states_gib": states.gpu_bytes / measure.GIB,
        "buckets_gib": states.bucket_bytes / measure.GIB,
    }
    if build is not None and build.allocated_bytes / measure.GIB > allocated:
        out.update(peak_phase="build", peak_op=None, peak_allocated_gib=build.allocated_bytes / measure.GIB,
                   peak_reserved_gib=max(out["peak_reserved_gib"], build.reserved_bytes / measure.GIB))
    if "offload" in cell.stack.names:
        out["host_peak_gib"] = states.host_bytes / measure.GIB + cell.gpus * WORKER_PROCESS_GIB
    if gpu.outside_torch_gib is not None:
        out["device_peak_gib"] = out["peak_reserved_gib"] + gpu.outside_torch_gib
        out["least_card_gib"] = max(replayed.get("least_card_gib", 0.0), out["device_peak_gib"]
                                    if out["peak_phase"] == "build" else 0.0)
        if out["peak_phase"] == "build" and "fits_budgets_json" in replayed:
            out["fits_budgets_json"] = json.dumps({b: ran and float(b) >= out["device_peak_gib"]
                                                   for b, ran in json.loads(replayed["fits_budgets_json"]).items()})
        if gpu.memory_gib is not None:
            out["fits"] = replayed.get("fits") is not False and out["device_peak_gib"] <= gpu.memory_gib
    return out


def predict(cell: Cell, gpu: GpuKind) -> dict[str, Any]:
    """A ZeRO cell's prediction: the activation cell's fake run, then DeepSpeed's accounting."""
    from . import fake

    counter, built, _ = fake.counted_for(activation_cell(cell), gpu)
    return {**assembled(cell, counter, gpu), "flops_per_token": built.flops_per_token}


def assembled(cell: Cell, counter: MemoryCounter, gpu: GpuKind, cpu_check: bool = False) -> dict[str, Any]:
    """The hybrid's columns from the fake run of the cell without its engine (`counter`): DeepSpeed's
    model states, phase by phase, beside the fake run's other bytes (`hybrid_columns`), their allocations
    replayed as one trace, and the save's. `cpu_check`: as DeepSpeed's engine makes them on a CPU
    (tools/hybrid_check.py; `model_states`)."""
    meta, layout, states = _engine_of(cell, counter, cpu_check)
    training = training_peak(counter, states, layout)
    replayed = replayed_columns(cell, counter, states, layout, build_events(meta, cell, cpu_check), gpu)
    out = hybrid_columns(cell, training, kept_between_steps(counter), replayed, states, gpu, Build.of(meta, cell))
    return {**out, **_save(cell, counter, states, list(layout.numels), out), "total_params": layout.loaded_total,
            "trainable_params": sum(layout.trained_numels), "allocations": len(counter.records)}


def _engine_of(cell: Cell, counter: MemoryCounter, cpu_check: bool) -> tuple[Any, Layout, ModelStates]:
    """The model on meta, its parameters' layout on this rank (which train, which are gathered into
    backward: from the fake run), and DeepSpeed's model states for them."""
    meta = trainer.build_model(cell, device="meta").model
    layout = Layout.of(meta, cell.gpus, counter.needs_backward, counter.fed_without_gradient)
    return meta, layout, model_states(cell, layout, largest_layer_params(meta), cpu_check)


def trace_of(cell: Cell, gpu: GpuKind) -> tuple[list[tuple[str, int, int, int]], list[Record]]:
    """The allocations `replayed_columns` replays for a ZeRO cell, the build's, the fake run's and the
    engine's, in order, and the fake run's records (the engine's blocks have ids past them): to set
    beside a GPU's own (tools/cell_trace.py, through fake.trace_of)."""
    from . import fake, hybrid_trace

    counter, _, _ = fake.counted_for(activation_cell(cell), gpu)
    meta, layout, states = _engine_of(cell, counter, cpu_check=False)
    events, _ = hybrid_trace.engine_trace(counter, states, layout, build_events(meta, cell, False))
    return events, counter.records


def replayed_columns(cell: Cell, counter: MemoryCounter, states: ModelStates, layout: Layout,
                     build: list[tuple[str, int, int]], gpu: GpuKind) -> dict[str, Any]:
    """The build's allocations (`build_events`), the fake run's and the engine's, as one trace
    (bench/predict/hybrid_trace.py), replayed through the caching allocator's model: peak reserved,
    fits, the smallest card, the steps'."""
    from . import fake, hybrid_trace

    events, ends = hybrid_trace.engine_trace(counter, states, layout, build)
    steps = [replace(s, live_bytes=live) for s, live in zip(counter.steps, hybrid_trace.live_at(events, ends), strict=True)]
    return fake.replayed_columns(cell, events, ends, steps, gpu)


def _save(cell: Cell, counter: MemoryCounter, states: ModelStates, params: list[int], out: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint save after the last step (bench/predict/save.py): on the GPU, the model states and
    bucket plus what the fake run still holds after its last step besides model states; the cache
    keeps what training reserved; the host holds what training keeps there plus the save's copies."""
    if cell.checkpoint == "none":
        return {}
    bucket = states.bucket_bytes if states.bucket_in_step else 0
    after_step_gib = (states.after_step_bytes + bucket + kept_between_steps(counter)) / measure.GIB
    host_gib = out.get("host_peak_gib", cell.gpus * WORKER_PROCESS_GIB)
    groups = sub_groups([per_rank(n, cell.gpus) for n in params])
    return save.columns(save.zero_host_copy_bytes(cell, params, groups), after_step_gib, out["peak_reserved_gib"], host_gib)
