"""ZeRO-3's parameter schedule, as the hybrid (bench/predict/hybrid.py) models DeepSpeed 0.19.8's: a
model's parameters as the engine meets them (`Layout`: which train, which are persistent, which are
released after forward and gathered again, which are held to backward's end), the walks that decide
it (`beyond_reuse`, `released_in_backward`, `prefetched`, `persistent_positions`), and the limits they
read from DeepSpeed's config defaults (the suite sets none).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from . import bnb
from .counter import rounded


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


def per_rank(elements: int, ranks: int) -> int:
    """A rank's share of `elements` split N ways, rounded up (the last rank's is padded)."""
    return -(-elements // ranks)


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


def largest_layer_params(model: Any) -> int:
    """Parameters of the largest single module (its own, not its children's): what ZeRO-3 gathers at once."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


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
