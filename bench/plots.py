"""Parquet -> PNG plots, linked from the leaderboard. Generated, never edited by hand.

- peak memory vs sequence length, one line per stack (batch fixed), with the GPU's capacity line;
- tokens/s vs peak memory (the Pareto view: up and to the left is better);
- where the memory goes: weights, gradients, optimizer state, and the rest of the allocated peak
  (activations and temporaries) per stack, from the tensors the worker measured.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .stacks import BASELINE
from .views import by_cell, peak_column


def write_plots(frame: pd.DataFrame, out_dir: Path) -> list[Path]:
    """One set of plots per model; returns the files written (none if matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    mem_col = peak_column(frame)
    cells = by_cell(frame)
    # One-GPU cells only: a multi-GPU cell's per-GPU peak and all-GPU tokens/s do not share these axes.
    ok = cells[(cells["status"] == "ok") & (cells["gpus"] == 1)]
    written = []
    for model, group in ok.groupby("model"):
        written += [
            _memory_vs_seq(group, mem_col, out_dir / f"{model}_memory_vs_seq.png"),
            _pareto(group, mem_col, out_dir / f"{model}_tokens_vs_memory.png"),
            _breakdown(group, out_dir / f"{model}_breakdown.png"),
        ]
    return [p for p in written if p is not None]


def headline_batch(group: pd.DataFrame) -> int:
    """The batch size measured for the most stacks (ties: the larger): where stacks compare best."""
    counts = group.groupby("batch_size")["stack"].nunique()
    return int(max(counts.index, key=lambda b: (counts[b], b)))


def _memory_vs_seq(group: pd.DataFrame, mem_col: str, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    batch = int(group["batch_size"].min())
    sub = group[group["batch_size"] == batch]
    if sub["seq_len"].nunique() < 2:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for stack, s in sub.groupby("stack"):
        if s["seq_len"].nunique() >= 2:
            s = s.sort_values("seq_len")
            ax.plot(s["seq_len"], s[mem_col], marker="o", label=stack)
    capacity = group["gpu_memory_gib"].dropna()
    if mem_col == "peak_reserved_gib" and len(capacity):
        ax.axhline(float(capacity.iloc[0]), color="red", linestyle="--", label=f"GPU capacity {capacity.iloc[0]:.1f} GiB")
    seqs = sorted(int(x) for x in sub["seq_len"].unique())
    ax.set(xlabel="sequence length (tokens)", ylabel=f"{mem_col} (GiB)", xscale="log",
           title=f"{group['model'].iloc[0]}: peak memory vs sequence length, batch {batch}")
    ax.set_xticks(seqs, labels=[str(x) for x in seqs])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    return _save(fig, ax, path)


def _pareto(group: pd.DataFrame, mem_col: str, path: Path) -> Path | None:
    """Colour = stack, marker = sequence length, size = batch."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    stacks = sorted(group["stack"].unique(), key=lambda s: (s != BASELINE, s))
    colours = {st: plt.get_cmap("tab20")(i % 20) for i, st in enumerate(stacks)}
    markers = dict(zip(sorted(group["seq_len"].unique()), "o^sDvP*X", strict=False))
    for (stack, seq), s in group.groupby(["stack", "seq_len"]):
        ax.scatter(s[mem_col], s["tokens_per_s"], s=14 * s["batch_size"] + 12, color=colours[stack],
                   marker=markers[seq], alpha=0.85, edgecolors="black", linewidths=0.4)
    handles = [plt.Line2D([], [], color=colours[st], marker="o", linestyle="", label=st) for st in stacks]
    handles += [plt.Line2D([], [], color="grey", marker=m, linestyle="", label=f"seq {q}") for q, m in markers.items()]
    ax.legend(handles=handles, fontsize=7, ncols=2, loc="best")
    ax.set(xlabel=f"{mem_col} (GiB)", ylabel="tokens/s",
           title=f"{group['model'].iloc[0]}: throughput vs peak memory (marker size = batch)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _breakdown(group: pd.DataFrame, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    seq = int(group["seq_len"].mode().iloc[0])
    at = group[group["seq_len"] == seq]
    batch = headline_batch(at)
    sub = at[at["batch_size"] == batch].set_index("stack")
    if sub["peak_allocated_gib"].isna().any():
        return None  # CPU runs: no allocator counters, no breakdown
    sub = sub.loc[sorted(sub.index, key=lambda s: (s != BASELINE, s))]
    parts = breakdown_gib(sub)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(sub) + 1.5))
    left = pd.Series(0.0, index=sub.index)
    for name, values in parts.items():
        ax.barh(sub.index, values, left=left, label=name)
        left = left + values
    ax.invert_yaxis()
    ax.set(xlabel="GiB at the allocated peak", title=f"{group['model'].iloc[0]}: where the memory goes, seq {seq}, batch {batch}")
    return _save(fig, ax, path)


def breakdown_gib(rows: pd.DataFrame) -> dict[str, pd.Series]:
    """Weights, gradients and optimizer state as measured tensor bytes; the rest of the allocated
    peak is activations and temporaries (it includes the autocast weight copies of `mixed`).
    Caveat: a paged optimizer's state lives in CUDA managed memory, outside peak_allocated_gib, so
    for such stacks the remainder is understated by the state's size."""
    weights, grads, states, peak = (rows[c].astype(float) for c in
                                    ("weights_gib", "grads_gib", "optimizer_state_gib", "peak_allocated_gib"))
    return {
        "weights": weights,
        "gradients": grads,
        "optimizer state": states,
        "activations + temporaries": (peak - weights - grads - states).clip(lower=0),
    }


def _save(fig, ax, path: Path) -> Path:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
