"""megatron_ext.parallel.destroy_parallel: Megatron's groups, built again and again in one process (a bench_e2e row,
a balancer of tools/balance_study.py), leave nothing registered behind."""

from tests._dist import run_distributed


def _groups_after_rebuilds(rank, world, rebuilds):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext import cpu_compat
    from megatron_ext.parallel import destroy_parallel, initialize_parallel, registered_groups
    from tests.parallel import harness
    from tools import bench_common

    cpu_compat.install()
    config = harness.tiny_config({"tensor_model_parallel_size": 2, "sequence_parallel": True}, moe=True)
    builders = [lambda: initialize_parallel(config, seed=1), lambda: bench_common.init_expert_parallel(seed=1)]
    registered, built = [len(registered_groups())], []
    for i in range(rebuilds):
        before = registered_groups()
        builders[i % 2]()
        built.append(len(registered_groups() - before))
        dist.all_reduce(torch.ones(3), group=ps.get_expert_model_parallel_group())  # groups in use, as in a row
        dist.all_reduce(torch.ones(3), group=ps.get_tensor_model_parallel_group())
        destroy_parallel(before)
        registered.append(len(registered_groups()))
    # Megatron's own teardown, for contrast: it leaves the groups it does not destroy registered
    before = registered_groups()
    initialize_parallel(config, seed=1)
    ps.destroy_model_parallel()
    left_by_megatron = len(registered_groups() - before)
    return registered, built, left_by_megatron


def test_destroy_parallel_leaves_no_group_of_a_rebuild():
    for registered, built, left_by_megatron in run_distributed(_groups_after_rebuilds, 2, 4, timeout=300):
        assert min(built) > 5  # Megatron builds many groups per initialisation
        assert registered == [registered[0]] * 5  # the default group only, after every rebuild
        assert left_by_megatron > 0  # what destroy_parallel exists for
