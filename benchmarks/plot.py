# SPDX-License-Identifier: Apache-2.0
"""One place for the benchmarks' PNG output (matplotlib is optional)."""

from __future__ import annotations


def save_figure(path: str, draw, **legend) -> None:
    """``draw(ax)`` fills one axes; the figure goes to ``path`` (``legend``: the legend's options).
    Without matplotlib, says so and skips."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    draw(ax)
    ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    _to_palette(path)


def _to_palette(path: str, colors: int = 64) -> None:
    """The PNG with a palette of ``colors`` (a line plot has few): a summary stays a few tens of KiB."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colors)
    small.save(path, optimize=True)


def log2_axes(ax, xlabel: str, ylabel: str, title: str, log_y: bool = False) -> None:
    """The benchmarks' axes: prompt lengths on a log2 x axis, a grid."""
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)


def log_log_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Log axes both ways (latencies against rates), a small wrapped title, a grid."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=7, wrap=True)
    ax.grid(alpha=0.3, which="both")
