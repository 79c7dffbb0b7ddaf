"""Which of transformers' causal-LM architectures `bench predict` predicts, under the installed releases.

    python tools/model_types.py [--stack 'gc + lora'] [--stack mixed] [--only llama,qwen3] [--jobs 2] [--out FILE]

Every model type transformers maps to a causal LM (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) whose default config is a
text model's (a multimodal one, with a `text_config`, `bench ask` refuses: ask about its text model) gets its
defaults shrunk to two narrow layers (`shrunk`) and written as a config.json, as a user's download would bring it;
then `python -m bench ask CONFIG --seq 128 --stack S --json` runs once per stack, each in a process of its own with
a timeout, so one architecture that crashes or hangs costs only its own answer. The table (`--out`, markdown) gives
each answer's status, peak allocated and reserved GiB (H100, predictions: fake runs on this CPU, not
measurements), and for one that was not predicted why (a reason's first line, an error's exception), and for one that
failed whether the same cell's step runs for real (`runs_for_real`: if it does, the failure is the predictor's);
beside the table, NAME.json keeps the answers. Exit 0 once every answer is in; with `--baseline` (an earlier NAME.json), 1 if
an answer it predicted no longer predicts (and, not failing, a list of the peaks that moved by more than 1%); 2 on bad
arguments. A new torch or transformers release that stops an
architecture predicting shows here before a user asks about it (`tests/test_ask.py` keeps five unlike Llama's in
the suite).

Two stacks over transformers 5.24's 180 text model types take about 20 minutes on 2 cores with `--jobs 2`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the suite's package, installed or not

from bench.views import in_cell  # noqa: E402  (a reason's pipes, peft's hint of targets, kept in its cell)

MOVED_PCT = 1.0  # a peak that moves by more than this against --baseline is listed under the table
TIMEOUT_S = 300  # one answer: a two-layer model's fake step takes seconds; a hang is a failure, not a wait

# The sizes any architecture reads, narrowed; an architecture's other fields stay its defaults
SMALL = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, vocab_size=1024, moe_intermediate_size=128, num_experts=4, n_routed_experts=4,
             num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
             topk_group=1, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
             num_experts_per_token=2, num_expert_group=1,
             n_layer=2, n_embd=256, n_head=4,  # GPT-2's names
             n_layers=2, d_model=256,  # MPT's, DBRX's, XLNet's
             decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=512, encoder_layers=2,  # BART's family's
             encoder_attention_heads=4, encoder_ffn_dim=512, decoder_vocab_size=1024, ffn_dim=512,
             ffn_hidden_size=512, intermediate_size_mlp=512, vocab_size_per_layer_input=1024, d_inner=512)


def _small_tower(layers: int, **more: int) -> dict[str, int]:
    """A sub-model's config (BLT's patcher, byte encoder and decoder, global transformer), as narrow as SMALL."""
    return dict(hidden_size=256, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=512, head_dim=64, **more)


# Where an architecture's defaults do not shrink by SMALL's names alone: sizes that must agree with SMALL's (Mamba
# heads times head size = 2 x hidden_size), a default that cannot build (LFM2-MoE without layer_types), a derived size
# the config keeps (LongCat's qk_head_dim), layer ids at the default depth; Gemma 3n's KV sharing (its last 15 layers
# reuse earlier ones' caches) is off, two layers having none to share.
OWN_SIZES: dict[str, dict[str, Any]] = {
    "bailing_hybrid": {"layer_group_size": 2},  # each group's last layer is its full attention
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 64},
    "blt": {"vocab_size": 260, "encoder_hash_byte_group_vocab": 1024,  # bytes, and its towers' own configs
            "patcher_config": _small_tower(2), "global_config": _small_tower(2),
            "encoder_config": _small_tower(1, hidden_size_global=256),
            "decoder_config": _small_tower(2, hidden_size_global=256)},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},  # as DBRX ships them: the
             "ffn_config": {"hidden_size": 256, "ffn_hidden_size": 512, "moe_num_experts": 4, "moe_top_k": 2}},  # rest
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1,  # its input,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},  # looped and output layers
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 64},
    "kolibri1_1": {"mlp_only_layers": [0], "index_num_heads": 2},  # a dense layer and an experts one; index heads
    # at most the query heads of a key head (4 // 2)
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "longcat_flash": {"num_layers": 2, "qk_head_dim": 64, "moe_topk": 2, "zero_expert_num": 2,
                      "expert_ffn_hidden_size": 128, "max_position_embeddings": 4096},
    "mamba2": {"num_heads": 8},
    "zamba2": {"hybrid_layer_ids": [1], "attention_hidden_size": 512, "attention_head_dim": 128, "mamba_headdim": 64},
    "zaya": {"num_experts_per_tok": 1},
}
# Layer indices at the default depth (Kolibri's indexer layers, the layer each reads its keys and values from):
# None lets the config derive them at the shrunk depth, unless OWN_SIZES names them
LAYER_INDEX_LISTS = ("mlp_only_layers", "index_layers", "kv_source_layers")
PER_LAYER_DICTS = ("per_layer_config",)  # layer index -> that layer's own settings (Gemma 4)
DEPTHS = ("num_hidden_layers", "n_layer", "n_layers", "decoder_layers")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def shrunk(model_type: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """transformers' default config of `model_type` as a dict, its sizes narrowed to SMALL's (where it has them),
    then its OWN_SIZES and `extra`; its layers cut to a few that keep each kind of layer it has (`kept_layers`) and token ids kept
    inside the smaller vocabulary."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type).to_dict()
    depth_key = next((key for key in DEPTHS if isinstance(config.get(key), int)), None)
    per_layer = [key for key, value in config.items() if depth_key and isinstance(value, list)
                 and len(value) == config[depth_key] > SMALL[depth_key]  # one entry a layer: layer_types, say
                 and key not in LAYER_INDEX_LISTS]
    config |= {key: value for key, value in SMALL.items() if key in config}
    if "kv_lora_rank" in config:  # latent attention: a head per query head, rope on a head's rope part
        config |= {"num_key_value_heads": config["num_attention_heads"], "head_dim": config["qk_rope_head_dim"]}
    own = OWN_SIZES.get(model_type, {}) | (extra or {})
    config |= own
    per_layer = [key for key in per_layer if isinstance(config[key], list)]  # not one SMALL made a single size
    keep = list(range(int(config[depth_key]))) if depth_key else []
    if per_layer and depth_key and depth_key not in own:
        keep = kept_layers([config[key] for key in per_layer], int(SMALL[depth_key]))
        config |= {key: [config[key][i] for i in keep] for key in per_layer} | {depth_key: len(keep)}
    for key in PER_LAYER_DICTS:  # keyed by layer index: the kept layers', renumbered
        if isinstance(config.get(key), dict):
            config[key] = {str(keep.index(int(i))): v for i, v in config[key].items() if int(i) in keep}
    config |= {key: None for key in LAYER_INDEX_LISTS if isinstance(config.get(key), list) and key not in own}
    config |= {key: 1 for key in TOKEN_IDS if isinstance(config.get(key), int) and config[key] >= config["vocab_size"]}
    return config


