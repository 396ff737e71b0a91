"""Latency distributions of a bench serve run as one PNG (histograms with percentile markers)."""
from __future__ import annotations

import numpy as np


def plot_latencies(series: dict[str, list[float]], path: str, percentiles: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, values) in zip(axes.flat, series.items()):
        v = np.asarray(values) * 1000.0
        ax.set_title(f"{name.upper()} (ms), n={v.size}")
        if v.size == 0:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
            continue
        ax.hist(v, bins=min(50, max(5, v.size // 4)), color="#4477aa")
        for p in [50.0, *percentiles]:
            x = float(np.percentile(v, p))
            ax.axvline(x, color="#cc3311", linestyle="--", linewidth=1)
            ax.text(x, ax.get_ylim()[1] * 0.9, f"p{p:g}", rotation=90, fontsize=8, color="#cc3311")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
