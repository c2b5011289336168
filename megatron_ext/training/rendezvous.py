"""``torch.distributed`` initialisation that survives torchrun's restarts (``--max-restarts``).

Under torchrun the workers' process groups exchange their addresses through the elastic agent's
TCPStore (``TORCHELASTIC_USE_AGENT_STORE``). torch 2.14 assumes a new store per restart attempt and
adds no per-attempt prefix, but the c10d rendezvous keeps one store for the agent's lifetime: the
restarted workers find the dead workers' keys (gloo's addresses, NCCL's unique ids) of every group
(``new_group`` names repeat from attempt to attempt) and connect to them: ``Gloo connectFullMesh
failed ... Connection refused``, or a hang. ``init_process_group`` here puts each attempt's keys
under ``megatron_ext/attempt_<TORCHELASTIC_RESTART_COUNT>/`` of the agent's store; every group made
later (Megatron's included) inherits the prefix from the default store.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout


def init_process_group(backend: str) -> None:
    """``dist.init_process_group(backend)`` from the environment (``env://``); under torchrun's agent
    store, in a key space of its own per restart attempt."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=default_pg_timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"megatron_ext/attempt_{attempt}", agent_store)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
