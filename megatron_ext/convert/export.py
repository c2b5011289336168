"""Dist checkpoint (any layout) -> Hugging Face Kimi Linear directory, one layer at a time.

Checks the checkpoint's files against the checksums saved with them, reads the model config from its
common state, checks that every model tensor of the checkpoint has a place in the format (and every
place a tensor), then converts group by group (the embedding, each decoder layer, the head): read the
group's global tensors, split them into the released names, hand them to the shard writer. Peak
memory: one group plus one output shard.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_ext.convert.dist_reader import DistCheckpointReader, one_rank_group
from megatron_ext.convert.kimi_config import to_kimi_config
from megatron_ext.convert.safetensors_out import ShardedSafetensorsWriter
from megatron_ext.convert.tensor_map import hf_dtype, model_conversions
from megatron_ext.errors import ConfigError

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def hybrid_config_from_saved(saved: dict | None):
    """The ``HybridConfig`` (one rank, CPU) of the model fields a checkpoint's common state stores."""
    from megatron_ext.config import USER_FIELDS, HybridConfig

    if not saved:
        raise ConfigError("the checkpoint's common state has no 'config' (was it saved by launch/train.py or "
                          "tools/convert_checkpoint.py import?)")
    fields = {k: saved[k] for k in USER_FIELDS if k in saved}
    return HybridConfig(params_dtype=torch.float32, use_cpu_initialization=True, **fields)


def _check_tensors(reader: DistCheckpointReader, groups) -> None:
    expected = {c.ours for group in groups for c in group}
    extra = sorted(set(reader.tensors) - expected)
    if extra:
        raise ConfigError(f"checkpoint tensor(s) with no place in Kimi Linear's format: {', '.join(extra[:8])}"
                          + (f" (+{len(extra) - 8} more)" if len(extra) > 8 else ""))
    missing = sorted(c.ours for group in groups for c in group if c.ours not in reader.tensors and not c.optional)
    if missing:
        raise ConfigError(f"checkpoint lacks tensor(s) its config implies: {', '.join(missing[:8])}")


def export_checkpoint(ckpt_dir: str, hf_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, log=print) -> dict:
    """Convert the checkpoint training would load from ``ckpt_dir`` (checksums verified first: a damaged one is
    skipped, ``log`` says so); returns ``{"checkpoint", "shards", "tensors", "bytes"}``."""
    with one_rank_group():
        reader = DistCheckpointReader(ckpt_dir, log)
        saved = reader.common().get("config")
        cfg = hybrid_config_from_saved(saved)
        dtype_name = "bfloat16" if (saved or {}).get("bf16") else "float32"
        kimi = to_kimi_config(cfg, dtype_name)
        groups = model_conversions(cfg)
        _check_tensors(reader, groups)
        writer = ShardedSafetensorsWriter(hf_dir, max_shard_bytes)
        count = 0
        for group in groups:
            tensors = reader.read([c.ours for c in group if c.ours in reader.tensors])
            for conv in group:
                ours = tensors.pop(conv.ours, None)
                if ours is None:  # a balancer without an expert bias: Kimi's correction bias is zero
                    ours = torch.zeros(cfg.num_moe_experts, dtype=torch.float32)
                for name, tensor in zip(conv.hf, conv.split(ours)):
                    writer.add(name, tensor.to(hf_dtype(name, tensor.dtype)))
                    count += 1
        shards = writer.close()
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(kimi, f, indent=2)
    return {"checkpoint": reader.path, "shards": shards, "tensors": count, "bytes": writer.total_bytes}
