"""One cell's allocations as CUDA's caching allocator made them, beside the prediction's.

    python tools/cell_trace.py record MATRIX CELL_ID OUT.json.gz      # on a GPU
    python tools/cell_trace.py compare MATRIX OUT.json.gz [--gpu h100]  # on any CPU

`record` runs the cell as a worker does (bench/worker.py: build, warm-up and measured steps) under
torch.cuda.memory._record_memory_history and keeps the allocator's device trace, [action, address, bytes,
stream] for every allocation, free and segment (tools/allocator_trace.py's rows), with the row's peaks
and `segments_json`. A few MB gzipped for a 3B model's 13 steps. Each free's request is kept beside its
completion (since 2026-11-28), so `compare` can say which frees the allocator deferred.

`compare` says where a predicted peak reserved that misses the GPU's goes wrong:
1. the allocator model: the GPU's own requests replayed through bench/predict/allocator.py. The same
   peak and segments mean the model's rules hold for this cell, and the miss is in the fake run's trace;
2. the trace: the fake run's requests beside the GPU's, large ones (over 1 MiB) in order from the
   start, where they first part (the fake run's ops around it); and, for each segment size the two
   hold a different number of, which of that size's requests made one on the GPU and in the replay
   of the fake run (the fake run stops after its first measured step; the GPU runs every step);
3. the frees CUDA completed only after later requests (a block freed after `record_stream` waits for the
   other stream's work): the model replays every free where the program makes it.
A ZeRO cell's prediction is the hybrid's trace (bench/predict/hybrid_trace.py): the fake run's requests
merged with DeepSpeed's engine's, which `compare` names `deepspeed`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

MIB = 1 << 20
ENTRIES = 5_000_000  # the recorder's ring buffer: far more than a 13-step cell makes (about 300,000)


def refuse(why: str) -> NoReturn:
    """Bad input: says why (named as the tool that was run), exit 2, nothing run."""
    print(f"{Path(sys.argv[0]).stem}: {why}", file=sys.stderr)
    sys.exit(2)


def find_cell(matrix_name: str, cell_id: str) -> Any:
    """The matrix's cell of that id, as a GPU host plans it."""
    from bench import cells, spec
    from bench.envinfo import OPTIONAL_PACKAGES, HostCaps

    try:
        matrix = spec.get(REPO / "matrix.yaml", matrix_name)
    except spec.SpecError as err:
        refuse(str(err))
    for cell in cells.expand(matrix, HostCaps(cuda_devices=1, packages=frozenset(OPTIONAL_PACKAGES))):
        if cell.cell_id == cell_id:
            return cell
    refuse(f"matrix {matrix_name} has no cell {cell_id}")


def one_gpu_cell(matrix_name: str, cell_id: str) -> Any:
    """The matrix's cell of that id, to run here on one GPU, its stack's environment set (the allocator's
    settings, say: read when CUDA first allocates); refused without a GPU or for a cell of several."""
    import torch

    if not torch.cuda.is_available():
        refuse("record needs a GPU")
    cell = find_cell(matrix_name, cell_id)
    if cell.gpus > 1:
        refuse(f"{cell_id} runs on {cell.gpus} GPUs; record takes one-GPU cells")
    os.environ.update(cell.stack.env)
    return cell


def record(matrix_name: str, cell_id: str, out: Path) -> None:
    import torch
    from allocator_trace import KEPT

    from bench import worker

    cell = one_gpu_cell(matrix_name, cell_id)
    torch.cuda.memory._record_memory_history(context=None, max_entries=ENTRIES)  # no stacks: fast
    row = worker.run_cell(cell)
    rows = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    kept = [[e["action"], e["addr"], e["size"], e["stream"]] for e in rows if e["action"] in (*KEPT, "free_requested")]
    found = {"matrix": matrix_name, "cell_id": cell_id, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
             "cuda": torch.version.cuda, "entries": len(rows), "max_entries": ENTRIES,
             **{k: row.get(k) for k in ("status", "peak_allocated_gib", "peak_reserved_gib", "segments_json")},
             "device_trace": kept}
    with gzip.open(out, "wt") as handle:
        json.dump(found, handle, separators=(",", ":"))
    print(f"{cell_id}: {row.get('status')}, peak reserved {row.get('peak_reserved_gib')} GiB, "
          f"{len(kept)} trace rows of {len(rows)} entries -> {out}")


def deferred_frees(rows: list[list[Any]]) -> list[tuple[int, int, int]]:
    """(bytes, stream, requests between) of each free the allocator completed only after later requests: a
    block freed after `record_stream` on another stream (ZeRO-3 frees its gathered weights so) is reused only
    once that stream's work passes, which a replay in program order does not know. From `record`'s rows: a
    `free_requested` and its `free_completed` (traces recorded before 2026-11-28 have only the latter)."""
    requested: dict[int, int] = {}  # address -> allocations made before its free was requested
    allocations, deferred = 0, []
    for action, address, nbytes, stream in rows:
        if action == "alloc":
            allocations += 1
        elif action == "free_requested":
            requested[address] = allocations
        elif action == "free_completed" and address in requested:
            between = allocations - requested.pop(address)
            if between:
                deferred.append((nbytes, stream, between))
    return deferred


def segments_made(events: list[tuple[Any, ...]]) -> list[tuple[int, int]]:
    """Replays the events through the model: (the event made for, bytes) of each segment it makes."""
    from bench.predict import allocator

    return allocator.replay(events).made


