"""Run the tiny hybrid model under a parallel layout and return its loss and gradients.

Every layout starts from the same weights: a one-rank run saves them with Megatron's
``dist_checkpointing`` and each layout loads them resharded (Megatron's initialisation is not
layout-invariant). Gradients come back keyed by their checkpoint key with the slice of the
global tensor they cover, so a test can compare every rank's shard with the one-rank gradient.
"""

from __future__ import annotations

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from megatron_ext import cpu_compat

SEQ = 16
GLOBAL_BATCH = 8
MICRO_BATCH = 2
SEED = 1234

TINY = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=257,
    max_sequence_length=SEQ,
)
# The hybrid layer pattern: 3 KDA layers : 1 full attention (KDA head dim 16 is the kernel's minimum).
HYBRID = dict(attention_pattern="KKKA", kda_num_heads=2, kda_head_dim=16, kda_gate_rank=8)
TINY_MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_layer_freq=[0, 1, 1, 1],
    moe_shared_expert_intermediate_size=32,
)


def tiny_config(layout: dict, moe: bool, **overrides):
    from megatron_ext.config import HybridConfig

    fields = {**TINY, **(TINY_MOE if moe else {}), **layout, **overrides}
    return HybridConfig(
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        **fields,
    )


def make_batches(seed: int = SEED) -> torch.Tensor:
    """A global batch of random token windows ``[GLOBAL_BATCH, SEQ + 1]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g)


def microbatches_for_rank(windows: torch.Tensor) -> list[dict]:
    """This data-parallel rank's share of the global batch, cut into microbatches."""
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = windows.shape[0] // dp
    mine = windows[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    out = []
    for start in range(0, per_rank, MICRO_BATCH):
        w = mine[start : start + MICRO_BATCH]
        out.append(
            dict(
                tokens=w[:, :-1].contiguous(),
                labels=w[:, 1:].contiguous(),
                loss_mask=torch.ones(w.shape[0], SEQ),
                position_ids=torch.arange(SEQ).expand(w.shape[0], SEQ).contiguous(),
            )
        )
    return out


def _sharded(chunks) -> dict:
    return {f"chunk{i}": getattr(c, "module", c).sharded_state_dict() for i, c in enumerate(chunks)}


def _sharded_tensors(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _sharded_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _sharded_tensors(v)
    elif isinstance(tree, (ShardedTensor, ShardedTensorFactory)):
        yield tree


def setup(layout: dict, moe: bool, overrides: dict | None = None):
    """Parallel state and this rank's model chunks for the tiny config under ``layout``."""
    from megatron_ext.parallel import build_model_chunks, initialize_parallel

    cpu_compat.install()
    config = tiny_config(layout, moe, **(overrides or {}))
    initialize_parallel(config, SEED)
    return config, build_model_chunks(config)


def save_reference(rank, world_size, ckpt_dir: str, moe: bool, overrides: dict | None = None,
                   prepare=None):
    """One rank: build the model from the seed, ``prepare(chunks)`` it (e.g. randomise weights
    that start at a constant), save its weights."""
    _, chunks = setup({}, moe, overrides)
    if prepare is not None:
        prepare(chunks)
    dist_checkpointing.save(_sharded(chunks), ckpt_dir)
    return True


def load_weights(chunks, ckpt_dir: str):
    state = dist_checkpointing.load(_sharded(chunks), ckpt_dir)
    for i, chunk in enumerate(chunks):
        getattr(chunk, "module", chunk).load_state_dict(state[f"chunk{i}"])


def collect_grads(ddp_chunks) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
    """``(key, global shape, global slice, local grad)`` for every parameter of this rank."""
    by_ptr = {}
    for sh in _sharded_tensors(_sharded(ddp_chunks)):
        by_ptr[sh.data.data_ptr()] = sh
    out = []
    for chunk in ddp_chunks:
        for name, p in chunk.module.named_parameters():
            sh = by_ptr.get(p.data_ptr())
            if sh is None:
                raise KeyError(f"parameter {name} has no sharded tensor")
            grad = getattr(p, "main_grad", None)
            grad = (p.grad if grad is None else grad).detach().clone().view(p.shape)
            if isinstance(sh, ShardedTensorFactory):
                # e.g. the SwiGLU fc1 weight, checkpointed as two tensors: shard the grad alike.
                built = sh.build_fn(sh.key, grad, sh.replica_id, sh.flattened_range)
                out.extend(
                    (t.key, t.global_shape, t.global_slice(), t.data) for t in _sharded_tensors(built)
                )
            else:
                out.append((sh.key, sh.global_shape, sh.global_slice(), grad))
    return out


def run_layout(rank, world_size, layout: dict, ckpt_dir: str, moe: bool, windows: torch.Tensor,
               overrides: dict | None = None):
    """Load the reference weights under ``layout``, run one global batch, return loss + grads."""
    from megatron_ext.parallel import wrap_ddp
    from megatron_ext.training.step import forward_backward

    config, chunks = setup(layout, moe, overrides)
    load_weights(chunks, ckpt_dir)
    ddp_chunks = wrap_ddp(chunks, config)
    for c in ddp_chunks:
        c.zero_grad_buffer()
    loss = forward_backward(ddp_chunks, microbatches_for_rank(windows), SEQ, MICRO_BATCH)
    return {"loss": loss, "grads": collect_grads(ddp_chunks)}


def assert_grads_match(reference: list, results: list, rtol: float, atol: float):
    """Every rank's gradient shard equals the same slice of the one-rank gradient.

    `atol` is per unit of the tensor's largest one-rank magnitude (at least 1): a sum taken in
    another order (sharded matmuls, all-reduces) differs by ulps of its largest terms, so an
    element near zero in a gradient of magnitude 50 can be off by 1e-5 with nothing wrong."""
    ref = {}
    for key, shape, global_slice, grad in reference:
        ref.setdefault(key, torch.full(shape, float("nan")))
        ref[key][global_slice] = grad.reshape(ref[key][global_slice].shape)
    seen = set()
    for rank_result in results:
        for key, _, global_slice, grad in rank_result["grads"]:
            assert key in ref, f"{key} missing from the one-rank run"
            expected = ref[key][global_slice]
            scale = max(1.0, float(ref[key].nan_to_num().abs().max()))
            torch.testing.assert_close(
                grad.reshape(expected.shape), expected, rtol=rtol, atol=atol * scale,
                msg=lambda m, key=key: f"{key}: {m}",
            )
            seen.add(key)
    assert seen == set(ref), f"keys never compared: {sorted(set(ref) - seen)}"
