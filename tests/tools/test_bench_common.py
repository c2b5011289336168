"""tools/bench_common's kernel-constant layouts (the sweeps' configs and the benchmarks' A/B rows)."""

import types

import pytest


def test_constants_layout_merges_launch_dicts_inside_and_restores_exactly_after():
    from tools.bench_common import constants_layout

    launch = dict(BV=32, num_warps=4)
    module = types.SimpleNamespace(CONFIG=launch, TILES=(16, 32), FLAG=False)
    with constants_layout(module, {"CONFIG": dict(num_warps=8, num_stages=2), "TILES": (64,), "FLAG": True}):
        assert module.CONFIG == dict(BV=32, num_warps=8, num_stages=2)  # updated, not replaced
        assert module.TILES == (64,) and module.FLAG is True
    # the very objects back: no key the layout added survives
    assert module.CONFIG is launch and launch == dict(BV=32, num_warps=4)
    assert module.TILES == (16, 32) and module.FLAG is False
    with pytest.raises(AttributeError):
        with constants_layout(module, {"CONFG": dict(num_warps=8)}):  # a misspelt name fails up front
            pass
    assert not hasattr(module, "CONFG")
