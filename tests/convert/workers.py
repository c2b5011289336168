"""Distributed workers for the conversion tests (run through ``tests._dist.run_distributed``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ext import cpu_compat


def _model_for(ckpt_dir: str, layout: dict):
    """The fp32 model of the checkpoint's config under ``layout`` (weights not loaded)."""
    from megatron_ext.convert.dist_reader import DistCheckpointReader
    from megatron_ext.convert.export import hybrid_config_from_saved
    from megatron_ext.config import USER_FIELDS, HybridConfig
    from megatron_ext.parallel import build_model_chunks, initialize_parallel

    cpu_compat.install()
    saved = DistCheckpointReader(ckpt_dir).common()["config"]
    base = hybrid_config_from_saved(saved)
    config = HybridConfig(params_dtype=torch.float32, pipeline_dtype=torch.float32, use_cpu_initialization=True,
                          **{k: getattr(base, k) for k in USER_FIELDS}, **layout)
    initialize_parallel(config, seed=1)
    return config, build_model_chunks(config)


def load_into(chunks, ckpt_dir: str) -> None:
    from megatron_ext.training.checkpointing import load_checkpoint

    state, _ = load_checkpoint(ckpt_dir, {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)},
                               load_rng=False)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state[f"model{i}"])


def logits(rank, world_size, ckpt_dir: str, layout: dict, tokens: torch.Tensor) -> torch.Tensor | None:
    """Our fp32 logits ``[b, s, V]`` for ``tokens [b, s]`` under ``layout`` (no pipeline), from rank 0."""
    _, chunks = _model_for(ckpt_dir, layout)
    (model,) = chunks
    load_into(chunks, ckpt_dir)
    model.eval()
    b, s = tokens.shape
    with torch.no_grad():
        out = model(tokens, torch.arange(s).expand(b, s), None)  # [b, s, V / TP]
    tp_group = ps.get_tensor_model_parallel_group()
    if ps.get_tensor_model_parallel_world_size() > 1:
        parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, out.contiguous(), group=tp_group)
        out = torch.cat(parts, dim=-1)
    return out if rank == 0 else None


def save_initial(rank, world_size, ckpt_dir: str, fields: dict, layout: dict, bf16: bool) -> bool:
    """Build the model of ``fields`` under ``layout`` (random weights, every one perturbed) and save it as
    launch/train.py does (the model fields in the common state)."""
    from megatron_ext.config import HybridConfig
    from megatron_ext.parallel import build_model_chunks, initialize_parallel
    from megatron_ext.training.checkpointing import save_checkpoint

    cpu_compat.install()
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = HybridConfig(params_dtype=dtype, pipeline_dtype=dtype, bf16=bf16, use_cpu_initialization=True,
                          **fields, **layout)
    initialize_parallel(config, seed=1)
    chunks = build_model_chunks(config)
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                p.add_((0.1 * torch.randn(p.shape, generator=g)).to(p.dtype))
            for name, buf in chunk.named_buffers():
                if name.endswith("expert_bias"):  # the same on every rank (it is replicated)
                    buf.copy_(0.01 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(7)))
    save_checkpoint(ckpt_dir, 5, {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)},
                    {"consumed_samples": 0}, config={**fields, "bf16": bf16})
    return True
