"""The tuner's pictures, as PNG files (matplotlib, no display needed).

  alpha_by_layer.png        how often the exit-k draft agrees with the full model, for every k,
                            beside c(k): where drafting is accurate and what it costs
  speedup_heatmap.png       speedup over AR for every (k, γ) predicted, plus prompt lookup's row:
                            green speeds up, red slows down; timed cells show "predicted/measured"
  predicted_vs_measured.png the timed candidates, predicted against measured speedup
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_plots(result, directory: str | Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import MaxNLocator

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []

    # 1. α by exit layer, c(k) beside it.
    fig, ax = plt.subplots(figsize=(7, 4))
    ks = sorted(result.lens_agreement)
    ax.plot(ks, [result.lens_agreement[k] for k in ks], "o-", color="tab:blue", label="draft = AR token (α at position 1)")
    ax.set_xlabel("exit layer k")
    ax.set_ylabel("agreement with the full model", color="tab:blue")
    ax.set_ylim(0, 1)
    cost = ax.twinx()
    cost.plot(ks, [result.costs.draft[k] for k in ks], "s--", color="tab:orange", label="c(k)")
    cost.set_ylabel("c: draft token / full step (measured)", color="tab:orange")
    cost.set_ylim(0, max(1.05, max(result.costs.draft[k] for k in ks) * 1.05))
    ax.set_title(f"{title}\nexit-layer acceptance and draft cost")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    written.append(_save(fig, directory / "alpha_by_layer.png"))

    # 2. Speedup over k × γ (and lookup by γ).
    gammas = list(range(1, result.max_draft_len + 1))
    rows = [f"k={k}" for k in result.exit_layers]
    by_key = {(c.exit_layer if c.method == "early-exit" else "lookup", c.draft_len): c for c in result.candidates}
    keys = list(result.exit_layers)
    if any(c.method == "lookup" for c in result.candidates):
        rows.append("lookup")
        keys.append("lookup")
    grid = np.array([[by_key[(key, g)].predicted for g in gammas] for key in keys])
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 + 0.75 * len(gammas)), 1.6 + 0.45 * len(rows)))
    lo, hi = min(grid.min(), 0.99), max(grid.max(), 1.01)
    image = ax.imshow(grid, cmap="RdYlGn", norm=TwoSlopeNorm(vmin=lo, vcenter=1.0, vmax=hi), aspect="auto")
    for r, key in enumerate(keys):
        for col, g in enumerate(gammas):
            c = by_key[(key, g)]
            text = f"{c.predicted:.2f}" if c.measured is None else f"{c.predicted:.2f}\n/{c.measured:.2f}"
            ax.text(col, r, text, ha="center", va="center", fontsize=7,
                    fontweight="bold" if c.measured is not None else "normal")
    ax.set_xticks(range(len(gammas)), [str(g) for g in gammas])
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("draft length γ")
    ax.set_title(f"{title}\nspeedup over AR predicted from measured α, c, v\n(bold: predicted / timed)", fontsize=9)
    fig.colorbar(image, ax=ax, label="× AR")
    written.append(_save(fig, directory / "speedup_heatmap.png"))

    # 3. Predicted against measured.
    fig, ax = plt.subplots(figsize=(5, 5))
    timed = [c for c in result.checked if c.measured is not None]
    xs, ys = [c.predicted for c in timed], [c.measured for c in timed]
    ax.scatter(xs, ys, color="tab:blue")
    for c in timed:
        ax.annotate(c.label, (c.predicted, c.measured), fontsize=7, xytext=(3, 3), textcoords="offset points")
    span = [min(xs + ys + [1.0]) * 0.9, max(xs + ys + [1.0]) * 1.1]
    ax.plot(span, span, "k--", lw=1, label="measured = predicted")
    ax.axhline(1.0, color="tab:red", lw=1, label="AR")
    ax.set_xlim(span)
    ax.set_ylim(span)
    ax.set_xlabel("predicted speedup (× AR)")
    ax.set_ylabel("measured speedup (× AR, timed)")
    ax.set_title(f"{title}\npredicted vs measured", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    written.append(_save(fig, directory / "predicted_vs_measured.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
