"""tools/gpu_idle.py: idle gaps between kernels and who they are charged to."""

import pytest
import torch

from tools.gpu_idle import Span, SyncCensus, idle_summary, spans_from_profile


def test_idle_summary_charges_gaps_to_the_next_launch_and_the_sync_inside():
    kernels = [Span(45, 50, "e"), Span(0, 10, "a"), Span(5, 12, "b"),  # a and b overlap (two streams)
               Span(20, 30, "c"), Span(30, 40, "d"), Span(41, 41.5, "f")]
    syncs = [Span(3, 8, "during a"), Span(13, 18, "item")]  # the first ends while the device is busy
    s = idle_summary(kernels, syncs, min_gap_us=2.0)
    assert s["busy_us"] == pytest.approx(12 + 10 + 10 + 0.5 + 5)
    assert s["idle_us"] == pytest.approx(8 + 1 + 3.5)
    assert s["gaps"] == 3
    # the 1 us gap before f is counted but not attributed
    assert s["by_next"] == {"c": [8.0, 1], "e": [3.5, 1]}
    assert s["by_sync"] == {"item": [8.0, 1]}


def test_idle_summary_random_spans_add_up():
    gen = torch.Generator().manual_seed(0)
    starts = torch.rand(200, generator=gen) * 1000
    lengths = torch.rand(200, generator=gen) * 20
    kernels = [Span(float(s), float(s + l), f"k{i % 7}") for i, (s, l) in enumerate(zip(starts, lengths))]
    s = idle_summary(kernels, [])
    first = min(k.start for k in kernels)
    last = max(k.end for k in kernels)
    assert s["busy_us"] + s["idle_us"] == pytest.approx(last - first)
    assert sum(us for us, _ in s["by_next"].values()) == pytest.approx(s["idle_us"])
    # busy = measure of the union, computed independently on a fine grid
    grid = torch.arange(0, 1100, 0.01)
    covered = torch.zeros_like(grid, dtype=torch.bool)
    for k in kernels:
        covered |= (grid >= k.start) & (grid < k.end)
    assert s["busy_us"] == pytest.approx(covered.sum().item() * 0.01, abs=0.5)


def _sync_here(census):
    census._record("called a synchronizing CUDA operation", UserWarning, __file__, 1)


def test_sync_census_names_the_innermost_frame_in_the_repository():
    census = SyncCensus(census_step=3)
    _sync_here(census)
    _sync_here(census)
    (site, count), = census.sites.items()
    assert count == 2
    assert site.startswith("tests/tools/test_gpu_idle.py:") and site.endswith(" _sync_here")


@pytest.mark.gpu
def test_spans_from_profile_labels_kernels_and_syncs():
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1 << 20, device="cuda")
    for _ in range(2):  # loaded before the profile (CUDA loads kernels lazily, at their first launch)
        torch.sin(x * 2 + 1).sum().item()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        y = x * 2
        y.sum().item()
        torch.sin(y + 1)
        torch.cuda.synchronize()
    kernels, syncs = spans_from_profile(prof)
    labels = {k.label for k in kernels}
    assert {"aten::mul", "aten::add", "aten::sin"} <= labels, labels
    assert any("item" in s.label or "_local_scalar_dense" in s.label for s in syncs), syncs
    s = idle_summary(kernels, syncs)
    # the device is busy for a few microseconds, not for the whole profile (annotations are not kernels)
    assert 0 < s["busy_us"] < 0.5 * (max(k.end for k in kernels) - min(k.start for k in kernels)), s
    assert s["by_sync"], s
