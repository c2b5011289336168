"""Shared pytest setup: GPU tests are skipped where no CUDA device exists; a one-rank Megatron fixture."""

import os

import pytest
import torch

# Keep CPU tests deterministic and within the 2-core CI machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_rank_megatron():
    """A one-process gloo group and Megatron's parallel state (TP = 1), for the module that asks for it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext import cpu_compat
    from tests._dist import free_port

    cpu_compat.install()
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    if owned:
        dist.destroy_process_group()
