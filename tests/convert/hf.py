"""transformers' KimiLinearForCausalLM on the CPU, for the conversion tests.

Without fla and causal_conv1d installed, transformers runs its own PyTorch reference paths for the KDA
chunked kernel and the short convolution (it says so in a log line); these are what we compare with.
One known difference remains in the math: transformers (like fla) L2-normalises q and k as
x / sqrt(|x|^2 + 1e-6), ours as x / max(|x|, 1e-12) (kimi_kernels/kda). ``l2norm=OURS_L2NORM`` swaps
transformers' function for ours, clearly labelled, so a test can check every other piece tightly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def OURS_L2NORM(x, dim=-1, eps=1e-6):  # noqa: N802  (a constant-like function)
    return F.normalize(x, dim=dim)


def transformers_logits(hf_dir, tokens: torch.Tensor, l2norm=None):
    """fp32 logits ``[b, s, V]`` and the loading info of ``from_pretrained(hf_dir)``."""
    import transformers
    import transformers.models.kimi_linear.modeling_kimi_linear as modeling

    original = modeling.l2norm
    if l2norm is not None:
        modeling.l2norm = l2norm
    try:
        model, info = transformers.KimiLinearForCausalLM.from_pretrained(hf_dir, output_loading_info=True,
                                                                         dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            return model(tokens).logits, info
    finally:
        modeling.l2norm = original
