"""Read a dist checkpoint a few tensors at a time, without building the model.

The tensors' global shapes and dtypes come from the checkpoint's metadata; a read asks
``dist_checkpointing`` for the whole global tensors of the keys named (it gathers their shards from
every rank's files), so the memory held is that of the tensors read, never the whole model.
Needs a process group (one gloo rank is enough): :func:`one_rank_group`.
"""

from __future__ import annotations

import contextlib
import socket

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_ext.errors import ConfigError
from megatron_ext.training.checkpointing import (
    DamagedCheckpointError, complete_checkpoints, first_intact_checkpoint, is_complete_checkpoint,
)

# Prefixes of the model's own tensors (the rest: optimizer state, RNG, ...).
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


@contextlib.contextmanager
def one_rank_group():
    """A one-process gloo group for ``dist_checkpointing`` when none exists (CPU only)."""
    from megatron_ext import cpu_compat

    owned = not dist.is_initialized()
    if owned:
        if not torch.cuda.is_available():
            cpu_compat.install()  # dist_checkpointing calls CUDA synchronisation helpers
        with socket.socket() as s:  # a free local port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


def resolve_checkpoint(path: str, log=print) -> str:
    """``path`` itself when it is one checkpoint (``iter_XXXXXXX``), else the one training would load from it (the
    newest complete one); either way only once its files pass the checksums saved with it. A save directory's
    damaged checkpoint is skipped for the next older one, as training's load does, saying so through ``log``."""
    candidates = [(None, path)] if is_complete_checkpoint(path) else complete_checkpoints(path)
    if not candidates:
        raise ConfigError(f"{path}: no complete dist checkpoint (no metadata.json, no iter_* directory)")
    try:
        return first_intact_checkpoint(candidates, log)
    except DamagedCheckpointError as exc:
        raise ConfigError(str(exc)) from None


class DistCheckpointReader:
    def __init__(self, path: str, log=print):
        self.path = resolve_checkpoint(path, log)
        metadata = dist_checkpointing.load_tensors_metadata(self.path)
        self.tensors = {k: v for k, v in metadata.items()
                        if isinstance(v, ShardedTensor) and k.startswith(MODEL_PREFIXES)}

    def common(self) -> dict:
        from megatron_ext.training.checkpointing import common_state_of

        return common_state_of(self.path)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The global tensors of ``keys`` (each must be in :attr:`tensors`)."""
        request = {}
        for key in keys:
            meta = self.tensors[key]
            request[key] = ShardedTensor.from_rank_offsets(
                key, torch.empty(meta.global_shape, dtype=meta.dtype), replica_id=0)
        if not request:
            return {}
        loaded = dist_checkpointing.load(request, self.path)  # also merges in the common state: dropped
        return {key: loaded[key] for key in keys}
