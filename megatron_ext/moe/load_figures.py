"""Figures of the MoE expert load: the ``layers x experts`` heatmap and MaxVio over iterations.

Used by the training loop (the heatmap as a TensorBoard image, :func:`heatmap_figure_image`) and by
``tools/expert_load.py --plot``. Sized for up to 256 experts and 48 layers: the figure has a fixed
size and the tick labels thin out, so the cells shrink instead of the labels overlapping.

matplotlib is imported inside the functions (object API with the Agg canvas, no pyplot state), so a
run that writes no images never imports it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Colour scale of the heatmap: load over the layer's mean, blue = cold, white = balanced, red = hot;
# fixed so that images of different steps and runs compare (loads above 2x share the darkest red).
LOAD_VMAX = 2.0
HEATMAP_SIZE_INCHES = (10.0, 5.6)
DPI = 100


def _thinned(positions: Sequence[float], labels: Sequence[str], at_most: int) -> tuple[list, list]:
    step = max(1, -(-len(positions) // at_most))
    return list(positions[::step]), list(labels[::step])


def draw_load_heatmap(fig, ax, load_over_mean: np.ndarray, layers: Sequence[int], ep_size: int, title: str) -> None:
    """``load_over_mean [layers, E]`` on ``ax`` with labelled axes, a colour bar, and the EP ranks'
    contiguous expert blocks separated by lines and named on the top axis."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import MaxNLocator

    m = np.asarray(load_over_mean, dtype=np.float64)
    num_layers, num_experts = m.shape
    image = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="RdBu_r",
                      norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=LOAD_VMAX))
    bar = fig.colorbar(image, ax=ax, extend="max", fraction=0.04, pad=0.02)
    bar.set_label("tokens / layer mean (1 = balanced)")
    ax.set_xlabel("expert")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    ax.set_ylabel("layer")
    rows, names = _thinned(list(range(num_layers)), [str(layer) for layer in layers], at_most=24)
    ax.set_yticks(rows, names)
    ax.set_title(f"{title}   (MaxVio max {float((m.max(axis=1) - 1).max()):.3f})" if m.size else title)
    if ep_size > 1:
        block = num_experts / ep_size
        for r in range(1, ep_size):
            ax.axvline(r * block - 0.5, color="black", linewidth=0.8 if ep_size <= 16 else 0.4)
        top = ax.secondary_xaxis("top")
        centres, ranks = _thinned([(r + 0.5) * block - 0.5 for r in range(ep_size)],
                                  [str(r) for r in range(ep_size)], at_most=16)
        top.set_xticks(centres, ranks)
        top.set_xlabel("EP rank (its experts between the lines)")


def draw_maxvio_curves(ax, curves: dict[str, tuple[Sequence[int], Sequence[float]]], title: str) -> None:
    """One line per label (e.g. a layer, or a run's mean over layers) of MaxVio against iteration."""
    for label, (iterations, values) in curves.items():
        ax.plot(iterations, values, label=label, linewidth=1.2)
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("MaxVio = (max load - mean) / mean")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    if 0 < len(curves) <= 12:
        ax.legend(fontsize="small", ncol=2)


def new_figure(width_inches: float, height_inches: float):
    """A pyplot-free figure with an Agg canvas (safe in any process, no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_inches, height_inches), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure_rgb(fig) -> np.ndarray:
    """The rendered figure as an ``[H, W, 3]`` uint8 array (what ``add_image`` takes)."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def heatmap_figure_image(load_over_mean: np.ndarray, layers: Sequence[int], ep_size: int, title: str) -> np.ndarray:
    """The heatmap as an image array for TensorBoard (1000 x 560 pixels)."""
    fig = new_figure(*HEATMAP_SIZE_INCHES)
    draw_load_heatmap(fig, fig.add_subplot(), load_over_mean, layers, ep_size, title=f"expert load, {title}")
    return figure_rgb(fig)
