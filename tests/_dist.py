"""Run a function on several real CPU processes over gloo and collect what each returns.

Each rank runs ``fn(rank, world_size, *args)`` after ``torch.distributed`` is initialised
with the gloo backend; the return value (anything ``torch.save`` can write) comes back in
rank order. A failure on any rank fails the caller with that rank's traceback.

Ranks are forked from a ``forkserver`` that imported torch and Megatron-Core once: a spawned
rank spent 5-10 s of CPU importing them, per rank and per call, most of the multi-rank tests'
time on two cores. A rank gets the caller's environment as it is at the call (the server's is
from its start). ``TRITON_INTERPRET`` is an exception that an environment cannot fix: Triton's own
``@jit`` helpers (``tl.max``, ...) are made when Triton is imported, which Megatron-Core does, and an
interpreted kernel cannot call compiled ones; so a call made under another ``TRITON_INTERPRET`` than
the server started with spawns its ranks, which import everything afresh.
"""

from __future__ import annotations

import multiprocessing
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


# Modules the fork server imports before it forks any rank (set before the server starts).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "megatron.core"]
_server_interpret: list[str | None] = []  # TRITON_INTERPRET when the server started (set once)


def _start_method() -> str:
    interpret = os.environ.get("TRITON_INTERPRET")
    if not _server_interpret:
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
        _server_interpret.append(interpret)
    return "forkserver" if _server_interpret[0] == interpret else "spawn"


def _worker(rank, world_size, port, out_dir, fn, args, environ):
    os.environ.clear()
    os.environ.update(environ)
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
            args=(world_size, free_port(), out_dir, fn, args, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
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
