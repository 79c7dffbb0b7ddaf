"""The ZeRO hybrid prediction against DeepSpeed's real engine, on this CPU: peak allocated and reserved.

    python tools/hybrid_check.py qwen2.5-0.5b --seq 256 --batch 2 --stacks zero2,zero3 --ranks 1

For each stack, in processes of their own (DeepSpeed's state is global), one per rank of a gloo group:
DeepSpeed trains the cell three steps on real CPU tensors under the predictor's MemoryCounter (every
allocation, 512 B blocks), the most of any rank taken; and the hybrid (bench/predict/hybrid.py)
assembles the same cell from its model states phase by phase, its bucket and the fake run of the cell
without its engine, with neither side counting a GPU's cuBLAS workspaces or kernel scratch.
The offload stacks (`zero2_offload`, `zero3_offload`): on a CPU the "host" is the device, so the GPU's
and the host's tensors together, the host's unpinned (a CPU does not pin), no copies between host and
device (DeepSpeed's `.to(device)` of a host tensor is itself), at the more of training and the optimizer
step, against DeepSpeed's peak of all its tensors. Both sides reduce-scatter through gloo, which copies
its input (`ModelStates.cpu_check`).
Peak reserved: DeepSpeed's own allocations, as the counter saw them in order, replayed through the model
of CUDA's caching allocator (bench/predict/allocator.py), against the hybrid's trace of the same cell
replayed alike (bench/predict/hybrid_trace.py); every stream the default one, as on a CPU. Not for the
offload stacks (the hybrid's trace is the GPU's alone).
A model is a registry name or a config.json.

`--zero3-live N` sets DeepSpeed's `stage3_max_live_parameters` and `stage3_max_reuse_distance` (1e9 by
default) to N on both sides: what ZeRO-3 keeps gathered on several ranks, checked on a small model as a
large one meets those limits (Llama-3.1-8B has 8 times their 1e9 parameters). `--sub-group N` sets
ZeRO-3's optimizer `sub_group_size` (1e9 by default) to N on both sides: a small model stepped in
sub-groups, as a rank with more than 1e9 parameters is. `--zero3-persist N` sets ZeRO-3's
`stage3_param_persistence_threshold` (1e5 by default) to N on both sides: fewer persistent parameters,
so that a tiny model's weights are gathered and released as a large model's are. `--zero3-prefetch N`
sets DeepSpeed's `stage3_prefetch_bucket_size` (5e7 by default) to N: the hybrid prefetches whole weights
and has no such setting, so this is DeepSpeed's side alone (with every limit scaled to a large model's).
`--gathers` says, for ZeRO-3, what DeepSpeed holds gathered at its peak in the last step (rank 0): the
weights whole (their elements), and the flat all-gather buffers of its prefetch still in flight (each
one's bytes, and whether the weights were copied out of it yet): what the hybrid is checked against.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a registry name (bench/model_configs) or a config.json")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--stacks", default="zero2,zero3", help="comma list of ZeRO stacks (default zero2,zero3)")
    parser.add_argument("--ranks", type=int, default=1, help="gloo ranks, one process each (default 1)")
    parser.add_argument("--json", action="store_true", help="one JSON line per stack instead of the table")
    parser.add_argument("--zero3-live", type=int, help="ZeRO-3's max live parameters and max reuse distance (default 1e9)")
    parser.add_argument("--sub-group", type=int, help="ZeRO-3's optimizer sub-group size, elements (default 1e9)")
    parser.add_argument("--zero3-persist", type=int, help="ZeRO-3's param persistence threshold, elements (default 1e5)")
    parser.add_argument("--zero3-prefetch", type=int, help="DeepSpeed's ZeRO-3 prefetch bucket, elements (default 5e7)")
    parser.add_argument("--gathers", action="store_true", help="ZeRO-3: what DeepSpeed holds gathered at its peak")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: one stack, one JSON line out
    args = parser.parse_args()
    if args.one:
        if args.sub_group:
            _limit_sub_groups(args.sub_group)
        if args.zero3_persist is not None:
            _limit_persistence(args.zero3_persist)
        if args.zero3_prefetch:
            _zero_options(stage3_prefetch_bucket_size=args.zero3_prefetch)
        print(json.dumps(_compare(args.model, args.seq, args.batch, args.one, args.ranks, args.zero3_live, args.gathers)))
        return
    if not args.json:
        print(f"{args.model}, seq {args.seq}, batch {args.batch}, {args.ranks} rank(s) on this CPU; peak allocated, GiB")
        print("| stack | DeepSpeed | hybrid | error | DeepSpeed less its bucket | hybrid less its bucket | error "
              "| peak: DeepSpeed's, the hybrid's | reserved: DeepSpeed's trace | the hybrid's | error |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for stack in stack_list(args.stacks):
        rows = _ranks(args, stack)
        top = max(rows, key=lambda r: r["real_bytes"])
        real, hybrid, bucket = top["real_bytes"], rows[0]["hybrid_bytes"], rows[0]["bucket_bytes"]
        # reserved: the most of any rank's real trace replayed, against the hybrid's trace replayed
        # (none for the offload stacks: a CPU's host is its device, and the hybrid's trace is the GPU's)
        real_reserved = max((r.get("real_reserved_bytes") or 0 for r in rows), default=0) or None
        hybrid_reserved = rows[0].get("hybrid_reserved_bytes")
        if args.json:
            print(json.dumps({"stack": stack, "ranks": args.ranks, "real_bytes": real, "hybrid_bytes": hybrid,
                              "bucket_bytes": bucket, "real_reserved_bytes": real_reserved,
                              "hybrid_reserved_bytes": hybrid_reserved, "gathers": rows[0].get("gathers")}))
            continue
        reserved = (f"{real_reserved / GIB:.3f} | {hybrid_reserved / GIB:.3f} | {hybrid_reserved / real_reserved - 1:+.1%}"
                    if real_reserved and hybrid_reserved else "n/a | n/a | n/a")
        print(f"| `{stack}` | {real / GIB:.3f} | {hybrid / GIB:.3f} | {hybrid / real - 1:+.1%} | "
              f"{(real - bucket) / GIB:.3f} | {(hybrid - bucket) / GIB:.3f} | {(hybrid - bucket) / (real - bucket) - 1:+.1%} | "
              f"{top['real_where']}, {rows[0]['hybrid_where']} | {reserved} |")
        if rows[0].get("gathers"):
            print(f"|   | {_gathers_text(rows[0]['gathers'])} |")


def _gathers_text(gathers: dict[str, Any]) -> str:
    buffers = ", ".join(f"{b['bytes']:,} B ({'copied out' if b['waited'] else 'not waited for'})"
                        for b in gathers["buffers"]) or "none"
    return (f"DeepSpeed at its peak (rank 0, {gathers['where']}, {gathers['op']}): {gathers['elements']:,} elements "
            f"gathered in {len(gathers['weights'])} weights; prefetch buffers in flight: {buffers}")


def stack_list(text: str) -> list[str]:
    """The comma list's stacks; a comma inside an option's brackets is the option's."""
    return [stack.strip() for stack in re.split(r",(?![^()]*\))", text)]


