"""Hugging Face Kimi Linear directory -> our dist checkpoint + the YAML config that trains on from it.

The model is built on one rank (every tensor global) and filled from the safetensors files; the saved
dist checkpoint is layout-free (global keys), so ``launch/train.py --load`` reshards it to the layout
written in the YAML (TP/PP/EP with Megatron-LM's names). The checkpoint holds weights only: the YAML
sets ``no_load_optim`` (the optimizer starts fresh, like Megatron-LM's ``--no-load-optim``).
"""

from __future__ import annotations

import json
import os

import torch
import yaml
from safetensors import safe_open

from megatron_ext.convert.dist_reader import one_rank_group
from megatron_ext.convert.kimi_config import from_kimi_config
from megatron_ext.convert.safetensors_out import INDEX_NAME
from megatron_ext.convert.tensor_map import canonical_hf_name, model_conversions
from megatron_ext.errors import ConfigError

LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "expert_model_parallel_size", "sequence_parallel")


class SafetensorsDir:
    """Tensors of a Hugging Face directory by canonical name, opened lazily one at a time."""

    def __init__(self, hf_dir: str):
        index = os.path.join(hf_dir, INDEX_NAME)
        if os.path.isfile(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
                files = {name: "model.safetensors" for name in f.keys()}
        else:
            raise ConfigError(f"{hf_dir}: no {INDEX_NAME} and no model.safetensors")
        self.hf_dir = hf_dir
        self.files = {canonical_hf_name(name): (name, file) for name, file in files.items()}

    def shape(self, name: str) -> tuple:
        stored, file = self.files[name]
        with safe_open(os.path.join(self.hf_dir, file), "pt") as f:
            return tuple(f.get_slice(stored).get_shape())

    def read(self, name: str) -> torch.Tensor:
        stored, file = self.files[name]
        with safe_open(os.path.join(self.hf_dir, file), "pt") as f:
            return f.get_tensor(stored)


def _fill(model_state: dict, source: SafetensorsDir, groups) -> None:
    wanted = {name for group in groups for conv in group for name in conv.hf}
    unexpected = sorted(set(source.files) - wanted)
    if unexpected:
        raise ConfigError(f"unexpected tensor(s) for this config.json: {', '.join(unexpected[:8])}")
    missing = sorted(wanted - set(source.files))
    if missing:
        raise ConfigError(f"missing tensor(s): {', '.join(missing[:8])}" + (f" (+{len(missing) - 8} more)"
                                                                          if len(missing) > 8 else ""))
    for group in groups:
        for conv in group:
            target = model_state.get(conv.ours)
            if target is None:
                if conv.optional and all(not source.read(n).any() for n in conv.hf):
                    continue  # a zero correction bias needs no bias in our router
                raise ConfigError(f"{conv.hf[0]} is non-zero but our model has no {conv.ours}: choose a "
                                  "moe_balancer that keeps an expert bias (sign_bias, qb_bias, qb_both)")
            expected = [tuple(t.shape) for t in conv.split(torch.empty(target.shape, device="meta"))]
            for name, shape in zip(conv.hf, expected):
                if source.shape(name) != shape:
                    raise ConfigError(f"tensor {name} has shape {list(source.shape(name))}; the config implies "
                                      f"{list(shape)}")
            joined = conv.join([source.read(n) for n in conv.hf])
            with torch.no_grad():
                target.copy_(joined)


def _layout_fields(layout: dict) -> dict:
    unknown = sorted(set(layout) - set(LAYOUT_FLAGS))
    if unknown:
        raise ConfigError(f"unknown layout key(s) {unknown}; allowed: {', '.join(LAYOUT_FLAGS)}")
    return {k: v for k, v in layout.items() if v is not None}


def import_checkpoint(hf_dir: str, ckpt_dir: str, layout: dict | None = None, moe_balancer: str = "qb_bias",
                      bf16: bool = False, yaml_path: str | None = None) -> dict:
    """Convert; returns the model fields. ``yaml_path`` defaults to ``CKPT_DIR/train.yaml``."""
    from megatron_ext.config import HybridConfig
    from megatron_ext.parallel import build_model_chunks, initialize_parallel
    from megatron_ext.training.checkpointing import save_checkpoint

    layout = _layout_fields(layout or {})
    with open(os.path.join(hf_dir, "config.json")) as f:
        fields = from_kimi_config(json.load(f))
    if "num_moe_experts" in fields:
        fields["moe_balancer"] = moe_balancer
    try:  # the layout fits the model (heads, experts divisible, ...)
        HybridConfig(params_dtype=torch.float32, use_cpu_initialization=True, **fields, **layout)
    except ValueError as exc:  # Megatron's TransformerConfig checks raise ValueError
        raise ConfigError(f"layout {layout} does not fit the model: {exc}") from exc
    source = SafetensorsDir(hf_dir)
    cfg = HybridConfig(params_dtype=torch.float32, pipeline_dtype=torch.float32, use_cpu_initialization=True,
                       perform_initialization=False, **fields)
    with one_rank_group():
        from megatron.core import parallel_state as ps

        initialize_parallel(cfg, seed=0)
        try:
            (model,) = build_model_chunks(cfg)
            if bf16:
                model = model.bfloat16()  # the decay parameters and the expert bias stay fp32
            _fill(model.state_dict(keep_vars=True), source, model_conversions(cfg))
            saved = {**fields, "bf16": bf16}
            save_checkpoint(ckpt_dir, 0, {"model0": model.sharded_state_dict()},
                            {"consumed_samples": 0}, config=saved)
        finally:
            ps.destroy_model_parallel()
    train_yaml = {**fields, **layout, "bf16": bf16, "load": os.path.abspath(ckpt_dir), "no_load_optim": True}
    with open(yaml_path or os.path.join(ckpt_dir, "train.yaml"), "w") as f:
        f.write(f"# Imported from {os.path.abspath(hf_dir)} by tools/convert_checkpoint.py import.\n"
                "# Add data and training keys (or flags); the optimizer starts fresh (no_load_optim).\n")
        yaml.safe_dump(train_yaml, f, sort_keys=False)
    return fields
