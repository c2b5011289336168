"""Python's garbage collector at fixed steps instead of whenever allocation counts say so.

Megatron-LM's ``--manual-gc`` / ``--manual-gc-interval``, with one addition: the objects alive when
training starts (modules, parameters, compiled kernels, the imported libraries) are frozen out of
every later collection (``gc.freeze``), so a collection scans only what the steps created.

Why: a full (generation 2) collection walks every tracked object of the process. With torch,
Megatron-Core and Triton loaded that took ~240 ms on the H200 host, twice in four steps of the
end-to-end benchmark's ``ours_full`` model (docs/benchmarks.md, "Garbage collection"): the GPU idles
while the host collects, and across ranks the pauses land on different steps (stragglers).
Training allocates few reference cycles per step (autograd graphs are freed by reference
counting), so collecting every ``interval`` steps bounds the leftover garbage.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def manual_gc(enabled: bool, interval: int) -> Iterator[Callable[[int], None]]:
    """Inside: automatic collection off and the objects alive now frozen; yields ``after_step(iteration)``,
    which collects when ``interval`` > 0 divides ``iteration``. On exit the collector is back as it was
    (enabled or not) with nothing frozen. ``enabled`` False: the collector is left alone and the yielded
    function does nothing."""
    if interval < 0:
        raise ValueError(f"manual_gc_interval must be >= 0 (0: no collections during training), got {interval}")
    if not enabled:
        yield lambda iteration: None
        return
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()

    def after_step(iteration: int) -> None:
        if interval and iteration % interval == 0:
            gc.collect()

    try:
        yield after_step
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
