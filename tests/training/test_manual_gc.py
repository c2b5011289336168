"""megatron_ext/training/manual_gc.py: automatic collection off inside, collections exactly at the interval,
start-up objects frozen out of them, the collector restored on exit (also after an exception)."""

import gc

import pytest

from megatron_ext.training.manual_gc import manual_gc


class _Cycle:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def _collections():
    """A list that gains one entry per finished collection while the callback is installed."""
    seen = []

    def callback(phase, info):
        if phase == "stop":
            seen.append(info["generation"])

    gc.callbacks.append(callback)
    return seen, callback


def test_collects_only_at_the_interval_and_restores_the_collector():
    assert gc.isenabled()
    seen, callback = _collections()
    try:
        with manual_gc(True, interval=3) as after_step:
            assert not gc.isenabled() and gc.get_freeze_count() > 0
            start = len(seen)
            for iteration in range(1, 8):
                for _ in range(5000):  # would trigger generation-0 collections with the collector on
                    _Cycle()
                after_step(iteration)
            # iterations 3 and 6, nothing else
            assert seen[start:] == [2, 2]
        assert gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.callbacks.remove(callback)


def test_frozen_start_up_objects_are_not_scanned():
    survivor = _Cycle()
    with manual_gc(True, interval=1) as after_step:
        # a collection inside only scans what was made after the freeze: the start-up cycle is not tracked
        # by any generation any more (its referrers are found only among unfrozen objects)
        assert all(survivor is not obj for obj in gc.get_objects())
        after_step(1)
    assert any(survivor is obj for obj in gc.get_objects())


def test_disabled_leaves_the_collector_alone_and_errors_restore_it():
    with manual_gc(False, interval=5) as after_step:
        assert gc.isenabled() and gc.get_freeze_count() == 0
        after_step(5)
    with pytest.raises(RuntimeError):
        with manual_gc(True, interval=0):
            raise RuntimeError("a crash inside the training loop")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="manual_gc_interval"):
        with manual_gc(True, interval=-1):
            pass


def test_interval_zero_never_collects():
    seen, callback = _collections()
    try:
        with manual_gc(True, interval=0) as after_step:
            start = len(seen)
            for iteration in range(1, 20):
                for _ in range(2000):
                    _Cycle()
                after_step(iteration)
            assert seen[start:] == []
    finally:
        gc.callbacks.remove(callback)
