"""The training-side config sections: parallel layout, training, data, checkpoints, logging.

Each is a dataclass whose fields are flat config keys with Megatron-LM's names; values are
checked in ``__post_init__`` and a bad one raises ``ConfigError`` naming the key and what is
allowed. The loader that fills them from YAML and flags is ``megatron_ext.training.arguments``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_ext.errors import ConfigError


def _require(ok: bool, key: str, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {allowed}")




@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1  # our MoE layer keeps whole experts on a rank
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False

    def __post_init__(self):
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "expert_model_parallel_size"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            _require(vpp >= 1, "virtual_pipeline_model_parallel_size", f"must be >= 1, got {vpp}")
            _require(vpp == 1 or self.pipeline_model_parallel_size > 1,
                     "virtual_pipeline_model_parallel_size",
                     "needs pipeline_model_parallel_size > 1 (interleaved schedule)")
        etp = self.expert_tensor_parallel_size
        _require(etp is None or etp >= 1, "expert_tensor_parallel_size", f"must be >= 1, got {etp}")
        _require(not self.sequence_parallel or self.tensor_model_parallel_size > 1,
                 "sequence_parallel", "needs tensor_model_parallel_size > 1")

    def data_parallel_size(self, world_size: int) -> int:
        """Dense data-parallel size for ``world_size`` ranks (checks divisibility)."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        _require(world_size % (tp * pp) == 0, "tensor_model_parallel_size",
                 f"tensor ({tp}) x pipeline ({pp}) parallel size must divide the world size "
                 f"({world_size})")
        ep = self.expert_model_parallel_size
        etp = self.expert_tensor_parallel_size or tp
        _require((world_size // pp) % (ep * etp) == 0, "expert_model_parallel_size",
                 f"expert ({ep}) x expert-tensor ({etp}) parallel size must divide "
                 f"world_size / pipeline = {world_size // pp}")
        return world_size // (tp * pp)


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # None: micro_batch_size x data-parallel size
    seq_length: int = 128
    train_iters: int = 100
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None  # None: train_iters
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    bf16: bool = False
    # Megatron DDP's gradient buffer (megatron_ext.parallel.resolve_main_grad_dtype): fp32 (accumulate and
    # reduce in fp32), bf16 (Megatron's default: in the bf16 parameters' dtype), or auto: bf16 where that
    # changes no number (bf16, one micro-batch per step, one rank), else fp32.
    main_grad_dtype: Literal["fp32", "bf16", "auto"] = "auto"
    # Python's garbage collector (megatron_ext/training/manual_gc.py, Megatron-LM's --manual-gc): automatic
    # collection off during training, the start-up objects frozen out of collections, one collection every
    # manual_gc_interval steps (0: none). Automatic full collections took ~240 ms on the H200 host.
    manual_gc: bool = True
    manual_gc_interval: int = 100
    # A step whose loss or grad norm is NaN/inf is not applied (megatron_ext/training/nonfinite_guard.py: one host
    # read per step); the run stops once more than max_skipped_nonfinite_steps were skipped (0: at the first).
    check_for_nan_in_loss_and_grad: bool = True
    max_skipped_nonfinite_steps: int = 0
    # Each step's forward and backward replayed from one CUDA graph after two eager steps
    # (megatron_ext/training/step_graph.py): one process on a GPU, no host reads in the step.
    cuda_graph_step: bool = False

    def __post_init__(self):
        for key in ("micro_batch_size", "seq_length", "train_iters"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        gbs = self.global_batch_size
        _require(gbs is None or gbs >= 1, "global_batch_size", f"must be >= 1, got {gbs}")
        _require(self.lr >= 0, "lr", f"must be >= 0, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}")
        decay = self.lr_decay_iters
        _require(decay is None or decay >= 1, "lr_decay_iters", f"must be >= 1, got {decay}")
        # Megatron's scheduler needs warmup to end before decay does.
        decay_end = self.train_iters if decay is None else decay
        _require(0 <= self.lr_warmup_iters < decay_end, "lr_warmup_iters",
                 f"must be in [0, {decay_end}) (lr_decay_iters, or train_iters), "
                 f"got {self.lr_warmup_iters}")
        _require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        for key in ("adam_beta1", "adam_beta2"):
            _require(0 <= getattr(self, key) < 1, key, f"must be in [0, 1), got {getattr(self, key)}")
        _require(self.adam_eps > 0, "adam_eps", f"must be > 0, got {self.adam_eps}")
        _require(self.clip_grad >= 0, "clip_grad", f"must be >= 0 (0 disables), got {self.clip_grad}")
        _require(self.max_skipped_nonfinite_steps >= 0, "max_skipped_nonfinite_steps",
                 f"must be >= 0 (0: stop at the first skipped step), got {self.max_skipped_nonfinite_steps}")
        _require(self.manual_gc_interval >= 0, "manual_gc_interval",
                 f"must be >= 0 (0: no collections during training), got {self.manual_gc_interval}")
        _require(self.main_grad_dtype in ("fp32", "bf16", "auto"), "main_grad_dtype",
                 f"one of 'fp32', 'bf16', 'auto', got {self.main_grad_dtype!r}")
        _require(self.main_grad_dtype != "bf16" or self.bf16, "main_grad_dtype",
                 "'bf16' needs bf16: true (fp32 parameters keep fp32 gradients); use 'fp32' or 'auto'")


@dataclass
class DataConfig:
    data_path: Optional[list[str]] = None  # None: the stdlib corpus; else Megatron blend list
    split: str = "969,30,1"  # train,valid,test weights
    tokenizer_json: Optional[str] = None  # local Hugging Face tokenizer.json; None: bytes
    data_cache_path: Optional[str] = None  # GPTDataset index cache; None: next to the data
    stdlib_max_mb: Optional[float] = None  # read at most this many MB of stdlib source
    eod_mask_loss: bool = False

    def __post_init__(self):
        _require(self.data_path is None or len(self.data_path) > 0, "data_path",
                 "a non-empty list of .bin/.idx prefixes (optionally weight, prefix pairs), "
                 "or null for the stdlib corpus")
        try:
            weights = [float(w) for w in self.split.split(",")]
        except ValueError:
            weights = []
        _require(0 < len(weights) <= 3 and all(w >= 0 for w in weights) and weights[0] > 0,
                 "split", f"comma-separated train,valid,test weights like '969,30,1', got {self.split!r}")
        mb = self.stdlib_max_mb
        _require(mb is None or mb > 0, "stdlib_max_mb", f"must be > 0 or null, got {mb}")

    def split_weights(self) -> tuple[float, float, float]:
        """Normalised (train, valid, test) fractions."""
        w = [float(x) for x in self.split.split(",")] + [0.0, 0.0]
        total = sum(w[:3])
        return (w[0] / total, w[1] / total, w[2] / total)


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    # After each complete save, delete older checkpoints beyond this many (the new one counted); null keeps all.
    keep_last_checkpoints: Optional[int] = None
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    # SIGTERM/SIGINT: finish the step, save to `save`, exit 0 (megatron_ext/training/exit_signal.py).
    exit_signal_handler: bool = True
    # A resumed job whose LR schedule (lr, min_lr, warm-up, decay) differs from the checkpoint's stops unless one
    # of these says which wins (Megatron-LM's flags; megatron_ext/training/schedule.py).
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False

    def __post_init__(self):
        _require(not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
                 "override_opt_param_scheduler", "and use_checkpoint_opt_param_scheduler: set at most one")
        si = self.save_interval
        _require(si is None or si >= 1, "save_interval", f"must be >= 1 or null, got {si}")
        keep = self.keep_last_checkpoints
        _require(keep is None or keep >= 1, "keep_last_checkpoints", f"must be >= 1 or null, got {keep}")


@dataclass
class LoggingConfig:
    log_interval: int = 10
    tensorboard_dir: Optional[str] = None
    metrics_dir: Optional[str] = None  # metrics.jsonl goes here; None: no jsonl
    eval_interval: int = 1000
    eval_iters: int = 10  # 0 disables evaluation
    peak_tflops: Optional[float] = None  # per-GPU peak for MFU; None: no MFU
    # MoE load images and per-expert counts (TensorBoard, metrics.jsonl) every N iterations and at the end;
    # a multiple of log_interval (they are logged steps); 0: never.
    log_images_interval: int = 100

    def __post_init__(self):
        for key in ("log_interval", "eval_interval"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        images = self.log_images_interval
        _require(images >= 0 and images % self.log_interval == 0, "log_images_interval",
                 f"must be 0 or a multiple of log_interval={self.log_interval}, got {images}")
        _require(self.eval_iters >= 0, "eval_iters", f"must be >= 0, got {self.eval_iters}")
        pk = self.peak_tflops
        _require(pk is None or pk > 0, "peak_tflops", f"must be > 0 or null, got {pk}")


TRAINING_SECTIONS = (ParallelConfig, TrainingConfig, DataConfig, CheckpointConfig, LoggingConfig)
