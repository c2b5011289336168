"""Run Megatron-Core 0.19.2 on CPU with the gloo backend.

Megatron-Core assumes CUDA in a handful of places that our CPU path (the tiny default config,
development, CI) goes through. Every patch to Megatron-Core's behaviour lives in this module (the CPU ones), in
``megatron_ext/speed_patches.py`` (the GPU-speed ones we opt into) or in ``megatron_ext/checkpoint_fixes.py``
(the optimizer-checkpoint faults), each one small and named after what it
fixes, each with a test that fails without it (``tests/test_cpu_compat.py``, ``tests/parallel/``). The CPU patches never run when CUDA is available: :func:`install` returns at once.

The patches:

``device``
    Tensor factories and moves that name a CUDA device (``device="cuda"``,
    ``device=torch.cuda.current_device()``, ``tensor.cuda()``, ``tensor.to("cuda")``) are
    redirected to the CPU by a ``TorchFunctionMode``; ``torch.cuda.current_device()`` returns the
    CPU device instead of initialising a driver that does not exist. Used by the pipeline p2p buffers and
    schedules, the sequence-parallel gathers, DDP's grad buffers and the memory buffer.
``streams``
    ``torch.cuda.Stream/Event/stream/current_stream/synchronize`` become no-ops: on the CPU every
    op is synchronous, so there is nothing to order. Used by DDP's communication overlap and p2p.
``rng``
    Megatron's RNG tracker saves, forks and restores the CUDA generator; on the CPU it forks the
    CPU generator instead (``torch.cuda.{get,set}_rng_state``, ``manual_seed`` and
    ``tensor_parallel.random``'s private helpers).
``tensor_type``
    Megatron's optimizers accept parameters by their legacy type name
    (``'torch.cuda.FloatTensor'`` ...); a CPU float tensor reports the CUDA name of its dtype.

Transformer Engine's ``te_general_gemm``: Megatron-Core 0.16 referenced it without a guard;
0.19.2 sets it to ``None`` when Transformer Engine is absent and checks before use, so no patch
is needed (``tests/test_cpu_compat.py`` asserts that guard so an upgrade that drops it is seen).
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
from torch.overrides import TorchFunctionMode

_installed = False
_lock = threading.Lock()
_mode: "_CudaToCpuMode | None" = None


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # Megatron passes torch.cuda.current_device() (an int) as a device.
    return isinstance(device, int) and not isinstance(device, bool)


_LEGACY_CUDA_TYPE = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments to the CPU (``device`` patch, ``tensor_type`` patch)."""

    redirect_devices = False
    report_cuda_type = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.redirect_devices:
            if "device" in kwargs and _is_cuda_device(kwargs["device"]):
                kwargs = {**kwargs, "device": "cpu"}
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
                args = (args[0], "cpu", *args[2:])
        if self.report_cuda_type and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            legacy = _LEGACY_CUDA_TYPE.get(args[0].dtype)
            if legacy is not None and args[0].device.type == "cpu":
                return legacy
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` and ``torch.cuda.Event`` on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _function_mode() -> _CudaToCpuMode:
    global _mode
    if _mode is None:
        _mode = _CudaToCpuMode()
        # Entered for the life of the process: Megatron allocates on "cuda" from many call sites.
        _mode.__enter__()
    return _mode


def _patch_device():
    # A CPU device object, not an index: allocations inside autograd backward
    # (``device=torch.cuda.current_device()`` in the TP layers) run outside the function mode.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.set_device = lambda device: None
    _function_mode().redirect_devices = True


def _patch_tensor_type():
    _function_mode().report_cuda_type = True


def _patch_streams():
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullStream
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None


def _patch_rng():
    from megatron.core.tensor_parallel import random as mcore_random

    def get_rng_state(device=None, *args, **kwargs):
        return torch.get_rng_state()

    def set_rng_state(new_state, device=None, *args, **kwargs):
        torch.set_rng_state(new_state)

    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.random.get_rng_state = get_rng_state
    torch.cuda.random.set_rng_state = set_rng_state
    # The default generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    mcore_random._get_cuda_rng_state = get_rng_state
    mcore_random._set_cuda_rng_state = set_rng_state
    # The tracker warns when the CPU generator moves inside a fork; here it *is* the forked one.
    logging.getLogger(mcore_random.__name__).addFilter(
        lambda record: "CPU RNG state changed" not in record.getMessage()
    )


PATCHES = {
    "device": _patch_device,
    "streams": _patch_streams,
    "rng": _patch_rng,
    "tensor_type": _patch_tensor_type,
}


def install(only: tuple[str, ...] | None = None) -> bool:
    """Make Megatron-Core usable on CPU; a no-op (returns False) when CUDA is available.

    ``only`` restricts the patches (tests use it to show each one is needed). Idempotent.
    """
    global _installed
    if torch.cuda.is_available():
        return False
    with _lock:
        if _installed:
            return True
        for name, patch in PATCHES.items():
            if only is None or name in only:
                patch()
        _installed = True
    return True


def is_installed() -> bool:
    return _installed