def _ranks(args: argparse.Namespace, stack: str) -> list[dict[str, Any]]:
    """Each rank's JSON line: the ranks run at once, one process each, in one gloo group."""
    from bench.distributed import free_port

    port = str(free_port())
    children = []
    for rank in range(args.ranks):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.ranks),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        live = ["--zero3-live", str(args.zero3_live)] if args.zero3_live else []
        live += ["--sub-group", str(args.sub_group)] if args.sub_group else []
        live += ["--zero3-persist", str(args.zero3_persist)] if args.zero3_persist is not None else []
        live += ["--zero3-prefetch", str(args.zero3_prefetch)] if args.zero3_prefetch else []
        live += ["--gathers"] if args.gathers else []
        children.append(subprocess.Popen([sys.executable, __file__, args.model, "--seq", str(args.seq), "--batch",
                                          str(args.batch), "--ranks", str(args.ranks), "--one", stack, *live],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=env))
    rows = []
    for child in children:
        out, _ = child.communicate()
        if child.returncode != 0:
            raise SystemExit(f"{stack}: a rank failed (exit {child.returncode})")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def _compare(model: str, seq: int, batch: int, stack: str, ranks: int, zero3_live: int | None,
             gathers: bool = False) -> dict[str, Any]:
    from bench import distributed, models, spec, trainer
    from bench.cells import make_cell
    from bench.predict import allocator, fake, hybrid
    from bench.predict.counter import MemoryCounter, Workspaces
    from bench.predict.gpus import GpuKind
    from bench.stacks import parse_stack

    if model.endswith(".json"):
        model = models.register_file(Path(model))
    for key, value in distributed.SINGLE_RANK_ENV.items():
        os.environ.setdefault(key, value)  # the parent's RANK, WORLD_SIZE for several
    cell = make_cell(spec.get(REPO / "matrix.yaml", "smoke"), "cpu", model, seq, batch, parse_stack(stack))
    cell = replace(cell, gpus=ranks)
    if zero3_live:
        _limit_zero3(zero3_live)
    probe = gathers and "zero3" in cell.stack.names
    counter: Any = _probing_counter("step2") if probe else MemoryCounter()
    with counter:
        job = trainer.build(cell)
        if probe:
            counter.snapshot = lambda: _gathered(job.engine)
        for index, step_batch in enumerate(job.batches()[:3]):
            job.step(step_batch, counter, f"step{index}")
    steps, _, _ = fake.counted_run(hybrid.activation_cell(cell), Workspaces())  # the plain engine: one rank
    if "offload" in cell.stack.names:
        return _offload_step(cell, counter, steps)
    cpu = GpuKind("cpu", "this CPU", (0, 0))  # no cuBLAS workspaces, no context: like for like
    predicted = hybrid.assembled(cell, steps, cpu, cpu_check=True)
    # DeepSpeed's own allocations, in their order, through the same model of CUDA's caching allocator
    real_reserved = allocator.replay(allocator.trace(counter.records, counter.releases)).peak_reserved_bytes
    return {"real_bytes": counter.peak.nbytes, "real_where": counter.peak.where,
            "real_phase_peaks": dict(counter.phase_peaks), "real_phase_ends": dict(counter.phase_ends),
            "hybrid_bytes": int(predicted["peak_allocated_gib"] * GIB), "bucket_bytes": int(predicted["buckets_gib"] * GIB),
            "hybrid_where": predicted["peak_phase"], "real_reserved_bytes": real_reserved,
            "gathers": getattr(counter, "at_peak", None),
            "hybrid_reserved_bytes": int(predicted["peak_reserved_gib"] * GIB)}


