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
