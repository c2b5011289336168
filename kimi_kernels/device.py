"""What the kernels' launch choices read from the device, read once per device."""

import functools

import torch


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | str | int) -> int:
    """Streaming multiprocessors of a CUDA device (``cuda`` alone: the current one). Callers pick their own
    figure for the CPU interpreter, where no SM count applies."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"sm_count needs a CUDA device, got {device}")
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
