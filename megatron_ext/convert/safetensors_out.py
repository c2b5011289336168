"""Write tensors as Hugging Face's sharded safetensors (``model-0000x-of-0000y.safetensors`` + index).

Tensors are buffered until a shard reaches ``max_shard_bytes`` and then written, so the memory held
is at most one shard plus what the caller holds. Shards are written under temporary names and
renamed once their count is known.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"


class ShardedSafetensorsWriter:
    def __init__(self, out_dir: str, max_shard_bytes: int):
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # names per written shard
        self.total_bytes = 0
        os.makedirs(out_dir, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in s for s in self.shards):
            raise ValueError(f"tensor {name} written twice")
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _tmp_name(self, index: int) -> str:
        return os.path.join(self.out_dir, f".shard-{index:05d}.safetensors.tmp")

    def _flush(self) -> None:
        save_file(self.pending, self._tmp_name(len(self.shards)), metadata={"format": "pt"})
        self.shards.append(sorted(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, name the shards, write the index; returns the shard file names."""
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for i, (name, tensors) in enumerate(zip(names, self.shards)):
            os.replace(self._tmp_name(i), os.path.join(self.out_dir, name))
            weight_map.update({t: name for t in tensors})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self.out_dir, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
        return names
