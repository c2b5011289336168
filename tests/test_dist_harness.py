import os

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_harness_all_reduce_sums_over_ranks():
    results = run_distributed(_allreduce_rank, 2)
    assert results == [3.0, 3.0]


def _environment(rank, world_size, name):
    return os.environ.get(name)


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    return rank


def test_ranks_see_the_callers_environment_at_the_call(monkeypatch):
    # Ranks fork from a server started earlier (tests/_dist.py): the variables must be the caller's now.
    monkeypatch.setenv("DIST_HARNESS_PROBE", "first")
    assert run_distributed(_environment, 2, "DIST_HARNESS_PROBE") == ["first", "first"]
    monkeypatch.setenv("DIST_HARNESS_PROBE", "second")
    assert run_distributed(_environment, 2, "DIST_HARNESS_PROBE") == ["second", "second"]


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank one fails on purpose"):
        run_distributed(_fail_on_rank_one, 2)


def test_triton_interpret_set_at_the_call_runs_the_kernels_in_the_ranks(monkeypatch):
    # The fork server imported Triton (through Megatron-Core) without TRITON_INTERPRET: a call that sets it
    # must still get ranks whose kernels run under the interpreter (tests/_dist.py), and then ranks without.
    run_distributed(_environment, 1, "TRITON_INTERPRET")  # the server starts here at the latest
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert run_distributed(_rms_norm_kernel_error, 2) == [("InterpretedFunction", True)] * 2
    monkeypatch.delenv("TRITON_INTERPRET")
    assert [kind for kind, _ in run_distributed(_rms_norm_kernel_error, 1)] == ["JITFunction"]


def _rms_norm_kernel_error(rank, world_size):
    """(the kernel's kind, whether the kernel ran on the CPU and matched the reference)."""
    from kimi_kernels.rms_norm import fused, rms_norm, rms_norm_reference

    kind = type(fused.rms_norm_fwd_kernel).__name__
    if kind != "InterpretedFunction":
        return kind, None
    x, w = torch.randn(5, 48), 1 + 0.1 * torch.randn(48)
    return kind, torch.allclose(rms_norm(x, w, 1e-6, use_kernel=True), rms_norm_reference(x, w, 1e-6), atol=1e-5)