def kept_layers(per_layer: list[list[Any]], at_least: int) -> list[int]:
    """The layers kept: the first of each kind in each per-layer list (a sliding-window and a full-attention layer,
    a dense and a mixture-of-experts one), then the first ones up to `at_least`."""
    firsts = sorted({values.index(kind) for values in per_layer for kind in _distinct(values)})
    others = [i for i in range(len(per_layer[0])) if i not in firsts]
    return sorted(firsts + others[:max(0, at_least - len(firsts))])


def _distinct(values: list[Any]) -> list[Any]:
    seen: list[Any] = []
    for value in values:
        if value not in seen:
            seen.append(value)
    return seen


def text_model_types() -> list[str]:
    """The causal-LM model types whose default config is a text model's, sorted."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # a type whose defaults do not build is not one a user can ask about either
            continue
        if not hasattr(config, "text_config"):
            found.append(model_type)
    return found


@dataclass(frozen=True)
class Answer:
    model_type: str
    stack: str
    status: str  # ok | unsupported | error | ... as the predicted row says; refused (exit 2: bad input, says why),
    # crashed or timeout: no row came back
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    why: str = ""  # why it was not predicted: a reason's first line, an error's exception (its traceback's last line)
    real_step: str | None = None  # a failed answer's step run for real (`runs_for_real`): "" it runs, else why not


def ask(config_path: Path, model_type: str, stack: str) -> Answer:
    """One `bench ask` in a process of its own; its predicted row, or how the process ended."""
    command = [sys.executable, "-m", "bench", "--results-dir", str(config_path.parent), "ask", str(config_path),
               "--seq", "128", "--stack", stack, "--json"]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Answer(model_type, stack, "timeout", why=f"no answer in {TIMEOUT_S} s")
    try:
        row = json.loads(done.stdout)["predicted"]
    except (json.JSONDecodeError, KeyError, TypeError):
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return Answer(model_type, stack, "refused" if done.returncode == 2 else "crashed", why=_short(tail))
    reason = row.get("unsupported_reason") or row.get("skip_reason")
    why = str(reason).strip().splitlines()[0] if reason else _exception(str(row.get("error") or ""))
    return Answer(model_type, stack, str(row.get("status")), row.get("peak_allocated_gib"),
                  row.get("peak_reserved_gib"), _short(why))


def _stop_past(max_gib: float) -> None:
    """Ends this process once its resident memory passes `max_gib`: a config whose buffers are sized for its full
    context (131,072 positions, say) would otherwise take the machine's memory and the kernel kill more than it."""
    page = os.sysconf("SC_PAGE_SIZE")
    while True:
        resident_gib = int(Path("/proc/self/statm").read_text().split()[1]) * page / 2**30
        if resident_gib > max_gib:
            print(f"MemoryError: the real step passed {max_gib} GiB of host memory", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.1)


