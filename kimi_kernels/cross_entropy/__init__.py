"""Fused LM cross-entropy over a vocab that may be split over the tensor-parallel group:

    loss[i] = logsumexp_v(logits[i, v]) - logits[i, target[i]]      per token, fp32

Entry point :func:`cross_entropy`. Megatron's ``vocab_parallel_cross_entropy`` makes an fp32 copy of the
logits and runs about ten elementwise and reduction kernels over it (cast, max, subtract, exp, sum, divide;
in backward the one-hot subtract and the scaling). Here forward reads the logits once per row and keeps
three fp32 numbers per token (``fused.py``: running max, sum of exponentials, target logit); the tensor-
parallel ranks combine them (below), and backward reads the logits once more and writes ``dlogits`` in their
dtype, so nothing of the logits' size is kept in fp32. Off CUDA the same split runs in PyTorch
(``naive.py``), so the tensor-parallel path also runs on CPU over gloo.

Tensor parallelism: each rank holds ``logits [..., V/tp]`` for its vocab range ``[vocab_start, vocab_start +
V/tp)``. Per row the ranks all-reduce the max ``M`` of their maxima, then the sum of ``s_r * exp(m_r - M)``
(each rank's sum rescaled to the global max: no overflow, no catastrophic underflow of the dominant terms)
and the target logit (only the owning rank contributes a non-zero). ``lse = M + log(S)``; the backward is
local to each rank, as in Megatron.
"""

import torch
import torch.distributed as dist

from kimi_kernels.cross_entropy.naive import cross_entropy_reference

__all__ = ["cross_entropy", "cross_entropy_reference", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _impl(use_kernel: bool):
    if use_kernel:
        from kimi_kernels.cross_entropy import fused

        return fused
    from kimi_kernels.cross_entropy import naive

    return naive


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, vocab_start, use_kernel, inplace_backward):
        impl = _impl(use_kernel)
        shape, vocab = logits.shape[:-1], logits.shape[-1]
        x = logits.contiguous().view(-1, vocab)
        t = target.contiguous().view(-1)
        row_max, sum_exp, target_logit = impl.cross_entropy_partials(x, t, vocab_start)
        if tp_group is not None:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
            # Each rank's sum rescaled to the global max (a factor <= 1; the rank holding the max keeps its
            # sum), summed in one all-reduce with the target logit (only the owning rank's is non-zero).
            sums = torch.stack([sum_exp * torch.exp(row_max - global_max), target_logit])
            dist.all_reduce(sums, group=tp_group)
            row_max, sum_exp, target_logit = global_max, sums[0], sums[1]
        lse = row_max + torch.log(sum_exp)
        loss = lse - target_logit
        ctx.save_for_backward(x, t, lse)
        ctx.vocab_start, ctx.use_kernel, ctx.inplace = vocab_start, use_kernel, inplace_backward
        ctx.shape = logits.shape
        return loss.view(shape)

    @staticmethod
    def backward(ctx, dloss):
        x, t, lse = ctx.saved_tensors
        dloss = dloss.contiguous().view(-1).float()
        if ctx.use_kernel:
            from kimi_kernels.cross_entropy.fused import cross_entropy_grad

            dx = cross_entropy_grad(x, t, ctx.vocab_start, lse, dloss, out=x if ctx.inplace else None)
        else:
            from kimi_kernels.cross_entropy.naive import cross_entropy_grad

            dx = cross_entropy_grad(x, t, ctx.vocab_start, lse, dloss)
        return dx.view(ctx.shape), None, None, None, None, None


def _check(logits, target, vocab_start, tp, use_kernel):
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V > 0, got shape {tuple(logits.shape)}")
    vocab_total = logits.shape[-1] * tp
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target must have the logits' leading shape {tuple(logits.shape[:-1])}, "
                         f"got {tuple(target.shape)}")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target must be int64 or int32 token ids, got {target.dtype}")
    if target.device != logits.device:
        raise ValueError(f"logits and target on different devices: {logits.device} vs {target.device}")
    if not logits.is_floating_point() or (use_kernel and logits.dtype not in SUPPORTED_DTYPES):
        raise ValueError(f"logits must be fp32/fp16/bf16{'' if use_kernel else ' (or fp64)'}, got {logits.dtype}")
    if not 0 <= vocab_start <= vocab_total - logits.shape[-1]:
        raise ValueError(f"vocab_start={vocab_start} must be in [0, {vocab_total - logits.shape[-1]}] "
                         f"(this rank's {logits.shape[-1]} columns within a vocab of {vocab_total})")
    # The range check reads target's values: a host sync on CUDA, so it runs only off CUDA.
    if not logits.is_cuda and target.numel():
        lo, hi = int(target.min()), int(target.max())
        if lo < 0 or hi >= vocab_total:
            raise ValueError(f"target ids must be in [0, {vocab_total}), got min {lo}, max {hi}")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None, vocab_start: int = 0,
                  use_kernel: bool | None = None, inplace_backward: bool = False) -> torch.Tensor:
    """``logits [..., V_local]`` (fp32/fp16/bf16), ``target [...]`` int64/int32 global token ids -> the fp32
    per-token loss ``logsumexp(logits) - logits[target]`` over the whole vocab, shape ``[...]``.

    ``tp_group``: the tensor-parallel group the vocab is split over (every rank holds ``V_local`` columns,
    its own from ``vocab_start``, as Megatron's ``VocabUtility`` gives them); None or a group of one: the
    whole vocab is here. ``use_kernel`` defaults to ``logits.is_cuda`` (the Triton kernels), else the PyTorch
    split of the same maths. The gradient of the logits comes in their dtype; ``inplace_backward`` writes it
    into the (contiguous) logits' own storage instead of a new buffer, for callers that do not read the
    logits after the backward (the LM head's output).

    Off CUDA, target ids outside ``[0, V_local * tp)`` raise ValueError. On CUDA they are not checked (that
    would need a host sync): they are the caller's responsibility, as in Megatron; such a row gets no target
    logit (loss = lse) and a gradient of plain softmax."""
    if use_kernel is None:
        use_kernel = logits.is_cuda
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    _check(logits, target, vocab_start, tp, use_kernel)
    return _CrossEntropyFunction.apply(logits, target, tp_group, int(vocab_start), bool(use_kernel),
                                       bool(inplace_backward))
