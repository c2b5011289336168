"""tools/sweep_attnres_kernels.py's accounting of profiled kernels (the GPU sweep itself runs on the GPU only)."""

import pytest

from tools.sweep_attnres_kernels import KERNELS, kernel_times

FWD, BWD, FINISH = "_depth_attention_fwd_kernel", "_depth_attention_bwd_preload_kernel", "_depth_attention_finish_kernel"
assert (KERNELS[FWD], KERNELS[BWD], KERNELS[FINISH]) == ("fwd", "bwd", "finish")


def _steps(durations_per_step):
    """Events (name, start, us) of consecutive steps, each a list of (name, us) in launch order."""
    events, clock = [], 0.0
    for step in durations_per_step:
        for name, us in step:
            events.append((name, clock, us))
            clock += us + 1.0
    return events


def test_kernel_times_groups_per_step_and_per_call_means():
    first = [(FWD, 10.0), ("gemm", 100.0), (FWD, 20.0), (BWD, 40.0), (FINISH, 3.0), (BWD, 60.0), (FINISH, 5.0)]
    second = [(FWD, 12.0), ("gemm", 90.0), (FWD, 22.0), (BWD, 44.0), (FINISH, 3.0), (BWD, 64.0), (FINISH, 7.0)]
    events = _steps([first, second])
    got = kernel_times(events[::-1], steps=2)  # any order in: sorted by start time
    assert got["fwd"] == pytest.approx((10 + 20 + 12 + 22) / 1e3 / 2)
    assert got["bwd"] == pytest.approx((40 + 60 + 44 + 64) / 1e3 / 2)
    assert got["finish"] == pytest.approx((3 + 5 + 3 + 7) / 1e3 / 2)
    assert got["other"] == pytest.approx(190 / 1e3 / 2)
    assert got["attn_res"] == pytest.approx(got["fwd"] + got["bwd"] + got["finish"], abs=1e-4)
    assert got["calls"] == {"fwd": [11.0, 21.0], "bwd": [42.0, 62.0], "finish": [3.0, 6.0]}


def test_kernel_times_refuses_steps_that_differ():
    events = _steps([[(BWD, 40.0), (BWD, 50.0)], [(BWD, 41.0)]])
    with pytest.raises(ValueError, match="3 bwd kernels are not 2 equal steps"):
        kernel_times(events, steps=2)