def who_made(events: list[tuple[Any, ...]], made: list[tuple[int, int]]) -> dict[int, list[str]]:
    """Per segment size: "k/n" for each segment made for the k-th request of its size (of n)."""
    ordinal: dict[int, int] = {}
    nth = {}
    for index, (kind, _, nbytes, _) in enumerate(events):
        if kind == "malloc":
            ordinal[nbytes] = ordinal.get(nbytes, 0) + 1
            nth[index] = ordinal[nbytes]
    found: dict[int, list[str]] = {}
    for index, size in made:
        nbytes = events[index][2]
        found.setdefault(size, []).append(f"{nth[index]}/{ordinal[nbytes]} of {nbytes:,} B")
    return found


def first_parting(gpu: list[tuple[Any, ...]], fake: list[tuple[Any, ...]]) -> int | None:
    """The index of the first large request (over 1 MiB) where the two traces differ; None: none within both."""
    theirs = [e[2] for e in gpu if e[0] == "malloc" and e[2] > MIB]
    ours = [e[2] for e in fake if e[0] == "malloc" and e[2] > MIB]
    return next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), None)


def made_by(records: list[Any], ident: int) -> tuple[str, str]:
    """The op and stage/phase that made a block of the prediction's trace; a ZeRO cell's engine blocks
    (bench/predict/hybrid_trace.py: ids past the fake run's records) are DeepSpeed's."""
    return (records[ident].op, records[ident].where) if ident < len(records) else ("deepspeed", "engine")


def comparison(measured: dict[str, Any], cell: Any, gpu_kind: str) -> dict[str, Any]:
    """A recorded cell (`record`'s file, read) against the model and the fake run: the figures `compare` prints."""
    from bench.predict import allocator, fake, gpus

    device = allocator.from_device_trace(measured["device_trace"])
    events, records = fake.trace_of(cell, gpus.get(gpu_kind))
    theirs = who_made(device.events, [(index, size) for index, _, size in device.made])
    ours = who_made(events, segments_made(events))
    return {"trace_peak_bytes": device.peak_reserved_bytes,
            "model_peak_bytes": allocator.replay(device.events).peak_reserved_bytes,
            "requests": (sum(e[0] == "malloc" for e in device.events), sum(e[0] == "malloc" for e in events)),
            "parting": first_parting(device.events, events),
            "large": ([e[2] for e in device.events if e[0] == "malloc" and e[2] > MIB],
                      [(e[2], *made_by(records, e[1])) for e in events if e[0] == "malloc" and e[2] > MIB]),
            "segments": {size: (theirs.get(size, []), ours.get(size, [])) for size in sorted(set(theirs) | set(ours))
                         if len(theirs.get(size, [])) != len(ours.get(size, []))},
            "deferred": deferred_frees(measured["device_trace"])}


def compare(matrix_name: str, path: Path, gpu_kind: str) -> None:
    try:
        with gzip.open(path, "rt") as handle:
            measured = json.load(handle)
    except (OSError, ValueError) as err:
        refuse(f"{path}: not a trace `record` wrote ({err})")
    if measured["entries"] >= measured["max_entries"]:
        print("warning: the recorder's buffer was full: the trace lost its start")
    try:
        found = comparison(measured, find_cell(matrix_name, measured["cell_id"]), gpu_kind)
    except ValueError as err:  # a cell the predictor does not cover (fake.trace_of says why)
        refuse(str(err))
    peak, model = found["trace_peak_bytes"], found["model_peak_bytes"]
    print(f"{measured['cell_id']} on {measured['gpu']} (torch {measured['torch']}): peak reserved "
          f"{measured['peak_reserved_gib']} GiB; in its trace {peak:,} B")
    print(f"1. its requests through the model: {model:,} B ({model / peak - 1:+.3%})")
    print(f"2. requests: GPU {found['requests'][0]:,}, fake run {found['requests'][1]:,}")
    theirs, ours = found["large"]
    at = found["parting"]
    if at is None:
        print(f"   the first {min(len(theirs), len(ours)):,} large requests are the same")
    else:
        print(f"   large request {at} is the first that differs (GPU | fake run, its op and where):")
        for i in range(max(0, at - 3), min(at + 6, len(theirs), len(ours))):
            print(f"   {i}: {theirs[i]:>14,} | {ours[i][0]:>14,}  {ours[i][1]} {ours[i][2]}")
    for size, (gpu_made, fake_made) in sorted(found["segments"].items(), reverse=True):
        print(f"   segments of {size:,} B: GPU {len(gpu_made)}, fake run {len(fake_made)}")
        print(f"     the GPU made them for requests {', '.join(gpu_made[:8])}")
        print(f"     the fake run's replay for {', '.join(fake_made[:8])}")
    deferred = found["deferred"]
    if deferred:
        streams = sorted({stream for _, stream, _ in deferred})
        print(f"3. frees completed after later requests (record_stream): {len(deferred):,}, "
              f"{sum(n for n, _, _ in deferred):,} B, at most {max(b for _, _, b in deferred):,} requests later, "
              f"on streams {', '.join(f'{s:#x}' for s in streams)}; the largest: "
              + ", ".join(f"{n:,} B ({b} later)" for n, _, b in sorted(deferred, reverse=True)[:5]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("matrix")
    rec.add_argument("cell_id")
    rec.add_argument("out", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("matrix")
    cmp.add_argument("trace", type=Path)
    cmp.add_argument("--gpu", default="h100")
    args = parser.parse_args()
    if args.command == "record":
        record(args.matrix, args.cell_id, args.out)
    else:
        compare(args.matrix, args.trace, args.gpu)


if __name__ == "__main__":
    from bench import hashseed

    hashseed.pin()  # the GPU's trace and the prediction allocate in the same order as the suite's runs (Gemma 3)
    main()
