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
