"""Each CPU-compat patch is needed (the Megatron call fails without it) and the module is inert
when CUDA exists. Patches change process-wide state, so every check runs in a fresh interpreter."""

import subprocess
import sys
import textwrap

import pytest

# The Megatron-Core call (or the torch call Megatron makes) that each patch exists for.
NEEDS = {
    "device": """
        from megatron.core.utils import GlobalMemoryBuffer
        buf = GlobalMemoryBuffer().get_tensor((4,), torch.float32, "probe")  # device=current_device()
        zeros = torch.zeros([], dtype=torch.int, device="cuda")                # as in schedules.py
        assert buf.device.type == "cpu" and zeros.device.type == "cpu"
    """,
    "streams": """
        stream = torch.cuda.Stream()                       # as in DDP's communication stream
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.stream(stream):
            pass
        torch.cuda.synchronize()
    """,
    "rng": """
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
        tracker = CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", 123)
        with tracker.fork("model-parallel-rng"):
            a = torch.rand(3)
        tracker2 = CudaRNGStatesTracker()
        tracker2.add("model-parallel-rng", 123)
        with tracker2.fork("model-parallel-rng"):
            b = torch.rand(3)
        assert torch.equal(a, b)  # the fork really reseeds
    """,
    "tensor_type": """
        # Megatron's optimizers accept params by legacy CUDA type name (distrib_optimizer.py).
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(1).type(torch.float64).dtype == torch.float64  # explicit casts untouched
    """,
}

PRELUDE = """
import torch
from megatron_ext import cpu_compat
assert cpu_compat.install(only={only!r})
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def _script(only, check):
    return PRELUDE.format(only=tuple(only)) + textwrap.dedent(check)


@pytest.mark.parametrize("patch", sorted(NEEDS))
def test_megatron_call_fails_without_the_patch(patch):
    others = [p for p in NEEDS if p != patch]
    without = _run(_script(others, NEEDS[patch]))
    assert without.returncode != 0, f"{patch}: the Megatron call works without the patch"


def test_megatron_calls_work_with_all_patches():
    result = _run(_script(list(NEEDS), "\n".join(textwrap.dedent(c) for c in NEEDS.values())))
    assert result.returncode == 0, result.stderr[-3000:]


def test_inert_when_cuda_is_available():
    code = textwrap.dedent(
        """
        import torch
        from unittest import mock
        original = (torch.cuda.current_device, torch.cuda.Stream, torch.cuda.get_rng_state)
        with mock.patch.object(torch.cuda, "is_available", return_value=True):
            from megatron_ext import cpu_compat
            assert cpu_compat.install() is False
        assert not cpu_compat.is_installed()
        assert (torch.cuda.current_device, torch.cuda.Stream, torch.cuda.get_rng_state) == original
        assert torch.ones(1).type() == "torch.FloatTensor"  # no function mode pushed
        """
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr[-3000:]


def test_te_general_gemm_reference_is_guarded():
    """Megatron-Core 0.19.2 guards Transformer Engine's gemm itself: no patch needed, and this
    test notices an upgrade that drops the guard."""
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None


FAST_FALLBACKS = """
import os, torch, torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from megatron_ext import cpu_compat, speed_patches
assert cpu_compat.install()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
from megatron.core.optimizer import clip_grads

class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = self.syncs = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.syncs += func.overloadpacket.__name__ == "_local_scalar_dense"  # .item(), float(t)
        return func(*args, **(kwargs or {{}}))

g = torch.Generator().manual_seed(0)
def make(n):
    return [torch.randn(*s, generator=g) for s in ((33, 7), (5,), (4, 4, 9), (100,)) * n]

def exact_norm(grads):
    return torch.linalg.vector_norm(torch.cat([t.flatten() for t in grads]).double()).item()

def norm_and_ops(grads):
    with Ops() as ops:
        value = clip_grads.get_grad_norm_fp32(grads)
    exact = exact_norm(grads)
    assert abs(value - exact) < 1e-5 * exact, (value, exact)
    return ops

few, many = make(1), make(10)
stock_few, stock_many = norm_and_ops(few), norm_and_ops(many)
with speed_patches.fast_fallbacks():
    fast_few, fast_many = norm_and_ops(few), norm_and_ops(many)
# Megatron's stand-in launches one norm per tensor (on CUDA each is read back to the host) and reads the total
# (.item()); the foreach one does the same work for 4 or 40 tensors in a fixed number of ops and leaves the
# norm on the device: no host read at all.
assert stock_many.count >= stock_few.count + 36, (stock_few.count, stock_many.count)
assert stock_few.syncs >= 1 and isinstance(clip_grads.get_grad_norm_fp32(few), float)
assert fast_many.count == fast_few.count and fast_many.syncs == 0, (fast_few.count, fast_many.count)
with speed_patches.fast_fallbacks():
    on_device = clip_grads.get_grad_norm_fp32(few)
assert isinstance(on_device, torch.Tensor) and on_device.shape == (1,) and on_device.dtype == torch.float32
grads = few
exact = exact_norm(grads)

for total_norm in (exact, torch.tensor([exact])):  # a host number, and the norm left on the device
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(params, grads):
        p.grad = t.clone()
    with speed_patches.fast_fallbacks(), Ops() as ops:
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total_norm)
    assert ops.syncs == 0
    for p, t in zip(params, grads):
        torch.testing.assert_close(p.grad, t * (1.0 / (exact + 1e-6)))
assert clip_grads.l2_norm_impl.__name__ == "local_multi_tensor_l2_norm"  # restored on exit

class Opt:
    def step(self):
        return clip_grads.l2_norm_impl.__name__
opt = speed_patches.scoped_fast_fallbacks(Opt())
assert opt.step() == "foreach_l2_norm" and clip_grads.l2_norm_impl.__name__ == "local_multi_tensor_l2_norm"
"""


def test_fast_fallbacks_same_values_one_host_sync_and_scoped_to_our_step():
    """Megatron's no-Apex grad-norm reads every per-tensor norm back to the host; inside our optimizer's
    step the foreach replacement gives the same norm as a device tensor with no read at all, clips in place
    by a host or a device norm, and leaves Megatron's own functions in place everywhere else."""
    from tests._dist import free_port

    result = _run(FAST_FALLBACKS.format(port=free_port()))
    assert result.returncode == 0, result.stderr[-3000:]
