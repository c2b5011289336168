"""speed_patches.foreach_l2_norm (the grad norm inside our optimizer step) over bf16 main grads."""

import pytest
import torch


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
])
def test_foreach_l2_norm_of_bf16_grads_equals_their_fp32_copies(device):
    """bf16 main grads: the grad norm over them (fp32 accumulation, fp32 per-tensor norms) is the norm of their
    fp32 copies, bit for bit (so the clip coefficient, hence the update, is unchanged)."""
    from megatron_ext.speed_patches import foreach_l2_norm

    gen = torch.Generator().manual_seed(3)
    grads = [(torch.randn(n, generator=gen) * s).bfloat16().to(device)
             for n, s in ((1, 1.0), (4099, 3.0), (1 << 20, 1e-3), (300_007, 40.0))]
    flag = torch.zeros(1, dtype=torch.int, device=device)
    narrow, _ = foreach_l2_norm(2048, flag, [grads], False)
    wide, _ = foreach_l2_norm(2048, flag, [[g.float() for g in grads]], False)
    assert narrow.dtype == torch.float32 and torch.equal(narrow, wide), (narrow, wide)
    rounded, _ = foreach_l2_norm(2048, flag, [[g.float() for g in grads[:1]] + grads[1:]], False)  # mixed dtypes
    assert torch.equal(rounded, wide)


def test_chained_grad_norm_equals_megatrons_without_reading_the_device():
    """Sub-optimizers with their own grad-stats groups (EP's expert optimizer): the norms combined on the device
    give Megatron's value (a missing or zero norm counts 0); a shared group or one optimizer is Megatron's path."""
    from types import SimpleNamespace

    from megatron.core.optimizer.optimizer import ChainedOptimizer
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_ext.speed_patches import chained_grad_norm

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += func.overloadpacket.__name__ == "_local_scalar_dense"
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(5)
    draw = lambda: torch.rand(1, generator=gen)  # noqa: E731
    for norms in ([draw() * 7, draw()], [draw(), None], [3.0, torch.zeros(1)], [2.5, 1.5]):
        subs = [SimpleNamespace(get_grad_norm=lambda n=n: n) for n in norms]
        chained = SimpleNamespace(chained_optimizers=subs, grads_states_parallel_group_is_shared=lambda: False)
        expected = ChainedOptimizer.get_grad_norm(chained)  # Megatron's: reads each tensor norm to the host
        Reads.count = 0
        with Reads():
            got = chained_grad_norm(chained)
        assert Reads.count == 0, norms
        assert abs(float(got) - expected) <= 1e-6 * max(expected, 1.0), (norms, got, expected)
        assert isinstance(got, torch.Tensor) == any(isinstance(n, torch.Tensor) for n in norms)
