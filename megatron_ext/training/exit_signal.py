"""Stop at a step boundary on SIGTERM / SIGINT, so the loop can save and exit cleanly.

SLURM sends SIGTERM before it kills a job (``#SBATCH --signal=TERM@<seconds>`` chooses how long
before the time limit; preemption and ``scancel`` send it too), torchrun forwards SIGTERM / SIGINT
to its workers and Ctrl-C sends SIGINT to the whole process group. The handler only records the
first signal; the loop asks ``stop_requested()`` after each step, which agrees over all ranks (a
signal may reach the ranks during different steps), so every rank stops after the same step.
Megatron-LM's ``--exit-signal-handler`` does the same with an all-gather on its default group.

The agreement is one all-reduce of one integer per step over a gloo group (host memory; with NCCL
as the default backend a separate gloo group is made once), so it never waits for the GPU: tens
of microseconds within a node.
"""

from __future__ import annotations

import signal
from typing import Optional

import torch
import torch.distributed as dist

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ExitSignal:
    """Records the first of ``HANDLED_SIGNALS`` this process gets; later ones are ignored too (torchrun
    forwards a signal its workers may already have had). SIGKILL, or torchrun's shutdown timeout,
    still ends the process at once."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.received: Optional[signal.Signals] = None
        self._group = None
        if not enabled:
            return
        # new_group is collective: every rank makes it here, in the same order.
        self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def stop_requested(self) -> bool:
        """Whether any rank got a signal; the same answer on every rank (a collective: call it on all)."""
        if not self.enabled:
            return False
        flag = torch.tensor([0 if self.received is None else int(self.received)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item() and self.received is None:  # another rank's signal
            self.received = signal.Signals(int(flag.item()))
        return bool(flag.item())

    @property
    def name(self) -> str:
        return self.received.name if self.received is not None else "none"
