"""PNG plots (matplotlib, headless): decode throughput per card against TPOT."""
from __future__ import annotations


def plot_curves(curves: dict, path: str, tpot_slo_ms: float | None = None,
                published: list[tuple[float, float, str]] | None = None) -> str:
    """curves: label -> list of DecodePoint; published: (tpot_ms, tok_s_card, label) markers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in curves.items():
        ax.plot([p.tpot_ms for p in pts], [p.tok_s_card for p in pts], marker=".", label=label)
    for x, y, label in published or []:
        ax.scatter([x], [y], marker="*", s=120, zorder=5, label=label)
    if tpot_slo_ms:
        ax.axvline(tpot_slo_ms, color="grey", linestyle="--", linewidth=1, label=f"TPOT SLO {tpot_slo_ms:g} ms")
    ax.set_xlabel("TPOT (ms)")
    ax.set_ylabel("decode tokens/s per card")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
