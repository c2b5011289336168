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
