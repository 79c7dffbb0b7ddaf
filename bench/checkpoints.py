"""Random-weight checkpoints on disk, for techniques that must load through from_pretrained.

Quantized bases (QLoRA's nf4, LLM.int8, Unsloth's) are made by their libraries while loading a
checkpoint: they cannot be built with from_config. So a model's random bf16 weights are saved once,
from its shipped config and a seed, and reused by every quantized cell. Cache: $BENCH_CACHE or
~/.cache/llm-memory-bench/checkpoints/<model>[-cuda]-<hash of config and seed>/ (written to a
temporary folder, then renamed: a killed cell never leaves half a checkpoint).

Where the weights are drawn. A cell that finds no checkpoint makes one on the CPU, inside its build:
under torch 2.11 / transformers 5.17 (the GPU image) that is nn.Linear's uniform init and then the
model's normal init, 86 s for Llama-3.2-3B on a 2-core CPU. Its first qlora cell on a bare H200 host
took 146 s to build, of which writing and loading the checkpoint took under 3 s by its log. So before
the first cell on a GPU the runner draws each checkpoint its cells need there (`prepare`, in a child
process, so no CUDA context stays behind): `-cuda` in its folder's name. Those are the weights the
plain cells of the same model and seed build on that GPU (bench/trainer.base_model draws them the same
way), so a quantized cell's base is the plain cell's, quantized. A cell on a GPU loads the GPU-drawn
checkpoint where there is one, else the CPU-drawn; its row's evidence names the one it loaded
(`base_checkpoint`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from . import models

if TYPE_CHECKING:
    from .cells import Cell

PREPARE_TIMEOUT_S = 600  # a 70B checkpoint's 140 GB written to disk
HEADROOM_BYTES = 2 << 30  # the CUDA context and the caching allocator's rounding, beside the weights


def cache_dir() -> Path:
    root = os.environ.get("BENCH_CACHE") or Path.home() / ".cache" / "llm-memory-bench"
    return Path(root) / "checkpoints"


def random_checkpoint(model_name: str, seed: int, device: str = "cpu") -> Path:
    """The checkpoint of the model's random weights drawn on `device` ("cpu" or "cuda"), made if absent."""
    import torch
    from transformers import AutoModelForCausalLM

    path = _path(model_name, seed, device)
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    config = models.hf_config(models.get(model_name), "sdpa")
    torch.manual_seed(seed)
    with torch.device(device):  # on the CPU, no GPU memory used; on a GPU, only in `prepare`'s child
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def for_load(model_name: str, seed: int, device: str) -> Path:
    """The checkpoint a cell on `device` loads: the GPU-drawn one where a GPU cell finds it, else the
    CPU-drawn one (drawn now if absent: drawing on a GPU inside a cell would count in its memory)."""
    drawn_on_gpu = _path(model_name, seed, "cuda")
    if device == "cuda" and (drawn_on_gpu / "config.json").exists():
        return drawn_on_gpu
    return random_checkpoint(model_name, seed, "cpu")


def _path(model_name: str, seed: int, device: str) -> Path:
    key, name = f"{models.get(model_name).config_json}|{seed}", model_name
    if device != "cpu":  # CPU-drawn checkpoints keep the key they had before GPU-drawn ones existed
        key, name = f"{key}|{device}", f"{model_name}-{device}"
    return cache_dir() / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def needed(cells: Iterable[Cell]) -> list[tuple[str, int]]:
    """(model, seed) of each GPU cell whose base a technique loads from a random checkpoint, once each."""
    return sorted({(c.model, c.seed) for c in cells
                   if c.device == "cuda" and any(u.technique.load is not None for u in c.stack.uses)})


def prepare(cells: Iterable[Cell]) -> list[str]:
    """Draws on the GPU, before the first cell, each checkpoint the GPU cells need that is not there yet,
    each in a child process (its CUDA context ends with it); one line for each, saying how long it took or
    why it failed (then its cells draw theirs on the CPU, as before)."""
    lines = []
    for model_name, seed in needed(cells):
        if (_path(model_name, seed, "cuda") / "config.json").exists():
            continue
        started, what = time.monotonic(), f"the random checkpoint of {model_name} (seed {seed})"
        try:
            done = subprocess.run([sys.executable, "-m", "bench.checkpoints", model_name, str(seed)],
                                  capture_output=True, text=True, timeout=PREPARE_TIMEOUT_S)
            why = None if done.returncode == 0 else (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        except subprocess.TimeoutExpired:
            why = f"over {PREPARE_TIMEOUT_S} s"
        if why is None:
            lines.append(f"{what} drawn on the GPU in {time.monotonic() - started:.1f} s")
        else:
            lines.append(f"{what} not drawn on the GPU ({why}): its cells make it on the CPU")
    return lines


def _draw_on_gpu(model_name: str, seed: int) -> None:
    """The child `prepare` starts: refuses, before drawing, a model whose weights the GPU cannot hold."""
    import torch
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(models.hf_config(models.get(model_name), "sdpa"))
    weights_bytes = 2 * sum(p.numel() for p in skeleton.parameters())  # bf16
    free_bytes = torch.cuda.mem_get_info()[0]
    if weights_bytes + HEADROOM_BYTES > free_bytes:
        sys.exit(f"its {weights_bytes / 2**30:.1f} GiB of weights do not fit in the GPU's "
                 f"{free_bytes / 2**30:.1f} GiB free")
    random_checkpoint(model_name, seed, "cuda")


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


if __name__ == "__main__":
    _draw_on_gpu(sys.argv[1], int(sys.argv[2]))
