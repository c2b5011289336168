"""Every shipped config loads, and its layout fits the world size it is written for."""

from pathlib import Path

import pytest

from megatron_ext.config import HybridConfig
from megatron_ext.parallel import validate_layout
from megatron_ext.training.arguments import TRAINING_SECTIONS, ParallelConfig, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WORLD = {"tiny.yaml": 2, "h200.yaml": 1, "h200x2.yaml": 2, "cluster-64gpu.yaml": 64, "cluster-512gpu.yaml": 512,
         "kimi-linear-tiny.yaml": 2, "kimi-linear-h200x8.yaml": 8, "gmin-sweep.yaml": 1, "gmin-sweep-tiny.yaml": 1}


def _load(name: str, world: int):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train", CONFIGS.parent / "launch" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    return load_config([*TRAINING_SECTIONS, train.model_section()], [], config_path=str(CONFIGS / name),
                       world_size=world)


def test_every_config_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(WORLD)


@pytest.mark.parametrize("name", sorted(WORLD))
def test_config_layout_divides_its_world(name):
    cfg = _load(name, WORLD[name])
    model = cfg[HybridConfig]
    dp = validate_layout(model, WORLD[name])
    par = cfg[ParallelConfig]
    assert dp * par.tensor_model_parallel_size * par.pipeline_model_parallel_size == WORLD[name]
    assert model.padded_vocab_size() % par.tensor_model_parallel_size == 0
