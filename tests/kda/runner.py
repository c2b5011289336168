"""Distributed workers for the KDA parity tests (run through ``tests._dist.run_distributed``).

Same scheme as ``tests/parallel/harness.py``: the one-rank run saves its weights with
``dist_checkpointing``; every other layout loads them resharded, so all layouts start from the
same model. Gradients come back keyed by checkpoint key and global slice.
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps

from megatron_ext import cpu_compat
from tests.parallel import harness

SEQ, BATCH, HIDDEN = 16, 2, 32


# --- one attention layer (KDA, or MLA for the same tests) -----------------------------------------
# MLA: 4 heads, latent rank 8, 6 key channels per head + 4 shared, values of 5 (all distinct, so a
# swapped split fails).
MLA = dict(kv_lora_rank=8, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5)


def _layer(tp: int, sequence_parallel: bool, kind: str = "K"):
    from megatron_ext.kda import KDAAttention
    from megatron_ext.layers.mla import MLAttention

    config = harness.tiny_config(
        dict(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel), False,
        num_layers=1, attention_pattern=kind, kda_num_heads=4, kda_head_dim=16, kda_gate_rank=8, **MLA,
    )
    return {"K": KDAAttention, "M": MLAttention}[kind](config)


def _inputs():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    return x, torch.randn(SEQ, BATCH, HIDDEN, generator=g)


def _forward_backward(layer, x, cotangent, sequence_parallel: bool):
    """Forward/backward on this rank's part of the input: ``(output, input)``."""
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if sequence_parallel:
        shard = slice(rank * SEQ // tp, (rank + 1) * SEQ // tp)
        x, cotangent = x[shard], cotangent[shard]
    x = x.clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    (out * cotangent).sum().backward()
    return out, x


def _run_layer(layer, x, cotangent, sequence_parallel: bool):
    """Forward/backward on this rank's part of the input; grads reduced as finalize_model_grads does."""
    out, x = _forward_backward(layer, x, cotangent, sequence_parallel)
    for p in layer.parameters():
        if sequence_parallel and getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    holder = types.SimpleNamespace(module=layer)
    return {"out": out.detach(), "dx": x.grad, "grads": harness.collect_grads([holder])}


def layer_reference(rank, world_size, ckpt_dir: str, kind: str = "K"):
    """One rank: build a layer (attention ``kind``) with random (perturbed) weights, save them, run it."""
    cpu_compat.install()
    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(harness.SEED)
    layer = _layer(1, False, kind)
    with torch.no_grad():  # every parameter random (init leaves the norm at 1, a bias at 0)
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    dist_checkpointing.save(layer.sharded_state_dict(), ckpt_dir)
    return _run_layer(layer, *_inputs(), sequence_parallel=False)


def layer_tensor_parallel(rank, world_size, ckpt_dir: str, kind: str = "K"):
    """TP = world_size, with and without sequence parallelism, from the saved weights."""
    cpu_compat.install()
    ps.initialize_model_parallel(world_size, 1)
    results = {}
    for sp in (True, False):
        layer = _layer(world_size, sp, kind)
        layer.load_state_dict(dist_checkpointing.load(layer.sharded_state_dict(), ckpt_dir))
        results[sp] = _run_layer(layer, *_inputs(), sequence_parallel=sp)
    return results


@contextlib.contextmanager
def count_collectives():
    """Count the TP collectives Megatron's mappings and linears issue, keyed ``(kind, last dim)``."""
    from megatron.core.tensor_parallel import layers, mappings

    counts = Counter()

    def counting(kind, fn):
        def call(tensor, *args, **kwargs):  # the output of a gather / reduce-scatter, the tensor of an all-reduce
            counts[kind, tensor.shape[-1]] += 1
            return fn(tensor, *args, **kwargs)
        return call

    kinds = {"dist_all_gather_func": "all_gather", "dist_reduce_scatter_func": "reduce_scatter"}
    saved = [(m, name, getattr(m, name)) for m in (layers, mappings) for name in kinds]
    saved.append((torch.distributed, "all_reduce", torch.distributed.all_reduce))
    for module, name, fn in saved:
        setattr(module, name, counting(kinds.get(name, name), fn))
    try:
        yield counts
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def layer_collectives(rank, world_size):
    """Hidden-wide collectives of one KDA layer's forward and backward, with and without SP."""
    cpu_compat.install()
    ps.initialize_model_parallel(world_size, 1)
    results = {}
    for sp in (True, False):
        layer = _layer(world_size, sp)
        with count_collectives() as counts:
            _forward_backward(layer, *_inputs(), sequence_parallel=sp)
        results[sp] = {kind: n for (kind, width), n in counts.items() if width == HIDDEN}
    return results
