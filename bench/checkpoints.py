"""Random-weight checkpoints on disk, for techniques that must load through from_pretrained.

Quantized bases (QLoRA's nf4, LLM.int8) are made by transformers while loading a checkpoint: they
cannot be built with from_config. So a model's random bf16 weights are saved once, from its shipped
config and a seed, and reused by every quantized cell. Cache: $BENCH_CACHE or
~/.cache/llm-memory-bench/checkpoints/<model>-<hash of config and seed>/ (written to a temporary
folder, then renamed: a killed cell never leaves half a checkpoint).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from . import models


def cache_dir() -> Path:
    root = os.environ.get("BENCH_CACHE") or Path.home() / ".cache" / "llm-memory-bench"
    return Path(root) / "checkpoints"


def random_checkpoint(model_name: str, seed: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    spec = models.get(model_name)
    digest = hashlib.sha1(f"{spec.config_json}|{seed}".encode()).hexdigest()[:10]
    path = cache_dir() / f"{model_name}-{digest}"
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    config = models.hf_config(spec, "sdpa")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # on the CPU: no GPU memory used
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def with_tokenizer(path: Path, vocab_size: int) -> Path:
    """The checkpoint with a tokenizer beside it, for loaders that insist on loading one (Unsloth's):
    a word-level vocabulary of `vocab_size` placeholder tokens. The suite feeds token ids, so no text
    is ever tokenized with it. Written to a temporary file, then renamed, as the checkpoint is."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    if (path / "tokenizer.json").exists():
        return path
    vocabulary = {f"<t{i}>": i for i in range(vocab_size)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocabulary, unk_token="<t0>")),
                                        unk_token="<t0>", pad_token="<t1>", eos_token="<t2>")
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-tok-"))
    try:
        tokenizer.save_pretrained(tmp)
        for name in sorted(p.name for p in tmp.iterdir()):  # tokenizer.json last: its presence means done
            if name != "tokenizer.json":
                os.replace(tmp / name, path / name)
        os.replace(tmp / "tokenizer.json", path / "tokenizer.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