def _probing_counter(stage: str) -> Any:
    """A MemoryCounter that, at each new peak of `stage`, keeps what its `snapshot` says (`at_peak`)."""
    from bench.predict.counter import MemoryCounter

    class Probing(MemoryCounter):
        snapshot: Any = None
        at_peak: dict[str, Any] | None = None
        _most = 0

        def _count(self, index: int) -> None:
            super()._count(index)
            if self.snapshot is not None and self.where.startswith(f"{stage}/") and self.live_bytes > self._most:
                self._most = self.live_bytes
                self.at_peak = {**self.snapshot(), "where": self.where, "op": self.records[index].op}
    return Probing()


def _gathered(engine: Any) -> dict[str, Any]:
    """What ZeRO-3 holds gathered now: its weights whole (not the persistent ones), and the flat buffers
    of its all-gathers still in flight (a coalesced gather's: its weights are copied out of it when the
    first is waited for; it lives until the last is)."""
    module = engine.model.module
    weights = [(name, p.ds_numel) for name, p in module.named_parameters()
               if p.data.numel() > 0 and not getattr(p, "ds_persist", False)]
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    buffers = {}
    for handle in set(coordinator._PartitionedParameterCoordinator__inflight_param_registry.values()):
        for gather in getattr(handle, "handles", [handle]):  # MultipleAllGatherHandles: one per dtype
            if getattr(gather, "partitions", None):  # a coalesced gather's views of its flat buffer
                storage = gather.partitions[0].untyped_storage()
                buffers[storage.data_ptr()] = {"bytes": storage.nbytes(), "waited": gather.complete}
    return {"elements": sum(n for _, n in weights), "weights": [name for name, _ in weights],
            "buffers": list(buffers.values())}


