"""Run a function on several real CPU processes over gloo and collect what each returns.

Each rank runs ``fn(rank, world_size, *args)`` after ``torch.distributed`` is initialised
with the gloo backend; the return value (anything ``torch.save`` can write) comes back in
rank order. A failure on any rank fails the caller with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, out_dir, fn, args):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0) -> list:
    """Run ``fn`` on ``world_size`` gloo processes; return the per-rank results."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, free_port(), out_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for proc in ctx.processes:
                        proc.kill()
                    raise TimeoutError(f"ranks still running after {timeout:.0f}s")
        except Exception as exc:
            errors = sorted(Path(out_dir).glob("rank*.err"))
            detail = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in errors)
            raise RuntimeError(f"distributed run failed:\n{detail}") from exc
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