WHY_MAX_CHARS = 600  # a reason is one line; peft's refusal with the suite's hint of other targets runs to ~400


def _short(why: str) -> str:
    """A reason or exception as the table gives it: whole up to WHY_MAX_CHARS, else cut there and marked so (an
    exception can carry a tensor's repr)."""
    return why if len(why) <= WHY_MAX_CHARS else why[:WHY_MAX_CHARS] + " [cut]"


def _exception(trace: str) -> str:
    """A traceback's last line: the exception and its message."""
    lines = [line for line in trace.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def runs_for_real(config_path: Path, stack: str) -> str:
    """Whether the shrunk config trains at all under `stack`, outside the fake run: one real step (forward, backward,
    optimizer) of the cell the answer predicted, at 16 tokens, built by the suite's own trainer on the CPU, in a
    process of its own. "" if it runs, else the exception: an answer that errs where the same step runs for real is
    the predictor's failure; where it fails too, the shrinking's, the architecture's or the stack's (peft's LoRA,
    say)."""
    command = [sys.executable, __file__, "--real", str(config_path), "--stack", stack]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"no real step in {TIMEOUT_S} s"
    return "" if done.returncode == 0 else _short(_exception(done.stderr)) or f"exit {done.returncode}"


REAL_STEP_MAX_GIB = 6  # a shrunk config's real step takes well under 1 GiB; one that grows past this is stopped
REAL_SEQ = 16  # tokens of the real step: enough for every layer kind, seconds on a CPU


def _real_step(config_path: Path, stack: str) -> None:
    """The cell's step for real: the stack as `bench run` builds it (bf16 weights, its techniques, its engine), on
    the CPU, one optimizer step. A stack the CPU cannot run (CUDA kernels) raises, saying so."""
    threading.Thread(target=_stop_past, args=(REAL_STEP_MAX_GIB,), daemon=True).start()
    from bench import cells, envinfo, models, spec, trainer

    name = models.register_file(config_path)
    matrix = spec.from_mapping("real", {"device": "cpu", "models": [name], "seq_lens": [REAL_SEQ],
                                        "batch_sizes": [1], "stacks": [stack]})
    (planned,) = cells.plan(matrix, envinfo.host_caps())
    if planned.skip_reason:
        raise RuntimeError(f"not run on the CPU: {planned.skip_reason}")
    run = trainer.build(planned.cell)
    run.step(run.batches()[0])


FAILED = ("error", "crashed", "timeout")  # an answer that says nothing of the architecture: checked for real


def markdown(answers: list[Answer], stacks: list[str], versions: str) -> str:
    """The table: a row per model type, a column per stack; where an answer failed, whether its step runs for real."""
    by_type: dict[str, dict[str, Answer]] = {}
    for a in answers:
        by_type.setdefault(a.model_type, {})[a.stack] = a
    counts = {s: sum(by_type[t][s].status == "ok" for t in by_type) for s in stacks}
    failed = [a for a in answers if a.status in FAILED]
    theirs = sum(a.real_step == "" for a in failed)
    lines = [f"# Which architectures `bench predict` predicts ({versions})", "",
             "Each causal-LM model type of transformers, its defaults shrunk to two narrow layers, asked about at seq "
             "128 batch 1 on an H100 (`tools/model_types.py`). Predictions (fake runs on a CPU), not measurements: "
             "the peaks say the step ran, not what the full-size model needs. Where an answer failed, the same cell's "
             f"step was run for real: built by the suite's trainer on the CPU, {REAL_SEQ} tokens, one optimizer step. "
             "If it runs, the failure is the predictor's; if it fails too, the shrinking's, the architecture's or the "
             "stack's on it (peft's LoRA, say). Generated; never edited by hand.", "",
             "; ".join(f"`{s}`: {counts[s]} of {len(by_type)} predicted" for s in stacks) +
             f"; {theirs} failed answers whose step runs for real, {len(failed) - theirs} whose step fails for real "
             "too.", "",
             "| model type | " + " | ".join(f"`{s}`" for s in stacks) + " |",
             "|---|" + "---|" * len(stacks)]
    for model_type in sorted(by_type):
        lines.append(f"| {model_type} | " + " | ".join(_cell(by_type[model_type][s]) for s in stacks) + " |")
    return "\n".join(lines) + "\n"


def _cell(a: Answer) -> str:
    if a.status == "ok":
        return f"ok: {a.peak_allocated_gib:.3f} / {a.peak_reserved_gib:.3f} GiB"
    why = re.sub(r"\S*/([^/\s]+/config\.json)", r"\1", a.why)  # the config's temporary folder, named by its type
    said = f"**{a.status}**: {in_cell(why)}"
    if a.real_step is None:
        return said
    if a.real_step == "":
        return said + "; **runs for real**"
    same = a.real_step[:80] == a.why[:80]  # an error's exception, or the real step's within its first 80 characters
    return said + ("; fails for real too" if same else f"; fails for real: {in_cell(a.real_step)}")


def versions() -> str:
    """The releases the answers were asked under: peft's too, whose `all-linear` decides what `gc + lora` adapts."""
    import peft
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"


def shrunk_configs(folder: Path, chosen: list[str]) -> dict[str, Path]:
    """Each model type's shrunk config written as FOLDER/TYPE/config.json, as a user's download would bring it."""
    paths = {}
    for model_type in chosen:
        paths[model_type] = folder / model_type / "config.json"
        paths[model_type].parent.mkdir()
        paths[model_type].write_text(json.dumps(shrunk(model_type)))
    return paths


def answer_all(chosen: list[str], stacks: list[str], jobs: int) -> list[Answer]:
    """Every (model type, stack) answered, `jobs` at a time; a failed answer with whether its step runs for real."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = shrunk_configs(Path(tmp), chosen)
        questions = [(t, s) for t in chosen for s in stacks]
        with ThreadPoolExecutor(jobs) as pool:
            answers = list(pool.map(lambda q: _said(ask(paths[q[0]], *q)), questions))
            return list(pool.map(lambda a: a if a.status not in FAILED else
                                 replace(a, real_step=runs_for_real(paths[a.model_type], a.stack)), answers))


def record(answers: list[Answer]) -> dict[str, Any]:
    """What `--out` keeps beside its table (NAME.json), for a later `--baseline`."""
    return {"versions": versions(), "answers": [asdict(a) for a in answers]}


def lost(baseline: dict[str, Any], answers: list[Answer]) -> list[str]:
    """The (model type, stack) answers the baseline predicted that are asked again and no longer predict: a release
    or a change that stopped an architecture's prediction. A model type or stack not asked now is not counted."""
    now = {(a.model_type, a.stack): a for a in answers}
    return [f"{t} / {s}: {now[t, s].status}: {now[t, s].why}" for t, s in
            sorted((b["model_type"], b["stack"]) for b in baseline["answers"] if b["status"] == "ok")
            if (t, s) in now and now[t, s].status != "ok"]


def moved(baseline: dict[str, Any], answers: list[Answer]) -> list[str]:
    """The answers predicted in the baseline and now whose peak allocated moved by more than MOVED_PCT: not a failure
    (a release may rightly change what a step holds, as peft 0.22's `all-linear` took in MoE routers and experts
    that 0.21 left out), but said, so that a move is looked into rather than found by a user."""
    now = {(a.model_type, a.stack): a for a in answers if a.status == "ok" and a.peak_allocated_gib}
    lines = []
    for b in sorted(baseline["answers"], key=lambda b: (b["model_type"], b["stack"])):
        a, before = now.get((b["model_type"], b["stack"])), b.get("peak_allocated_gib")
        if b["status"] != "ok" or not a or not before:
            continue
        change_pct = (a.peak_allocated_gib / before - 1) * 100
        if abs(change_pct) > MOVED_PCT:
            lines.append(f"{a.model_type} / {a.stack}: {before:.4f} -> {a.peak_allocated_gib:.4f} GiB ({change_pct:+.2f}%)")
    return lines


def against(baseline_name: str, gone: list[str], shifted: list[str]) -> str:
    """The table's last section: what no longer predicts (the gate's failure), then what moved."""
    text = (f"\nAgainst {baseline_name}: " + (f"{len(gone)} answers it predicted no longer predict:\n\n"
            + "\n".join(f"- {line}" for line in gone) if gone else "every answer it predicted still predicts.") + "\n")
    if shifted:
        text += (f"\n{len(shifted)} answers' peak allocated moved by more than {MOVED_PCT:g}% (not a failure):\n\n"
                 + "\n".join(f"- {line}" for line in shifted) + "\n")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", action="append", help="a stack as in matrix.yaml; again for another "
                        "(default: gc + lora, mixed)")
    parser.add_argument("--only", help="model types, comma-separated (default: every text one)")
    parser.add_argument("--jobs", type=int, default=1, help="answers side by side (default 1)")
    parser.add_argument("--out", type=Path, help="the markdown table, and beside it the answers as JSON (default: "
                        "the table printed)")
    parser.add_argument("--baseline", type=Path, help="an earlier --out's JSON: exit 1 if an answer it predicted no "
                        "longer predicts")
    parser.add_argument("--render", type=Path, help="an earlier --out's JSON: its table written again (to --out, "
                        "else beside it), nothing asked")
    parser.add_argument("--real", type=Path, help=argparse.SUPPRESS)  # runs_for_real's process: one real step
    args = parser.parse_args()
    if args.real:
        _real_step(args.real, (args.stack or ["baseline"])[0])
        return 0
    problem = _problem(args)
    if problem:
        print(f"model_types: {problem}", file=sys.stderr)
        return 2
    if args.render:
        kept = json.loads(args.render.read_text())
        answers, asked_under = [Answer(**a) for a in kept["answers"]], kept["versions"]
        stacks = list(dict.fromkeys(a.stack for a in answers))
    else:
        stacks = args.stack or ["gc + lora", "mixed"]
        answers = answer_all(args.only.split(",") if args.only else text_model_types(), stacks, args.jobs)
        asked_under = versions()
    text = markdown(answers, stacks, asked_under)
    gone: list[str] = []
    if args.baseline:
        baseline = json.loads(args.baseline.read_text())
        gone = lost(baseline, answers)
        text += against(args.baseline.name, gone, moved(baseline, answers))
    out = args.out or (args.render.with_suffix(".md") if args.render else None)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        if not args.render:
            out.with_suffix(".json").write_text(json.dumps(record(answers), indent=1) + "\n")
    else:
        print(text, end="")
    return 1 if gone else 0


def _problem(args: argparse.Namespace) -> str:
    """What is wrong with the arguments, or ""."""
    unknown = sorted(set(args.only.split(",")) - set(text_model_types())) if args.only else []
    missing = [path for path in (args.baseline, args.render) if path and not path.is_file()]
    if unknown:
        return "not text causal-LM model types here: " + ", ".join(unknown)
    if missing:
        return f"no such file: {missing[0]}"
    return "--jobs must be 1 or more" if args.jobs < 1 else ""


def _said(a: Answer) -> Answer:
    print(f"{a.status:<12} {a.model_type:<28} {a.stack}  {a.why}", file=sys.stderr, flush=True)
    return a


if __name__ == "__main__":
    sys.exit(main())
