"""How many input columns LLM.int8 would run in 16 bits, per projection, on this suite's random weights.

    python tools/int8_outliers.py llama-3.2-3b --seq 2048 --batch 2 [--layers N] [--write]
    python tools/int8_outliers.py llama-3.2-3b --seq 1024,2048,4096 --batch 1,2,4,8 --write

The model is built as `bench/checkpoints.py` builds its random checkpoints (transformers' init, bf16,
seeded), cut to its first `--layers` decoder layers (default: all), and one batch of random token ids of the
cell's shape (each of the shapes asked, one model) runs forward on the CPU with real values. A column counts
where any token's value (in fp16, as bitsandbytes quantizes it) reaches the threshold, 6.0
(bench/techniques/int8_lora.py says why this matters).
`--write` keeps the counts of every layer, all layers run, in results/int8-outliers/MODEL.json, where the
predictor takes them for int8_lora cells of that model and batch shape (bench/predict/int8.py).
Llama-3.2-3B at 4,096 tokens: about 1.5 minutes on 2 cores, a minute of it the model's build.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from bench.predict import int8  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a registry name (bench/model_configs)")
    parser.add_argument("--seq", type=_ints, default=[2048], help="tokens a sequence, a comma list (default 2048)")
    parser.add_argument("--batch", type=_ints, default=[1], help="sequences in the batch, a comma list (default 1)")
    parser.add_argument("--layers", type=lambda text: _ints(text)[0], help="decoder layers kept (default: all; not with --write)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help="keep the counts for the predictor")
    args = parser.parse_args()
    if args.write and args.layers is not None:
        parser.error("--write counts every layer: leave --layers out")
    from bench import models

    if args.model not in models.registry():
        parser.error(f"unknown model {args.model!r}; known: {', '.join(models.registry())}")

    import torch
    from transformers import AutoModelForCausalLM

    config = models.hf_config(models.get(args.model), "sdpa")
    if args.layers is not None:
        config.num_hidden_layers = args.layers
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    counts: dict[str, tuple[int, int, float]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.register_forward_pre_hook(_counting(int8.layer_key(name), counts))
    for seq, batch in ((s, b) for s in args.seq for b in args.batch):
        counts.clear()
        with torch.no_grad():
            model(torch.randint(0, config.vocab_size, (batch, seq)))
        print(f"{args.model}, {config.num_hidden_layers} layers, batch {batch} x seq {seq}, torch {torch.__version__}, "
              f"threshold {int8.THRESHOLD}")
        for name, (outlier_columns, columns, largest) in counts.items():
            print(f"{name:40s} {outlier_columns:6d} of {columns:6d} columns ({outlier_columns / columns:6.1%}); "
                  f"largest |value| {largest:.2f}")
        if args.write:
            found = {name: n for name, (n, _, _) in counts.items() if n}
            _write(args, int8.batch_key(seq, batch), found, torch.__version__)


def _ints(text: str) -> list[int]:
    """Positive integers, comma-separated (argparse's type: a bad one is exit 2, named)."""
    try:
        found = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a comma list of integers") from None
    if any(n < 1 for n in found):
        raise argparse.ArgumentTypeError(f"{text!r}: each must be at least 1")
    return found


def _write(args: argparse.Namespace, key: str, counts: dict[str, int], torch_version: str) -> None:
    """Merges this batch shape's counts into the model's file (other shapes kept)."""
    path = int8.counts_path(args.model)
    table: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"model": args.model, "counts": {}}
    table["how"] = ("python tools/int8_outliers.py MODEL --seq S --batch B --write: a real forward on a CPU of the "
                    "model's random bf16 weights (transformers' init) over random token ids; a layer's outlier "
                    f"columns are those with any |value| >= {int8.THRESHOLD} in fp16; layers with none are left out")
    table["counts"][key] = counts
    table.setdefault("made", {})[key] = (f"{datetime.date.today().isoformat()}, torch {torch_version}, "
                                         f"seed {args.seed}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(REPO)} ({key})")


def _counting(name: str, counts: dict[str, tuple[int, int, float]]) -> Any:
    def count(module: Any, inputs: tuple[Any, ...]) -> None:
        import torch

        values = inputs[0].reshape(-1, inputs[0].shape[-1]).to(torch.float16).abs()
        counts[name] = (int((values >= int8.THRESHOLD).any(0).sum()), values.shape[-1], float(values.max()))
    return count


if __name__ == "__main__":
    main()
