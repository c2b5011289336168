"""The expert-load heatmap figure: colour scale, EP blocks and readable ticks from EP1 to EP64."""

import numpy as np
import pytest

from megatron_ext.moe.load_figures import LOAD_VMAX, draw_load_heatmap, heatmap_figure_image, new_figure


def _random_load(layers, experts, seed):
    counts = np.random.default_rng(seed).gamma(2.0, 100.0, size=(layers, experts))
    return counts / counts.mean(axis=1, keepdims=True)


@pytest.mark.parametrize("layers,experts,ep_size", [(3, 4, 1), (3, 4, 2), (48, 256, 8), (48, 256, 64)])
def test_heatmap_marks_rank_blocks_and_keeps_tick_labels_readable(layers, experts, ep_size):
    load = _random_load(layers, experts, seed=ep_size)
    fig = new_figure(10, 5.6)
    ax = fig.add_subplot()
    layer_numbers = list(range(2, 2 + layers))
    draw_load_heatmap(fig, ax, load, layer_numbers, ep_size, title="t")
    (image,) = ax.images
    np.testing.assert_array_equal(image.get_array(), load)
    # Rank blocks: a line between each pair of neighbouring ranks' contiguous experts.
    boundaries = sorted(line.get_xdata()[0] for line in ax.lines)
    assert boundaries == pytest.approx([r * experts / ep_size - 0.5 for r in range(1, ep_size)])
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0] == "2" and len(labels) <= 24 and set(labels) <= {str(n) for n in layer_numbers}
    if ep_size > 1:
        (top,) = ax.child_axes
        ranks = [t.get_text() for t in top.get_xticklabels()]
        assert ranks[0] == "0" and 2 <= len(ranks) <= 16
    # Colour scale of load over the mean: balanced is white, 0 deep blue, >= LOAD_VMAX deep red.
    white, cold, hot = image.to_rgba(np.array([1.0, 0.0, LOAD_VMAX * 3]))[:, :3]
    assert white == pytest.approx([1, 1, 1], abs=0.06)
    assert cold[2] > 0.3 > cold[0] and hot[0] > 0.3 > hot[2]


def test_heatmap_image_has_the_same_size_for_any_model():
    small = heatmap_figure_image(_random_load(3, 4, 0), [2, 3, 4], 2, title="small")
    large = heatmap_figure_image(_random_load(48, 256, 1), list(range(48)), 64, title="large")
    assert small.shape == large.shape == (560, 1000, 3) and small.dtype == np.uint8
    for img in (small, large):
        # Red and blue cells are drawn (the random loads straddle the mean); the colour bar is right of x = 800.
        img = img[:, :800]
        reddish = (img[..., 0].astype(int) - img[..., 2] > 80).sum()
        bluish = (img[..., 2].astype(int) - img[..., 0] > 80).sum()
        assert reddish > 1000 and bluish > 1000