def _offload_step(cell: Any, counter: Any, steps: Any) -> dict[str, Any]:
    """The optimizer offloaded: DeepSpeed's peak of every tensor (the GPU's and host's alike, on a CPU)
    against the more of two moments: training (the hybrid's GPU training peak beside the host's
    training tensors) and the step (the GPU's states, its bucket if held, and what the fake run keeps
    between steps, beside the host's tensors in the step), all as a CPU makes them (`cpu_check`)."""
    from bench import trainer
    from bench.predict import hybrid, zero_backward, zero_layout, zero_states

    meta = trainer.build_model(cell, device="meta").model
    layout = zero_layout.Layout.of(meta, cell.gpus, steps.needs_backward, steps.fed_without_gradient)
    states = zero_states.model_states(cell, layout, zero_layout.largest_layer_params(meta), cpu_check=True)
    training = zero_backward.training_peak(steps, states, layout)
    bucket = states.bucket_bytes if states.bucket_in_step else 0
    moments = {training.where: training.nbytes + states.host_training_bytes // cell.gpus,
               "optimizer step": states.step_bytes + bucket + hybrid.kept_between_steps(steps)
               + states.host_bytes // cell.gpus}
    where = max(moments, key=lambda k: moments[k])
    return {"real_bytes": counter.peak.nbytes, "real_where": f"{counter.peak.where} (GPU and host)", "bucket_bytes": 0,
            "hybrid_bytes": moments[where], "hybrid_where": f"{where} (GPU and host)"}


def _limit_zero3(live: int) -> None:
    """DeepSpeed's config for this process's cell and the hybrid's ZeRO-3 gathering, both given `live`."""
    from bench.predict import zero_layout

    _zero_options(stage3_max_live_parameters=live, stage3_max_reuse_distance=live)
    zero_layout.max_reuse_distance = lambda: live  # type: ignore[assignment]
    zero_layout.max_live_parameters = lambda: live  # type: ignore[assignment]


def _limit_sub_groups(size: int) -> None:
    """DeepSpeed's config for this process's cell and the hybrid's ZeRO-3 sub-groups, both given `size`."""
    from bench.predict import zero_states

    _zero_options(sub_group_size=size)
    zero_states.sub_group_size = lambda: size  # type: ignore[assignment]


def _limit_persistence(elements: int) -> None:
    """DeepSpeed's config for this process's cell and the hybrid's persistent parameters, both given
    `elements` as ZeRO-3's param persistence threshold."""
    from bench.predict import zero_layout

    _zero_options(stage3_param_persistence_threshold=elements)
    model_threshold = zero_layout.persistence_thresholds()[1]
    zero_layout.persistence_thresholds = lambda: (elements, model_threshold)  # type: ignore[assignment]


def _zero_options(**options: int) -> None:
    """The suite's DeepSpeed config, in this process, with these `zero_optimization` options set."""
    from bench.engines import deepspeed

    config = deepspeed.config

    def configured(*args: Any, **kwargs: Any) -> dict[str, Any]:
        out = config(*args, **kwargs)
        out["zero_optimization"].update(options)
        return out
    deepspeed.config = configured  # type: ignore[assignment]


if __name__ == "__main__":
    main()
