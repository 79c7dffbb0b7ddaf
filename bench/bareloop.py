"""A bare reference training loop: the baseline stack in plain PyTorch, with no harness around it.

`python -m bench.bareloop --model llama-3.2-3b --seq-len 2048 --batch-size 2` builds the model as
every cell does (`trainer.base_model`: shipped config, random bf16 weights on the device, sdpa) and
trains it on the cell's tokens (`data.batches`, labels = inputs) with fused AdamW in a loop of its
own, runs warm-up then measured steps, and prints one JSON line with the two figures the
suite publishes: peak reserved memory and tokens/s over the measured steps (CUDA events). No phase
tracking, no NVML sampler, no subprocess protocol: `bench overhead` runs it beside the suite's own
rows of the same cells and reports the ratios, which is the harness's cost.
"""

from __future__ import annotations

import argparse
import json

from . import data, trainer
from .measure import GIB


def train(model_name: str, seq_len: int, batch_size: int, warmup: int, measure: int, seed: int) -> dict[str, float]:
    import torch

    model = trainer.base_model(model_name, "cuda", seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = data.batches("full", model.config.vocab_size, batch_size, seq_len, warmup + measure, seed, "cuda")
    events = []
    for step, batch in enumerate(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model(input_ids=batch.input_ids, labels=batch.labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end.record()
        if step >= warmup:
            events.append((start, end))
    torch.cuda.synchronize()
    measured_s = sum(s.elapsed_time(e) for s, e in events) / 1000
    return {
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "tokens_per_s": batch_size * seq_len * measure / measured_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bareloop", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--measure", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(json.dumps(train(a.model, a.seq_len, a.batch_size, a.warmup, a.measure, a.seed)))


if __name__ == "__main__":
    main()
