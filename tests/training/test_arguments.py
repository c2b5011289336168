"""Config loader: YAML + flags -> validated dataclasses, routing, coercion and clear errors."""

import json
from dataclasses import dataclass
from typing import Literal, Optional

import pytest

from megatron_ext.training.arguments import (
    TRAINING_SECTIONS,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ParallelConfig,
    Section,
    TrainingConfig,
    load_config,
)


@dataclass
class StandInModelConfig:
    """Stands in for the integrator's model config (a TransformerConfig subclass)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: Optional[int] = None
    kda_gate: Literal["lower_bounded", "softplus"] = "lower_bounded"
    g_min: float = -5.0
    graph_the_router: Optional[bool] = None  # null: decided per device
    not_user_settable: int = 7
    tensor_model_parallel_size: int = 1  # a Megatron ModelParallelConfig field

    def __post_init__(self):
        if not -5.0 <= self.g_min < 0:
            raise ValueError(f"g_min must be in [-5, 0), got {self.g_min}")


MODEL_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "kda_gate", "g_min", "graph_the_router")


def _build_model(values, built):
    par = built[ParallelConfig]
    return StandInModelConfig(tensor_model_parallel_size=par.tensor_model_parallel_size, **values)


SECTIONS = [*TRAINING_SECTIONS, Section(StandInModelConfig, MODEL_KEYS, _build_model)]


def _write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_file_then_flags_override_and_route_to_owners(tmp_path):
    path = _write(tmp_path, "num_layers: 4\nhidden_size: 64\nmicro_batch_size: 2\nlr: 1e-3\n"
                            "tensor_model_parallel_size: 2\nsequence_parallel: true\n"
                            "data_path: [a/b, c/d]\nlr_decay_style: linear\n")
    cfg = load_config(SECTIONS, ["--config", path, "--micro-batch-size", "4", "--no-sequence-parallel",
                                 "--g-min", "-2.5", "--data-path", "x", "--global-batch-size=16",
                                 "--bf16", "--save", "ckpt"], world_size=4)
    train, par, data = cfg[TrainingConfig], cfg[ParallelConfig], cfg[DataConfig]
    model = cfg[StandInModelConfig]
    assert train.micro_batch_size == 4 and train.lr == 1e-3 and train.bf16 is True
    assert train.global_batch_size == 16 and train.lr_decay_style == "linear"
    assert par.tensor_model_parallel_size == 2 and par.sequence_parallel is False
    assert data.data_path == ["x"] and cfg[CheckpointConfig].save == "ckpt"
    assert (model.num_layers, model.hidden_size, model.g_min) == (4, 64, -2.5)
    assert model.tensor_model_parallel_size == 2  # injected by the section's build
    assert cfg.sources["micro_batch_size"] == "command line" and cfg.sources["lr"] == path
    merged = cfg.to_dict()
    assert json.loads(json.dumps(merged)) == merged
    assert merged["micro_batch_size"] == 4 and merged["num_layers"] == 4 and "not_user_settable" in merged


def test_defaults_and_global_batch_from_dp():
    cfg = load_config(SECTIONS, ["--num-layers", "2", "--hidden-size", "8", "--micro-batch-size", "3"],
                      world_size=4)
    assert cfg[TrainingConfig].global_batch_size == 3 * 4
    assert cfg[LoggingConfig].log_interval == LoggingConfig().log_interval


@pytest.mark.parametrize("argv, match", [
    (["--micro-bach-size", "2"], r"unknown config key 'micro_bach_size'.*did you mean micro_batch_size"),
    (["--not-user-settable", "2"], r"unknown config key 'not_user_settable'"),
    (["--micro-batch-size", "two"], r"micro_batch_size = 'two'.*expected int"),
    (["--lr-decay-style", "exp"], r"lr_decay_style = 'exp'.*one of 'cosine', 'linear', 'constant'"),
    (["--bf16=maybe"], r"bf16 = 'maybe'.*expected bool"),
    (["--micro-batch-size", "0"], r"micro_batch_size: must be >= 1, got 0 \(from command line\)"),
    (["--min-lr", "1", "--lr", "0.1"], r"min_lr: must be in \[0, lr=0.1\]"),
    (["--sequence-parallel"], r"sequence_parallel: needs tensor_model_parallel_size > 1"),
    (["--max-skipped-nonfinite-steps", "-1"], r"max_skipped_nonfinite_steps: must be >= 0 \(0: stop at the first"),
    (["--exit-signal-handler=sometimes"], r"exit_signal_handler = 'sometimes'.*expected bool"),
    (["--g-min", "-7"], r"invalid StandInModelConfig: g_min must be in \[-5, 0\)"),
    (["--global-batch-size", "6", "--micro-batch-size", "2"],
     r"global_batch_size: must be divisible by micro_batch_size \(2\) x data-parallel size \(4\)"),
    (["--tensor-model-parallel-size", "3"], r"tensor \(3\) x pipeline \(1\) parallel size must divide"),
    (["--expert-model-parallel-size", "8"], r"expert \(8\) x expert-tensor \(1\)"),
    (["--no-lr", "1"], r"unknown config key 'no_lr'|only bool keys"),
    (["--split", "0,1"], r"split: comma-separated"),
    (["--manual-gc-interval", "-1"], r"manual_gc_interval: must be >= 0 \(0: no collections during training\)"),
    (["--keep-last-checkpoints", "0"], r"keep_last_checkpoints: must be >= 1 or null, got 0"),
])
def test_bad_flags_fail_with_the_key_and_what_is_allowed(argv, match):
    with pytest.raises(ConfigError, match=match):
        load_config(SECTIONS, ["--num-layers", "2", "--hidden-size", "8", *argv], world_size=4)


def test_bad_file_keys_and_values_name_the_file(tmp_path):
    path = _write(tmp_path, "num_layers: 2\nhidden_size: 8\nseq_lenght: 64\n")
    with pytest.raises(ConfigError, match=r"'seq_lenght' in .*cfg.yaml; did you mean seq_length"):
        load_config(SECTIONS, ["--config", path])
    path = _write(tmp_path, "num_layers: 2\nhidden_size: 8\ntrain_iters: 1.5\n")
    with pytest.raises(ConfigError, match=r"train_iters = 1.5 \(from .*cfg.yaml\): expected int"):
        load_config(SECTIONS, ["--config", path])
    path = _write(tmp_path, "training:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="keys are flat"):
        load_config(SECTIONS, ["--config", path])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(SECTIONS, ["--config", str(tmp_path / "missing.yaml")])


def test_optional_values_accept_null_and_duplicate_owners_are_rejected():
    cfg = load_config(SECTIONS, ["--num-layers", "2", "--hidden-size", "8", "--ffn-hidden-size", "null",
                                 "--virtual-pipeline-model-parallel-size", "none"])
    assert cfg[StandInModelConfig].ffn_hidden_size is None
    with pytest.raises(TypeError, match="owned by both"):
        load_config([ParallelConfig, StandInModelConfig], [])


@pytest.mark.parametrize("flags, expected", [([], None), (["--graph-the-router"], True),
                                             (["--no-graph-the-router"], False), (["--graph-the-router=null"], None),
                                             (["--graph-the-router", "false"], False)])
def test_optional_bool_keys_take_the_bool_flag_forms_and_null(flags, expected):
    cfg = load_config(SECTIONS, ["--num-layers", "2", "--hidden-size", "8", *flags])
    assert cfg[StandInModelConfig].graph_the_router is expected


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit):
        load_config(SECTIONS, ["--help"])
    out = capsys.readouterr().out
    for key in ("--micro-batch-size", "--g-min", "--data-path", "--no-load-optim", "--tensorboard-dir"):
        assert key in out
