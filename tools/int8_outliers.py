"""How many input columns LLM.int8 would run in 16 bits, per projection, on this suite's random weights.

    python tools/int8_outliers.py llama-3.2-3b --layers 2 --tokens 2048

The model is built as `bench/checkpoints.py` builds its random checkpoints (transformers' init, bf16,
seeded), cut to its first `--layers` decoder layers, and one batch of random token ids runs forward on
the CPU with real values. A column counts where any token's value (in fp16, as bitsandbytes quantizes it)
reaches the threshold, 6.0 (bench/techniques/int8_lora.py says why this matters).
"""

from __future__ import annotations

import argparse
from typing import Any

THRESHOLD = 6.0  # bitsandbytes' llm_int8_threshold default, as transformers' BitsAndBytesConfig sets it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a registry name (bench/model_configs)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept (default 2)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the batch (default 2048)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from bench import models

    config = models.hf_config(models.get(args.model), "sdpa")
    config.num_hidden_layers = args.layers
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    counts: dict[str, tuple[int, int, float]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.register_forward_pre_hook(_counting(name, counts))
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (1, args.tokens)))
    print(f"{args.model}, first {args.layers} layers, {args.tokens} tokens, torch {torch.__version__}, threshold {THRESHOLD}")
    for name, (outlier_columns, columns, largest) in counts.items():
        print(f"{name:40s} {outlier_columns:6d} of {columns:6d} columns ({outlier_columns / columns:6.1%}); "
              f"largest |value| {largest:.2f}")


def _counting(name: str, counts: dict[str, tuple[int, int, float]]) -> Any:
    def count(module: Any, inputs: tuple[Any, ...]) -> None:
        import torch

        values = inputs[0].reshape(-1, inputs[0].shape[-1]).to(torch.float16).abs()
        counts[name] = (int((values >= THRESHOLD).any(0).sum()), values.shape[-1], float(values.max()))
    return count


if __name__ == "__main__":
    main()
