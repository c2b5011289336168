"""The tensor-parallel cross-entropy on two real gloo processes: each rank holds half the vocab (its range
from Megatron's ``VocabUtility``); the loss (identical on both ranks) and each rank's slice of the logits'
gradient equal the one-rank result. The PyTorch path, and the Triton kernels under the interpreter (the
ranks are fresh processes, started after ``TRITON_INTERPRET=1`` is set)."""

import pytest
import torch

from kimi_kernels.cross_entropy import cross_entropy_reference
from tests._dist import run_distributed

ROWS, VOCAB = (5, 3), 2000  # 1000 columns per rank: one partial 1024-column tile


def make_case():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*ROWS, VOCAB, generator=g) * 8 + torch.randn(*ROWS, 1, generator=g) * 20
    logits[..., 1500] += 60  # rank 1 holds every row's max: rank 0's sums are rescaled by ~e^-60
    target = torch.randint(0, VOCAB, ROWS, generator=g)
    target[0, 0], target[0, 1], target[1, 0] = 0, 999, 1000  # both ends of rank 0's range, rank 1's first
    target[1, 1], target[2, 0] = 1500, VOCAB - 1  # the max (loss ~ 0), rank 1's last column
    return logits, target, torch.randn(ROWS, generator=g)


def _rank(rank, world_size, use_kernel):
    import torch.distributed as dist
    from megatron.core.tensor_parallel.utils import VocabUtility

    from kimi_kernels.cross_entropy import cross_entropy

    logits, target, cotangent = make_case()
    per_rank = VOCAB // world_size
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(per_rank, rank, world_size)
    x = logits[..., start:end].clone().requires_grad_()
    group = dist.new_group(list(range(world_size)))
    loss = cross_entropy(x, target, tp_group=group, vocab_start=start, use_kernel=use_kernel)
    (loss * cotangent).sum().backward()
    return start, end, loss.detach(), x.grad


@pytest.mark.slow
@pytest.mark.parametrize("use_kernel", [False, True], ids=["reference", "kernel_interpreter"])
def test_two_ranks_equal_one_rank(use_kernel, monkeypatch):
    if use_kernel:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits, target, cotangent = make_case()
    x = logits.clone().requires_grad_()
    want_loss = cross_entropy_reference(x, target)
    (want_loss * cotangent).sum().backward()
    results = run_distributed(_rank, 2, use_kernel)
    assert [(s, e) for s, e, _, _ in results] == [(0, 1000), (1000, 2000)]
    assert want_loss[1, 1] < 1e-3 and want_loss[0, 0] > 50  # the target at the max / far below it
    for start, end, loss, grad in results:
        torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(grad, x.grad[..., start:end], rtol=1e-5, atol=1e-7)
    assert torch.equal(results[0][2], results[1][2])  # the same loss on every rank
