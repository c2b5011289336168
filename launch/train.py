"""Train the hybrid model: ``torchrun --nproc-per-node N launch/train.py --config configs/X.yaml``.

Flags use Megatron-LM's names (``--tensor-model-parallel-size 2 --train-iters 100 ...``) and
override the YAML file; ``--help`` lists every key. The loop reads top to bottom:

  1. process group, config, parallel state;
  2. model chunks -> Megatron DDP -> Megatron (distributed) AdamW -> LR schedule;
  3. resume from ``--load`` (model, optimizer, scheduler, data position, RNG): the newest
     intact checkpoint of the same model; none there starts from scratch, so ``--load`` =
     ``--save`` makes a job that resumes itself;
  4. per iteration: microbatches through Megatron's pipeline schedule (with ``cuda_graph_step``
     replayed from one CUDA graph after two eager steps), optimizer step (not
     applied when the loss or grad norm is NaN/inf), per-step router-bias updates, logs
     (progress line, TensorBoard, metrics.jsonl);
  5. evaluation and atomic checkpoints every N iterations, at the end, and after the step in
     which SIGTERM/SIGINT arrived (then exit 0).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext import cpu_compat  # noqa: E402
from megatron_ext.errors import ConfigError, DataError  # noqa: E402
from megatron_ext.training.arguments import (  # noqa: E402
    TRAINING_SECTIONS,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ParallelConfig,
    Section,
    TrainingConfig,
    load_config,
)

LAYOUT_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "sequence_parallel",
)


def model_section():
    """The model keys of ``HybridConfig``; layout and dtype come from the training sections."""
    from megatron_ext.config import USER_FIELDS, HybridConfig

    def build(values, built):
        par, train = built[ParallelConfig], built[TrainingConfig]
        dtype = torch.bfloat16 if train.bf16 else torch.float32
        return HybridConfig(
            **{k: getattr(par, k) for k in LAYOUT_KEYS},
            bf16=train.bf16,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            use_cpu_initialization=not torch.cuda.is_available(),
            max_sequence_length=values.pop("max_sequence_length", train.seq_length),
            **values,
        )

    return Section(HybridConfig, fields=USER_FIELDS, build=build)


def init_distributed() -> None:
    # Plain `python launch/train.py` runs as a one-process job.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from megatron_ext.training.rendezvous import init_process_group  # survives torchrun's restarts

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        init_process_group("nccl")
    else:
        cpu_compat.install()
        init_process_group("gloo")


def log0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def main(argv=None) -> None:
    # The config is checked before any process group exists, so a bad key fails fast.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    from megatron_ext.config import HybridConfig

    cfg = load_config([*TRAINING_SECTIONS, model_section()], argv, world_size=world)
    from megatron_ext.parallel import validate_layout

    model_cfg: HybridConfig = cfg[HybridConfig]
    par, train, data_cfg = cfg[ParallelConfig], cfg[TrainingConfig], cfg[DataConfig]
    ckpt_cfg, log_cfg = cfg[CheckpointConfig], cfg[LoggingConfig]
    validate_layout(model_cfg, world)
    from megatron_ext.training.step_graph import StepGraph, capture_stream, check_step_graph

    check_step_graph(train.cuda_graph_step, model_cfg, world, torch.cuda.is_available())
    init_distributed()

    from megatron.core import parallel_state as ps

    from megatron_ext.data.build import build_data_iterators
    from megatron_ext.flops import model_flops_per_token
    from megatron_ext.moe.metrics import collect_moe_metrics, reset_moe_step_statistics
    from megatron_ext.moe.router import discard_expert_bias_statistics, update_expert_biases
    from megatron_ext.parallel import build_model_chunks, build_optimizer, initialize_parallel, wrap_ddp
    from megatron_ext.training.checkpoint_compat import check_same_model
    from megatron_ext.training.checkpointing import (
        check_save_dir, load_checkpoint, save_checkpoint, sharded_training_state,
    )
    from megatron_ext.training.exit_signal import ExitSignal
    from megatron_ext.training.manual_gc import manual_gc
    from megatron_ext.training.metrics_log import MetricsLogger
    from megatron_ext.training.nonfinite_guard import NonFiniteGuard
    from megatron_ext.training.schedule import build_scheduler, check_schedule, load_optimizer_and_schedule
    from megatron_ext.training.step import forward_backward

    if ckpt_cfg.save:  # before any work: an unusable --save fails now, not at the first save
        check_save_dir(ckpt_cfg.save)

    # 1-2. Parallel state, model, DDP, optimizer, schedule.
    initialize_parallel(model_cfg, train.seed)
    micro_per_step = train.global_batch_size // (train.micro_batch_size * ps.get_data_parallel_world_size())
    graph_stream = capture_stream(train.cuda_graph_step)
    chunks = wrap_ddp(
        build_model_chunks(model_cfg), model_cfg, use_distributed_optimizer=par.use_distributed_optimizer,
        main_grad_dtype=train.main_grad_dtype, micro_batches_per_step=micro_per_step, stream=graph_stream,
    )
    optimizer = build_optimizer(
        chunks,
        lr=train.lr,
        min_lr=train.min_lr,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=train.adam_eps,
        clip_grad=train.clip_grad,
        bf16=train.bf16,
        use_distributed_optimizer=par.use_distributed_optimizer,
    )
    scheduler = build_scheduler(optimizer, train)
    step_graph = (StepGraph(chunks, train.seq_length, train.micro_batch_size, stream=graph_stream, log=log0)
                  if train.cuda_graph_step else None)
    guard = NonFiniteGuard(optimizer, loss_group=ps.get_pipeline_model_parallel_group(),
                           enabled=train.check_for_nan_in_loss_and_grad,
                           max_skipped=train.max_skipped_nonfinite_steps)
    exit_signal = ExitSignal(enabled=ckpt_cfg.exit_signal_handler)
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    log0(f"> model: {model_cfg.num_layers} layers, pattern {model_cfg.attention_pattern!r}, "
         f"{n_params / 1e6:.2f}M parameters on rank 0, world {world} "
         f"(TP{par.tensor_model_parallel_size} PP{par.pipeline_model_parallel_size} "
         f"EP{par.expert_model_parallel_size} DP{ps.get_data_parallel_world_size()}), "
         f"{'fp32' if chunks[0].ddp_config.grad_reduce_in_fp32 else 'bf16'} gradient buffer")

    def sharded_state(for_loading: bool, with_optimizer: bool) -> dict:
        return sharded_training_state(chunks, optimizer, for_loading=for_loading, with_optimizer=with_optimizer)

    # 3. Resume.
    iteration, consumed, resumed = 0, 0, False
    if ckpt_cfg.load:
        current_config = cfg.to_dict()

        def check_resume(path, common):  # before the tensors are read
            check_same_model(path, common.get("config"), current_config)
            if not ckpt_cfg.no_load_optim:
                check_schedule(scheduler, common.get("scheduler"), ckpt_cfg, path)

        loaded = load_checkpoint(
            ckpt_cfg.load,
            lambda: sharded_state(True, not ckpt_cfg.no_load_optim),  # built only when there is a checkpoint
            load_rng=not ckpt_cfg.no_load_rng,
            check_common=check_resume,
            log=log0,
        )
        if loaded is None:
            log0(f"> no checkpoint in {ckpt_cfg.load}; starting from scratch")
        else:
            state, common = loaded
            for i, c in enumerate(chunks):
                c.module.load_state_dict(state[f"model{i}"])
            if not ckpt_cfg.no_load_optim:
                load_optimizer_and_schedule(optimizer, scheduler, state["optimizer"], common.get("scheduler"),
                                            ckpt_cfg, ckpt_cfg.load, log=log0)
            iteration, consumed, resumed = common["iteration"], common["consumed_samples"], True
            log0(f"> resumed from {ckpt_cfg.load} at iteration {iteration}")
    last_saved = iteration if resumed else None

    def save(it: int) -> str:
        nonlocal last_saved
        path = save_checkpoint(
            ckpt_cfg.save,
            it,
            sharded_state(False, not ckpt_cfg.no_save_optim),
            {"iteration": it, "consumed_samples": consumed, "scheduler": scheduler.state_dict()},
            config=cfg.to_dict(),
            keep_last=ckpt_cfg.keep_last_checkpoints,
        )
        log0(f"> saved checkpoint {path}")
        last_saved = it
        return path

    # 4. Data and logs.
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    data = build_data_iterators(
        data_cfg,
        seq_length=train.seq_length,
        micro_batch_size=train.micro_batch_size,
        global_batch_size=train.global_batch_size,
        train_iters=train.train_iters,
        seed=train.seed,
        eval_iters=log_cfg.eval_iters,
        dp_rank=dp_rank,
        dp_size=dp_size,
        consumed_samples=consumed,
        log=log0,
    )
    rank = dist.get_rank()
    is_logger = rank == world - 1  # the last pipeline stage holds the loss
    # A resumed run first drops what was logged after its checkpoint (those iterations run again).
    resume_point = dict(resumed_iteration=iteration, resumed_samples=consumed) if resumed else {}
    logger = MetricsLogger(
        train.train_iters,
        tensorboard_dir=log_cfg.tensorboard_dir,
        metrics_dir=log_cfg.metrics_dir,
        enabled=is_logger,
        **resume_point,
    )
    # Per-rank expert load: every rank writes its own TensorBoard run, tensorboard_dir/rank_<r>.
    rank_logger = (
        MetricsLogger(train.train_iters, tensorboard_dir=os.path.join(log_cfg.tensorboard_dir, f"rank_{rank}"),
                      **resume_point)
        if log_cfg.tensorboard_dir and model_cfg.num_moe_experts
        else None
    )
    flops_per_token = model_flops_per_token(model_cfg, train.seq_length)
    bias_group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)

    def run(microbatches, forward_only=False, read_loss=True):
        return forward_backward(
            chunks, microbatches, train.seq_length, train.micro_batch_size, forward_only=forward_only,
            read_loss=read_loss,
        )

    def is_logged(it):  # the same on every rank: the MoE metrics' collectives run on these steps only
        return it % log_cfg.log_interval == 0 or it == train.train_iters

    def is_image_step(it):  # MoE load heatmap and per-expert counts: a logged step
        interval = log_cfg.log_images_interval
        return bool(interval) and (it % interval == 0 or it == train.train_iters)

    def device_time() -> float:  # the host clock once the device has caught up
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    log0(f"> training from iteration {iteration} to {train.train_iters}")
    with manual_gc(train.manual_gc, train.manual_gc_interval) as collect_garbage:
        # Iteration time: the mean over the steps since the last logged one (the host runs ahead of the device
        # between logged steps, so one step's host time says nothing).
        window_start, window_steps = device_time(), 0
        while iteration < train.train_iters:
            for c in chunks:
                c.zero_grad_buffer()
            optimizer.zero_grad()
            # One host read between here and the logging below: the NaN guard's, of the loss and the grad norm
            # inside the step, before the update (they stay device tensors until logged).
            microbatches = [next(data.train) for _ in range(micro_per_step)]
            loss = step_graph(microbatches) if step_graph else run(microbatches, read_loss=False)
            applied, grad_norm = guard.step(loss)  # the same on every rank
            if applied:
                scheduler.step(increment=1)
            iteration += 1
            window_steps += 1
            consumed += train.global_batch_size
            moe = None
            if model_cfg.num_moe_experts:
                if is_logged(iteration) and applied:
                    # Collectives on every rank; before the bias update so bias stats are this step's.
                    moe = collect_moe_metrics(
                        chunks,
                        ps.get_expert_model_parallel_group(),
                        dp_group=bias_group,
                        pp_group=ps.get_pipeline_model_parallel_group(),
                    )
                else:  # the routers' step sums start again at zero, as collect_moe_metrics leaves them
                    reset_moe_step_statistics(chunks)
            if applied:
                update_expert_biases(chunks, bias_group)
            else:  # the skipped step's routing statistics may be NaN: the biases stay too
                discard_expert_bias_statistics(chunks)
            if is_logged(iteration):
                elapsed = (device_time() - window_start) / window_steps
                tokens_per_sec = train.global_batch_size * train.seq_length / elapsed
            if is_logger and is_logged(iteration):
                logger.log_iteration(
                    iteration,
                    consumed_samples=consumed,
                    lm_loss=float(loss),
                    lr=optimizer.param_groups[0]["lr"],
                    grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                    batch_size=train.global_batch_size,
                    iteration_time_s=elapsed,
                    tokens_per_sec=tokens_per_sec,
                    flops_per_token=flops_per_token if torch.cuda.is_available() else None,
                    peak_tflops=log_cfg.peak_tflops,
                    num_gpus=world,
                    extra=(None if moe is None else
                           {**moe.scalars(), **(moe.expert_load_record() if is_image_step(iteration) else {})}),
                )
            if rank_logger is not None and moe is not None and is_logged(iteration):
                moe.log_tensorboard(rank_logger, iteration, rank,
                                    global_logger=logger if is_logger and is_image_step(iteration) else None)
            if not applied:  # past max_skipped_nonfinite_steps this raises: no save after it
                log0(guard.count_skipped_step(iteration, last_saved))
            stop = exit_signal.stop_requested()  # the same on every rank
            evaluate = bool(not stop and log_cfg.eval_iters and data.valid is not None
                            and iteration % log_cfg.eval_interval == 0)
            checkpoint = bool(ckpt_cfg.save and (stop or ckpt_cfg.save_interval
                                                 and iteration % ckpt_cfg.save_interval == 0))
            if evaluate:
                data.valid.reset()
                micro_eval = log_cfg.eval_iters * micro_per_step
                with torch.no_grad():
                    val = run([next(data.valid) for _ in range(micro_eval)], forward_only=True)
                if is_logger:
                    logger.log_validation(iteration, val, consumed)
            # 5. Checkpoints.
            if checkpoint and last_saved != iteration:
                save(iteration)
            if stop:
                where = (f"saved to {ckpt_cfg.save} at iteration {iteration}" if ckpt_cfg.save
                         else "nothing saved (no --save)")
                log0(f"> {exit_signal.name}: stopped after iteration {iteration} of {train.train_iters}; {where}")
                break
            collect_garbage(iteration)
            if is_logged(iteration) or evaluate or checkpoint:  # their time is not the steps'
                window_start, window_steps = device_time(), 0
    if ckpt_cfg.save and last_saved != iteration:
        save(iteration)
    logger.close()
    if rank_logger is not None:
        rank_logger.close()
    dist.barrier()
    log0("> done")
    dist.destroy_process_group()


def _fail(exc: Exception, status: int) -> None:
    """One line, no traceback; every rank fails alike, so rank 0 says it."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {exc}", file=sys.stderr, flush=True)
    sys.exit(status)


if __name__ == "__main__":
    from megatron_ext.training.checkpointing import DamagedCheckpointError
    from megatron_ext.training.nonfinite_guard import TooManySkippedSteps

    try:
        main()
    except (ConfigError, DataError) as exc:  # a bad key, value or data file (or a checkpoint of another model)
        _fail(exc, 2)
    except (DamagedCheckpointError, TooManySkippedSteps) as exc:
        _fail(exc, 1)
