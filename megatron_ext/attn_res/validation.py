"""Checks of the ``attn_res*`` config fields (called from ``HybridConfig.__post_init__``)."""

from __future__ import annotations

ATTN_RES_IMPLS = ("auto", "triton", "torch")
ATTN_RES_RECOMPUTE = (None, "full")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_attn_res(config, error) -> None:
    """Raise ``error`` (``ConfigError``) naming the bad ``attn_res*`` key; set what AttnRes needs."""
    if not isinstance(config.attn_res, bool):
        raise error(f"attn_res={config.attn_res!r} must be true or false")
    if not isinstance(config.attn_res_inplace_source_grads, bool):
        raise error(f"attn_res_inplace_source_grads={config.attn_res_inplace_source_grads!r} must be true or false")
    if not isinstance(config.attn_res_fuse_norm, bool):
        raise error(f"attn_res_fuse_norm={config.attn_res_fuse_norm!r} must be true or false")
    if not isinstance(config.attn_res_pair_backward, bool):
        raise error(f"attn_res_pair_backward={config.attn_res_pair_backward!r} must be true or false")
    if config.attn_res_impl not in ATTN_RES_IMPLS:
        raise error(f"attn_res_impl={config.attn_res_impl!r}; allowed: {', '.join(ATTN_RES_IMPLS)}")
    if not config.attn_res:
        return
    sublayers = 2 * config.num_layers
    if config.attn_res_block_size is not None:
        size = config.attn_res_block_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1 or sublayers % size:
            raise error(
                f"attn_res_block_size={size!r} must divide the {sublayers} sublayers "
                f"(2 x num_layers); allowed: {_divisors(sublayers)}"
            )
    else:
        n = config.attn_res_num_blocks
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or sublayers % n:
            raise error(
                f"attn_res_num_blocks={n!r} must divide the {sublayers} sublayers "
                f"(2 x num_layers); allowed: {_divisors(sublayers)}"
            )
    if config.recompute_granularity not in ATTN_RES_RECOMPUTE:
        raise error(
            f"recompute_granularity={config.recompute_granularity!r} is not supported with "
            "attn_res; allowed: none or 'full'"
        )


def set_attn_res_pipeline_fields(config) -> None:
    """Megatron fields AttnRes needs, set after Megatron's own ``__post_init__`` checks.

    The pipeline tensor holds all depth sources; its size changes from stage to stage, so
    Megatron must exchange shapes before each p2p transfer (``variable_seq_lengths``). Set after
    Megatron's checks because one of them rejects it for the default ``allgather`` MoE token
    dispatcher, which our MoE layer (its own all-to-all dispatcher) does not use.
    """
    if config.attn_res and config.pipeline_model_parallel_size > 1:
        config.variable_seq_lengths = True
