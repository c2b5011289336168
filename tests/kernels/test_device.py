"""kimi_kernels.device: the SM count the persistent grids size themselves by."""

import pytest
import torch

from kimi_kernels.device import sm_count


def test_sm_count_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        sm_count("cpu")


@pytest.mark.gpu
def test_sm_count_is_the_device_s_and_cuda_means_the_current_one():
    index = torch.cuda.current_device()
    expected = torch.cuda.get_device_properties(index).multi_processor_count
    assert sm_count(torch.device("cuda", index)) == expected
    assert sm_count("cuda") == expected
    assert sm_count(index) == expected
