"""The ZeRO hybrid prediction against DeepSpeed's real engine, on this CPU: peak allocated, both ways.

    python tools/hybrid_check.py llama-3.2-1b --seq 256 --batch 2 --stacks zero2,zero3

For each stack, in a process of its own (DeepSpeed's state is global): DeepSpeed trains the cell three
steps on real CPU tensors, one gloo rank, under the predictor's MemoryCounter (every allocation, 512 B
blocks); and the hybrid (bench/predict/hybrid.py) assembles the same cell from DeepSpeed's estimator,
its bucket and the fake run of the cell without its engine, with neither side counting a GPU's cuBLAS
workspaces or kernel scratch. Offload stacks are not compared: on a CPU the "host" is the device.
A model is a registry name or a config.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a registry name (bench/model_configs) or a config.json")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--stacks", default="zero2,zero3", help="comma list of ZeRO stacks without offload")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: one stack, one JSON line out
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_compare(args.model, args.seq, args.batch, args.one)))
        return
    print(f"{args.model}, seq {args.seq}, batch {args.batch}, one rank on this CPU; peak allocated, GiB")
    print("| stack | DeepSpeed | hybrid | error | DeepSpeed less its bucket | hybrid less its bucket | error |")
    print("|---|---|---|---|---|---|---|")
    for stack in args.stacks.split(","):
        child = subprocess.run([sys.executable, __file__, args.model, "--seq", str(args.seq), "--batch", str(args.batch),
                                "--one", stack], capture_output=True, text=True, cwd=REPO, check=True)
        row = json.loads(child.stdout.strip().splitlines()[-1])
        real, hybrid, bucket = row["real_bytes"], row["hybrid_bytes"], row["bucket_bytes"]
        print(f"| `{stack}` | {real / GIB:.3f} | {hybrid / GIB:.3f} | {hybrid / real - 1:+.1%} | "
              f"{(real - bucket) / GIB:.3f} | {(hybrid - bucket) / GIB:.3f} | {(hybrid - bucket) / (real - bucket) - 1:+.1%} |")


def _compare(model: str, seq: int, batch: int, stack: str) -> dict[str, Any]:
    from bench import distributed, models, spec, trainer
    from bench.cells import make_cell
    from bench.predict import fake, hybrid
    from bench.predict.counter import MemoryCounter, Workspaces
    from bench.predict.gpus import GpuKind
    from bench.stacks import parse_stack

    if model.endswith(".json"):
        model = models.register_file(Path(model))
    os.environ.update(distributed.SINGLE_RANK_ENV)
    cell = make_cell(spec.get(REPO / "matrix.yaml", "smoke"), "cpu", model, seq, batch, parse_stack(stack))
    with MemoryCounter() as counter:
        job = trainer.build(cell)
        for index, step_batch in enumerate(job.batches()[:3]):
            job.step(step_batch, counter, f"step{index}")
    steps, _, _ = fake.counted_run(hybrid.activation_cell(cell), Workspaces())
    meta = trainer.build_model(cell, device="meta").model
    states = hybrid.model_states(cell, sum(p.numel() for p in meta.parameters()), hybrid.largest_layer_params(meta))
    cpu = GpuKind("cpu", "this CPU", (0, 0))  # no cuBLAS workspaces, no context: like for like
    predicted = hybrid.hybrid_columns(cell, steps.peak_of_roles_except(hybrid.MODEL_STATE_ROLES), 0.0, states, cpu,
                                      hybrid.Build.of(meta, cell))
    return {"real_bytes": counter.peak.nbytes, "real_where": counter.peak.where,
            "hybrid_bytes": int(predicted["peak_allocated_gib"] * GIB), "bucket_bytes": states.bucket_bytes}


if __name__ == "__main__":
    main()
