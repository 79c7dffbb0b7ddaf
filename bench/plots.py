"""Parquet -> PNG plots, linked from the leaderboard. Generated, never edited by hand.

- peak memory vs sequence length, one panel per batch, one line per stack, with the GPU's capacity line;
- tokens/s vs peak memory, one panel per sequence length (up and to the left is better): the batch
  written by each marker, the Pareto front joined, the capacity line, the stacks' key outside the data;
- where the memory goes: weights, gradients, optimizer state, and the rest of the allocated peak
  (activations and temporaries) per stack, from the tensors the worker measured;
- memory against recompute: the checkpointing policies (gc, selective_gc, compile's memory budget)
  of one cell, predicted (extra FLOPs per step, the fake run's count) beside measured (step time).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .stacks import BASELINE, parse_stack
from .views import by_cell, peak_column


def write_plots(frame: pd.DataFrame, out_dir: Path, predicted: pd.DataFrame | None = None) -> list[Path]:
    """One set of plots per model (with the matrix's predictions, where given); returns the files
    written (none if matplotlib is missing)."""
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
        if predicted is not None:
            mine = predicted[(predicted["model"] == model) & (predicted["status"] == "ok") & (predicted["gpus"] == 1)]
            written.append(_recompute(group, mine, out_dir / f"{model}_memory_vs_recompute.png"))
    return [p for p in written if p is not None]


def headline_batch(group: pd.DataFrame) -> int:
    """The batch size measured for the most stacks (ties: the larger): where stacks compare best."""
    counts = group.groupby("batch_size")["stack"].nunique()
    return int(max(counts.index, key=lambda b: (counts[b], b)))


# Ten colours that stay apart for colour-blind readers (Okabe-Ito and Tableau), times four marker
# shapes: 40 stacks before a pair repeats. The page (bench/site/site.js) uses the same ones.
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#000000", "#8C564B", "#7F7F7F",
           "#BCBD22")
MARKERS = ("o", "s", "^", "D")
PEAK_LABELS = {
    "peak_reserved_gib": "peak reserved GPU memory (GiB)",
    "peak_allocated_gib": "peak allocated GPU memory (GiB)",
    "host_rss_peak_gib": "peak host RSS (GiB)",
}


def stack_styles(stacks: list[str]) -> dict[str, tuple[str, str]]:
    """Stack -> (colour, marker), baseline first, the same in every panel of a figure."""
    ordered = sorted(stacks, key=lambda s: (s != BASELINE, s))
    return {st: (COLOURS[i % len(COLOURS)], MARKERS[i // len(COLOURS) % len(MARKERS)]) for i, st in enumerate(ordered)}


def _panels(n: int, width: float = 5.6, height: float = 4.2):
    """n panels, two to a row, sharing the y axis; unused panels removed."""
    import matplotlib.pyplot as plt

    cols = min(n, 2)
    rows = -(-n // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(width * cols + 2.4, height * rows), squeeze=False, sharey=True)
    axes = list(grid.flat)
    for ax in axes[n:]:
        ax.remove()
    for ax in axes[:n]:
        ax.yaxis.set_tick_params(labelleft=True)
    return fig, axes[:n]


def _capacity(ax, group: pd.DataFrame, mem_col: str, vertical: bool) -> None:
    capacity = group["gpu_memory_gib"].dropna()
    if mem_col == "peak_reserved_gib" and len(capacity):
        gib_total = float(capacity.iloc[0])
        line = ax.axvline if vertical else ax.axhline
        line(gib_total, color="#b42318", linestyle="--", linewidth=1.2)
        text = f"capacity {gib_total:.1f} GiB"
        if vertical:
            ax.text(gib_total, 0.98, text + " ", transform=ax.get_xaxis_transform(), ha="right", va="top",
                    color="#b42318", fontsize=7)
        else:
            ax.text(0.01, gib_total, text, transform=ax.get_yaxis_transform(), va="bottom", color="#b42318", fontsize=7)


def _legend(fig, styles: dict[str, tuple[str, str]], extra: list | None = None) -> None:
    """The stacks' key, outside the panels (right), so it never covers data."""
    import matplotlib.pyplot as plt

    handles = [plt.Line2D([], [], color=c, marker=m, linestyle="", markeredgecolor="black", markeredgewidth=0.4,
                          label=st) for st, (c, m) in styles.items()]
    fig.legend(handles=handles + (extra or []), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7,
               frameon=False)


def _memory_vs_seq(group: pd.DataFrame, mem_col: str, path: Path) -> Path | None:
    """One panel per batch size measured at two or more sequence lengths: a line per stack."""
    import matplotlib.pyplot as plt

    batches = [b for b, sub in group.groupby("batch_size") if sub["seq_len"].nunique() >= 2]
    if not batches:
        return None
    styles = stack_styles(list(group["stack"].unique()))
    fig, axes = _panels(len(batches))
    seqs = sorted(int(x) for x in group["seq_len"].unique())
    for ax, batch in zip(axes, sorted(batches), strict=True):
        for stack, s in group[group["batch_size"] == batch].groupby("stack"):
            if s["seq_len"].nunique() >= 2:
                s = s.sort_values("seq_len")
                colour, mark = styles[stack]
                ax.plot(s["seq_len"], s[mem_col], marker=mark, color=colour, markeredgecolor="black",
                        markeredgewidth=0.4, linewidth=1.2)
        _capacity(ax, group, mem_col, vertical=False)
        ax.set(xscale="log", xlabel="sequence length (tokens)", title=f"batch {batch}")
        ax.set_xticks(seqs, labels=[str(x) for x in seqs])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.grid(alpha=0.3)
    for ax in axes:
        ax.set_ylabel(PEAK_LABELS.get(mem_col, mem_col))
    fig.suptitle(f"{group['model'].iloc[0]}: peak memory vs sequence length", fontsize=11)
    lines = {st for b in batches for st, s in group[group["batch_size"] == b].groupby("stack") if s["seq_len"].nunique() >= 2}
    _legend(fig, {st: style for st, style in styles.items() if st in lines})
    return _write(fig, path)


def _pareto(group: pd.DataFrame, mem_col: str, path: Path) -> Path | None:
    """One panel per sequence length: tokens/s vs peak memory, the batch written by each marker, the
    Pareto front joined (no other cell is both smaller and faster), the card's capacity dashed."""
    seqs = sorted(int(x) for x in group["seq_len"].unique())
    styles = stack_styles(list(group["stack"].unique()))
    fig, axes = _panels(len(seqs))
    for ax, seq in zip(axes, seqs, strict=True):
        sub = group[group["seq_len"] == seq]
        for _, r in sub.iterrows():
            colour, mark = styles[r["stack"]]
            ax.scatter(r[mem_col], r["tokens_per_s"], color=colour, marker=mark, s=36, edgecolors="black",
                       linewidths=0.4, zorder=3)
            ax.annotate(str(int(r["batch_size"])), (r[mem_col], r["tokens_per_s"]), xytext=(4, 3),
                        textcoords="offset points", fontsize=6.5, color="#333333")
        front = pareto_front(sub, mem_col)
        ax.plot(front[mem_col], front["tokens_per_s"], color="black", alpha=0.45, linewidth=1, zorder=2)
        _capacity(ax, group, mem_col, vertical=True)
        ax.set(xlabel=PEAK_LABELS.get(mem_col, mem_col), title=f"seq {seq}")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in axes:
        ax.set_ylabel("tokens/s")
    fig.suptitle(f"{group['model'].iloc[0]}: throughput vs peak memory (number by a marker = batch; "
                 "line = Pareto front)", fontsize=11)
    _legend(fig, styles)
    return _write(fig, path)


def pareto_front(cells: pd.DataFrame, mem_col: str) -> pd.DataFrame:
    """Cells no other cell beats on both memory (smaller) and tokens/s (larger), by memory."""
    ordered = cells.sort_values([mem_col, "tokens_per_s"], ascending=[True, False])
    speed = ordered["tokens_per_s"].astype(float)
    faster = speed > speed.cummax().shift(fill_value=float("-inf"))
    return ordered[faster]


def _write(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
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
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)  # beside the bars, not on them
    return _write(fig, path)


# What trades activation memory for recomputation: a stack of these alone (or the baseline) is a
# checkpointing policy.
RECOMPUTE_TECHNIQUES = frozenset({"gc", "selective_gc", "compile"})


def _policies(cells: pd.DataFrame) -> pd.DataFrame:
    def is_policy(stack: str) -> bool:
        return stack == BASELINE or set(parse_stack(stack).names) <= RECOMPUTE_TECHNIQUES

    return cells[cells["stack"].map(is_policy).astype(bool)]


def _recompute(measured: pd.DataFrame, predicted: pd.DataFrame, path: Path) -> Path | None:
    """The checkpointing policies of one cell (the predictions' middle sequence length and batch):
    peak allocated against what recomputation costs. Left, predicted: FLOPs per step over the
    baseline's (the fake run's count: matmuls and attention recomputed). Right, measured: step time
    over the baseline's, where the GPU ran them. None without three predicted policies."""
    import matplotlib.pyplot as plt

    if predicted.empty or "step_tflop" not in predicted:
        return None
    seq = sorted(predicted["seq_len"].unique())[(predicted["seq_len"].nunique() - 1) // 2]
    batch = sorted(predicted["batch_size"].unique())[(predicted["batch_size"].nunique() - 1) // 2]
    at = {name: _policies(f[(f["seq_len"] == seq) & (f["batch_size"] == batch)]).set_index("stack")
          for name, f in (("predicted", predicted.dropna(subset=["step_tflop"])), ("measured", measured))}
    if len(at["predicted"]) < 3 or BASELINE not in at["predicted"].index:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    base = at["predicted"].loc[BASELINE]
    _policy_points(left, at["predicted"], 100 * (at["predicted"]["step_tflop"] / base["step_tflop"] - 1))
    left.set(xlabel="PREDICTED extra FLOPs per step over the baseline (%)", ylabel="PREDICTED peak allocated (GiB)",
             title="predicted (fake run)")
    if BASELINE in at["measured"].index and len(at["measured"]) >= 2:
        speed = at["measured"]["tokens_per_s"]
        _policy_points(right, at["measured"], 100 * (speed[BASELINE] / speed - 1))
        right.set(xlabel="measured step time over the baseline (%)", ylabel="measured peak allocated (GiB)",
                  title=f"measured ({at['measured']['gpu_name'].iloc[0]})")
    else:
        right.text(0.5, 0.5, "not measured on a GPU yet", ha="center", va="center", transform=right.transAxes)
        right.set_axis_off()
    fig.suptitle(f"{predicted['model'].iloc[0]}, seq {seq}, batch {batch}: activation memory against recompute",
                 fontsize=11)
    return _write(fig, path)


def _policy_points(ax, cells: pd.DataFrame, cost_pct: pd.Series) -> None:
    """A marker per policy at (cost, peak allocated), its stack written beside it."""
    for stack, row in cells.iterrows():
        ax.scatter(cost_pct[stack], row["peak_allocated_gib"], color="#0072B2", edgecolors="black", linewidths=0.4,
                   zorder=3)
        ax.annotate(str(stack), (cost_pct[stack], row["peak_allocated_gib"]), xytext=(4, 3),
                    textcoords="offset points", fontsize=6.5)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
