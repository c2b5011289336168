"""Parallelism, one plain function per step (torchtitan style), all on Megatron-Core's pieces.

* :func:`validate_layout` - refuses a TP/PP/VPP/EP/DP layout that cannot work, before any
  process group exists, naming the setting and the values that would work;
* :func:`initialize_parallel` - Megatron's process groups and model-parallel RNG; :func:`destroy_parallel` tears
  them down, communicators included, for a process that builds them again (:func:`registered_groups` first);
* :func:`build_model_chunks` - one model chunk per virtual pipeline stage of this rank;
* :func:`wrap_ddp` - Megatron DDP (expert params reduced over the expert-data-parallel group), gradients in
  fp32 or bf16 (:func:`resolve_main_grad_dtype`);
* :func:`build_optimizer` - Megatron's (distributed) AdamW; with ``fast_step`` one fused AdamW + clip +
  bf16-copy pass per tensor (torch's fused Adam where that does not apply) and foreach grad norms.

The layout lives in the Megatron fields of :class:`~megatron_ext.config.HybridConfig`
(``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
``virtual_pipeline_model_parallel_size``, ``expert_model_parallel_size``, ``sequence_parallel``);
the data-parallel size is what the world leaves.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_ext import checkpoint_fixes, speed_patches
from megatron_ext.config import ConfigError, HybridConfig
from megatron_ext.model import build_model


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_layout(config: HybridConfig, world_size: int) -> int:
    """Check that the layout fits ``world_size`` and the model; return the data-parallel size."""
    tp = config.tensor_model_parallel_size
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    ep = config.expert_model_parallel_size
    for name, value in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("expert_model_parallel_size", ep),
    ):
        if value < 1:
            raise ConfigError(f"{name}={value} must be >= 1")
    if world_size % (tp * pp):
        raise ConfigError(
            f"tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size ({pp}) = {tp * pp} "
            f"does not divide the world size {world_size}; products that do: {_divisors(world_size)}"
        )
    dp = world_size // (tp * pp)
    # Experts are spread over EP ranks taken from the TP x DP ranks of a stage (expert TP = 1).
    if (tp * dp) % ep:
        raise ConfigError(
            f"expert_model_parallel_size={ep} must divide tensor x data parallel size "
            f"({tp} x {dp} = {tp * dp}) of a pipeline stage; allowed: {_divisors(tp * dp)}"
        )
    if config.num_moe_experts is not None and config.num_moe_experts % ep:
        raise ConfigError(
            f"num_moe_experts={config.num_moe_experts} is not divisible by "
            f"expert_model_parallel_size={ep}; allowed EP sizes: {_divisors(config.num_moe_experts)}"
        )
    if config.num_moe_experts is None and ep > 1:
        raise ConfigError(f"expert_model_parallel_size={ep} needs num_moe_experts to be set")
    stages = pp * (vpp or 1)
    if config.num_layers % stages:
        raise ConfigError(
            f"num_layers={config.num_layers} is not divisible by pipeline_model_parallel_size"
            f" x virtual_pipeline_model_parallel_size = {stages}; stage counts that divide it: "
            f"{_divisors(config.num_layers)}"
        )
    if vpp is not None and pp < 2:
        raise ConfigError(
            f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size >= 2"
        )
    heads_kv = config.num_query_groups or config.num_attention_heads
    if config.num_attention_heads % tp or heads_kv % tp:
        raise ConfigError(
            f"tensor_model_parallel_size={tp} must divide num_attention_heads="
            f"{config.num_attention_heads} and num_query_groups={heads_kv}; allowed: "
            f"{[d for d in _divisors(heads_kv) if config.num_attention_heads % d == 0]}"
        )
    if config.padded_vocab_size() % tp:
        raise ConfigError(
            f"tensor_model_parallel_size={tp} must divide the padded vocabulary "
            f"({config.padded_vocab_size()}); raise make_vocab_size_divisible_by to a multiple of {tp}"
        )
    if tp > 1 and config.num_moe_experts is not None and not config.sequence_parallel:
        raise ConfigError(
            "sequence_parallel must be true when tensor_model_parallel_size > 1 with MoE layers "
            "(each TP rank routes its own sequence shard)"
        )
    return dp


def initialize_parallel(config: HybridConfig, seed: int) -> ProcessGroupCollection:
    """Create Megatron's process groups for ``config``'s layout and seed every RNG."""
    validate_layout(config, torch.distributed.get_world_size())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size,
        expert_tensor_parallel_size=1,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def registered_groups() -> set:
    """The process groups torch.distributed holds now (the default one included)."""
    return set(torch.distributed.distributed_c10d._world.pg_map)


def destroy_parallel(groups_before: set) -> None:
    """Undo :func:`initialize_parallel` (or any ``initialize_model_parallel``) in a process that builds the groups
    again, as a benchmark row or a balancer study does: Megatron's ``destroy_model_parallel``, then every group
    registered since ``groups_before`` (:func:`registered_groups`, taken before the build).

    Megatron's teardown drops its references but destroys only its gloo groups: the others stay registered with
    torch.distributed, NCCL communicators and their device buffers included. A one-GPU bench_e2e process gained
    1.6-1.8 GB of device memory outside the caching allocator per rebuild (H100, 2026-12-06) until a later row
    ran out of memory."""
    ps.destroy_model_parallel()
    if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl":
        torch.cuda.synchronize()  # no collective left in flight on a communicator about to go
    for group in registered_groups() - groups_before:
        torch.distributed.destroy_process_group(group)


def build_model_chunks(config: HybridConfig) -> list[torch.nn.Module]:
    """This rank's model chunks: one per virtual pipeline stage (one without interleaving)."""
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        chunk = build_model(
            config,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    return chunks


MAIN_GRAD_DTYPES = ("fp32", "bf16", "auto")


def resolve_main_grad_dtype(main_grad_dtype: str, config, micro_batches_per_step: int | None) -> str:
    """``"fp32"`` or ``"bf16"``: the dtype of Megatron DDP's gradient buffer (``param.main_grad``).

    * ``"fp32"`` - Megatron DDP with ``grad_reduce_in_fp32=True``: gradients are accumulated over micro-batches
      and reduced over data-parallel ranks in fp32 (what our runs used before);
    * ``"bf16"`` - ``grad_reduce_in_fp32=False`` (Megatron's own default): the buffer has the parameters' dtype,
      so accumulation and reduction round to bf16 after each sum. Needs bf16 parameters (``bf16: true``);
    * ``"auto"`` - ``"bf16"`` where it changes no number: bf16 parameters, one micro-batch per step and one rank
      holding every copy of every parameter (data-parallel, expert-data-parallel, pipeline and tensor-parallel
      sizes 1). Then nothing is ever added into the buffer (each bf16 autograd gradient is just copied in), so
      the fp32 buffer would hold exactly the bf16 values. Otherwise ``"fp32"``. One flag covers both of DDP's
      buffers (dense and expert), so one rank more anywhere (e.g. EP over 2 GPUs, whose dense weights are
      data-parallel) gives ``"fp32"``; the pipeline and tensor-parallel sizes count because Megatron also sums
      gradients across them (tied embeddings between the first and last stage, sequence-parallel norm weights).
      ``micro_batches_per_step`` must be given. One case it cannot see: a parameter whose gradient arrives in
      two backward calls of one micro-batch (used both inside and outside a re-entrant activation-recompute
      segment) is summed in bf16; choose ``"fp32"`` for such a model.

    With bf16 main grads the fused optimizer step (``build_optimizer(fast_step=True)``) reads them directly; see
    :mod:`megatron_ext.speed_patches`. Megatron's own optimizer (``fast_step=False``) works too but makes an
    fp32 copy of every gradient.
    """
    if main_grad_dtype not in MAIN_GRAD_DTYPES:
        raise ConfigError(f"main_grad_dtype={main_grad_dtype!r}; allowed: {', '.join(MAIN_GRAD_DTYPES)}")
    if main_grad_dtype == "fp32":
        return "fp32"
    if not config.bf16:
        if main_grad_dtype == "bf16":
            raise ConfigError("main_grad_dtype='bf16' needs bf16 parameters (bf16: true); allowed here: fp32, auto")
        return "fp32"
    if main_grad_dtype == "bf16":
        return "bf16"
    if micro_batches_per_step is None:
        raise ConfigError("main_grad_dtype='auto' needs the number of micro-batches per step")
    replicas = (ps.get_data_parallel_world_size(), ps.get_expert_data_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    return "bf16" if micro_batches_per_step == 1 and all(n == 1 for n in replicas) else "fp32"


def wrap_ddp(
    chunks: list[torch.nn.Module],
    config: HybridConfig,
    use_distributed_optimizer: bool = False,
    overlap_grad_reduce: bool = False,
    fresh_main_grads: bool = True,
    main_grad_dtype: str = "fp32",
    micro_batches_per_step: int | None = None,
    stream: torch.cuda.Stream | None = None,
) -> list[DistributedDataParallel]:
    """Megatron DDP around each chunk. ``main_grad_dtype`` (``fp32`` | ``bf16`` | ``auto``, see
    :func:`resolve_main_grad_dtype`; ``auto`` needs ``micro_batches_per_step``): the dtype gradients are
    accumulated and reduced in; the default ``fp32`` is what we always did. ``fresh_main_grads``: the step's
    first gradients are copied into the buffer instead of a zero fill plus add
    (:func:`megatron_ext.speed_patches.use_fresh_main_grads`); ``False`` is Megatron's own behaviour.
    ``stream``: DDP is built with it current. Autograd accumulates a parameter's gradient on the stream its
    AccumulateGrad node was made on, and Megatron's DDP makes (and keeps) those nodes here: a step captured in
    a CUDA graph (``cuda_graph_step``) passes its capture stream, as a capture cannot wait on the default stream."""
    dtype = resolve_main_grad_dtype(main_grad_dtype, config, micro_batches_per_step)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=dtype == "fp32",
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    with torch.cuda.stream(stream):  # None: no-op
        wrapped = [
            DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
    if stream is not None:  # the buffers DDP filled on ``stream`` are read on the current one next
        torch.cuda.current_stream().wait_stream(stream)
    if fresh_main_grads:
        for ddp in wrapped:
            speed_patches.use_fresh_main_grads(ddp)
    # Megatron's schedules call this after the last microbatch: DP/SP/embedding grad reductions.
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(
    chunks: list[DistributedDataParallel],
    *,
    lr: float,
    min_lr: float = 0.0,
    weight_decay: float = 0.1,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.95,
    adam_eps: float = 1e-8,
    clip_grad: float = 1.0,
    bf16: bool = False,
    use_distributed_optimizer: bool = False,
    fast_step: bool = True,
):
    """Megatron's AdamW (distributed over DP ranks when asked) for the DDP-wrapped chunks. With ``fast_step``
    (default) the mixed-precision optimizer steps with one kernel per tensor (AdamW + clip coefficient +
    bf16 model copy: :func:`megatron_ext.speed_patches.use_fused_adamw_step`), others on torch's fused Adam
    (:func:`use_fused_adam`), with foreach grad norms (:func:`megatron_ext.speed_patches.scoped_fast_fallbacks`);
    ``False`` keeps what Megatron-Core does without TE/Apex."""
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        clip_grad=clip_grad,
        bf16=bf16,
        params_dtype=torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    checkpoint_fixes.fix_optimizer_checkpoints(optimizer)
    if fast_step:
        use_fused_adam(optimizer)
        speed_patches.use_fused_adamw_step(optimizer)
        speed_patches.scoped_fast_fallbacks(optimizer)
    return optimizer


def use_fused_adam(optimizer) -> int:
    """Run every torch Adam/AdamW inside a Megatron optimizer (chained or not) on torch's fused kernel.

    Without Transformer Engine or Apex, Megatron-Core builds ``torch.optim.AdamW`` with torch's default
    foreach path, whose temporaries hold about two fp32 copies of the parameters at the step's peak and which
    makes several passes over the state; the fused kernel makes one. The update is the same (tested). Must
    run before the first step (the step counters are created on the device then). Returns the number of
    param groups switched.
    """
    switched = 0
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", wrapper)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        if inner.state:
            raise ValueError("use_fused_adam must run before the optimizer's first step")
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False
            switched += 1
    return switched
