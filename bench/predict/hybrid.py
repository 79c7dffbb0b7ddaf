"""DeepSpeed ZeRO-2/3 (+ offload) cells, predicted as a hybrid (`prediction_method` hybrid/20: METHOD below).

The DeepSpeed engine cannot run on fake tensors (its flat buffers and partitioning read real storage),
so a ZeRO cell's memory is assembled here from two sources (the parts live beside this module:
zero_states.py the model states and the build, zero_layout.py ZeRO-3's parameter schedule,
zero_backward.py what the engine holds in training, hybrid_trace.py the allocations as one trace):

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

from dataclasses import replace
from typing import Any

from .. import measure, trainer
from ..cells import Cell
from ..stacks import Stack, Use
from . import save
from .counter import MemoryCounter, Peak, Record
from .gpus import GpuKind
from .zero_backward import training_peak
from .zero_layout import Layout, largest_layer_params, per_rank
from .zero_states import MODEL_STATE_ROLES, Build, ModelStates, build_events, model_states, sub_groups

METHOD = "hybrid/20"  # bump when what it counts changes (2: flash attention backward's scratch in its fake run;
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
# where steps share a stage (dynamic padding runs every step), not all at the first's: no published cell moves;
# 19: what initialize makes and frees, which shapes the cache forward then carves: ZeRO-2's fp32 partition
# cloned in 16 bits on the GPU when the optimizer is offloaded too, and ZeRO-3's every trained weight gathered
# whole as its gradient hook is registered (an offloaded one beside its partition's copy). The H200's
# Llama-3.2-3B: offload + zero2 reserved +3.19% -> 0.00%, its segments the GPU's one for one; offload(params=True)
# + zero3 -3.05% -> -3.05%, gc + it -6.23% -> -4.27%: two of the three 752 MiB segments they missed. And a cell
# whose peak is its build gets its smallest card and budgets from the replay, as any other: its trace holds the
# build, whose cached blocks the allocator releases under a cap; it took the device peak with no bound, which holds
# them: Llama-3.1-8B's gc + offload + zero2 at s2048 45.76 GiB (with the clone), where the replay runs in 30.79;
# 20: ZeRO-3's fp32 copy of each optimizer sub-group freed only as the next one's is made (a loop variable), so
# two live at once: the H200's Llama-3.2-3B zero3 reserved +0.01% -> 0.00%, its segments the GPU's one for one)
ENGINE_TECHNIQUES = ("zero2", "zero3", "offload")
# Host RSS of one worker process besides what it offloads: the median over the 56 ok cells of the
# published llama3b-h100-20261122 run (1.45 to 1.59 GiB; torch 2.11, CUDA 13).
WORKER_PROCESS_GIB = 1.53


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
        # the smallest card and each budget's verdict are the replay's (`replayed`): its trace begins with
        # the build, so a cell whose peak is its build is bisected like any other, the allocator releasing
        # what it caches there (ZeRO-2's whole weights, once flattened) before it gives up
        out["device_peak_gib"] = out["peak_reserved_gib"] + gpu.outside_torch_gib
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
