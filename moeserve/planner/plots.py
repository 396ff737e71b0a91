"""PNG plots (matplotlib, headless): decode throughput per card against TPOT."""
from __future__ import annotations

from pathlib import Path


def _figure_formats() -> dict:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    return Figure().canvas.get_supported_filetypes()


def plot_path(path: str, flag: str = "--plot") -> str:
    """The file a plot will be written to ('.png' added when the name has none, as matplotlib would),
    checked before any work is done so a bad path costs no results: the folder must exist and accept the
    file, and the suffix must be an image format."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name such as {p / 'curve.png'}")
    if not p.suffix:
        p = p.with_name(p.name + ".png")
    formats = _figure_formats()
    if p.suffix[1:].lower() not in formats:
        raise ValueError(f"{flag} {path}: {p.suffix!r} is not an image format; use .png "
                         f"(or one of {', '.join('.' + f for f in sorted(formats))})")
    existed = p.exists()
    try:
        with open(p, "ab"):  # the real test: permissions, missing folders, a file where a folder should be
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write it ({err.strerror or err})") from None
    if not existed:
        p.unlink()
    return str(p)


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
    try:
        fig.savefig(path, dpi=120)
    except OSError as err:
        raise ValueError(f"--plot {path}: cannot write it ({err.strerror or err})") from None
    finally:
        plt.close(fig)
    return path
