"""tools/bench_common.py: Megatron's groups, built again for every bench_e2e row, leave nothing behind."""

from tests._dist import run_distributed


def _groups_after_rows(rank, world, rows):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext import cpu_compat
    from tools import bench_common

    cpu_compat.install()
    registered = [len(bench_common.registered_groups())]
    for _ in range(rows):
        before = bench_common.registered_groups()
        bench_common.init_expert_parallel(seed=1)
        built = len(bench_common.registered_groups()) - len(before)
        dist.all_reduce(torch.ones(3), group=ps.get_expert_model_parallel_group())  # a group in use, as in a row
        bench_common.destroy_expert_parallel(before)
        registered.append(len(bench_common.registered_groups()))
    # Megatron's own teardown, for contrast: it leaves the groups it does not destroy registered
    before = bench_common.registered_groups()
    bench_common.init_expert_parallel(seed=1)
    ps.destroy_model_parallel()
    left_by_megatron = len(bench_common.registered_groups() - before)
    return registered, built, left_by_megatron


def test_destroy_expert_parallel_leaves_no_group_of_a_row():
    for registered, built, left_by_megatron in run_distributed(_groups_after_rows, 2, 3, timeout=300):
        assert built > 5  # Megatron builds many groups per initialisation
        assert registered == [registered[0]] * 4  # the default group only, after every row
        assert left_by_megatron > 0  # what destroy_expert_parallel exists for
