"""PyTorch reference of the LM cross-entropy: the plain ops the fused kernels replace.

``cross_entropy_reference`` is the definition on one rank (what the tests compare against). The two
``*_partials`` / ``*_grad`` functions are the same maths split the way the kernels split it (per-row
partial statistics of a vocab shard, then the local gradient), so the tensor-parallel reduction in
``__init__.py`` runs unchanged on CPU (gloo) without Triton.
"""

import torch


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token ``logsumexp(logits) - logits[target]`` in fp32, ``logits [..., V]``, ``target [...]``."""
    x = logits.float()
    return torch.logsumexp(x, -1) - x.gather(-1, target.long().unsqueeze(-1)).squeeze(-1)


def _local_target(target: torch.Tensor, vocab_start: int, vocab: int):
    local = target.long() - vocab_start
    owned = (local >= 0) & (local < vocab)
    return local.clamp(0, vocab - 1), owned


def cross_entropy_partials(logits: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """``logits [N, V]`` (this rank's vocab ``[vocab_start, vocab_start + V)``), ``target [N]`` global ids ->
    fp32 ``(max, sum(exp(x - max)), target logit or 0 where another rank owns the target)``, each ``[N]``."""
    x = logits.float()
    row_max = x.max(-1).values
    sum_exp = (x - row_max.unsqueeze(-1)).exp().sum(-1)
    local, owned = _local_target(target, vocab_start, x.shape[-1])
    picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    return row_max, sum_exp, torch.where(owned, picked, torch.zeros_like(picked))


def cross_entropy_grad(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, lse: torch.Tensor,
                       dloss: torch.Tensor) -> torch.Tensor:
    """``(softmax(x) - onehot(target)) * dloss`` in the logits' dtype, with the (global) fp32 ``lse [N]``."""
    x = logits.float()
    grad = (x - lse.unsqueeze(-1)).exp()
    local, owned = _local_target(target, vocab_start, x.shape[-1])
    grad.scatter_add_(-1, local.unsqueeze(-1), -owned.float().unsqueeze(-1))
    return (grad * dloss.float().unsqueeze(-1)).to(logits.dtype)
