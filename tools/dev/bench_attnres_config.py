"""Block AttnRes step overhead in a training config: the config as it is against ``attn_res: false``.

Where ``tools/bench_attnres.py`` times a dense stand-in model (both models resident, interleaved), this
times the model a training config builds (default ``configs/h200.yaml``, the one-H200 config: MoE with
64 experts, KDA 3:1, quantile balancing, Block AttnRes), which is too large for two copies on one GPU.
So the two models are built afresh in alternating order (standard, AttnRes, AttnRes, standard, ...;
``--rounds`` of each), each timed over ``--steps`` training steps after ``--warmup`` (forward + backward +
optimizer + the router-bias update, as ``launch/train.py`` steps; ``bench_training.time_training_step``).
Reports the median step of each model's runs, the median of the per-round ratios, peak memory and the
runs themselves. The batch is the config's ``micro_batch_size`` x ``seq_length`` (one micro-batch).

Flags after ``--`` go to the config loader as in training (``--config PATH --key value``; flags win):

    python tools/dev/bench_attnres_config.py [--out docs/bench/attnres-config-h200.json]
    python tools/dev/bench_attnres_config.py -- --config configs/h200.yaml --seq-length 8192
    python tools/dev/bench_attnres_config.py --smoke          # configs/tiny.yaml on the CPU, one rank
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the Triton interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import datetime
import statistics
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools import bench_common, bench_training  # noqa: E402

DEFAULT_CONFIG = "configs/h200.yaml"
DEFAULT_OUT = "docs/bench/attnres-config-h200.json"
# The smoke run: tiny.yaml on one CPU rank, few tokens.
SMOKE_FLAGS = ["--config", "configs/tiny.yaml", "--expert-model-parallel-size", "1", "--seq-length", "32",
               "--micro-batch-size", "2", "--global-batch-size", "2"]


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    config_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help=f"JSON path (default on GPU: {DEFAULT_OUT}; smoke: none)")
    p.add_argument("--smoke", action="store_true", help="configs/tiny.yaml on the CPU (code path check)")
    p.add_argument("--rounds", type=int, default=None, help="builds of each model (default 3 GPU, 1 smoke)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per build (default 10 GPU, 2 smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per build (default 3 GPU, 1 smoke)")
    args = p.parse_args(argv)
    args.config_flags = (SMOKE_FLAGS if args.smoke else ["--config", DEFAULT_CONFIG]) + config_flags
    return args


def load_configs(flags: list[str]):
    """(training config, the model config as given, the same with ``attn_res=False``) from the loader."""
    import dataclasses

    from launch.train import model_section
    from megatron_ext.config import HybridConfig
    from megatron_ext.training.arguments import load_config
    from megatron_ext.training.sections import TRAINING_SECTIONS, TrainingConfig

    loaded = load_config([*TRAINING_SECTIONS, model_section()], flags, world_size=1)
    model = loaded[HybridConfig]
    if not model.attn_res:
        raise SystemExit(f"{flags}: the config has attn_res off; this compares it against attn_res: false")
    return loaded[TrainingConfig], model, dataclasses.replace(model, attn_res=False)


def time_alternating(configs: dict, train, rounds: int, steps: int, warmup: int, seed: int = 1234) -> dict:
    """Each model built and timed ``rounds`` times, the order reversed every other round. Every build starts
    from the same seed: the same weights, so the same routing (a model's step time moves with its experts'
    loads) in every build of a model."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.moe.router import update_expert_biases
    from megatron_ext.parallel import build_model_chunks

    def build(config):
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        return build_model_chunks(config)

    bias_group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(rounds):
        for name in (list(configs) if r % 2 == 0 else list(reversed(configs))):
            config = configs[name]
            result = bench_training.time_training_step(
                lambda config=config: build(config), config, config.vocab_size, train.seq_length,
                train.micro_batch_size, warmup, steps, after_step=lambda chunks: update_expert_biases(chunks, bias_group),
                main_grad_dtype="auto")
            print(f"> round {r + 1}/{rounds} {name}: {result['step_ms']:.2f} ms/step, {result['peak_gb']:.2f} GB",
                  flush=True)
            runs[name].append(result)
    return runs


def run(args) -> dict:
    from megatron_ext.parallel import initialize_parallel

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run on a GPU, or pass --smoke for the CPU code-path check")
    rounds = args.rounds or (3 if cuda else 1)
    steps = args.steps or (10 if cuda else 2)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    bench_common.init_process_group(cuda)
    train, attn_res_config, standard_config = load_configs(args.config_flags)
    initialize_parallel(standard_config, seed=1234)
    runs = time_alternating({"standard": standard_config, "attnres": attn_res_config}, train, rounds, steps, warmup)
    step_ms = {name: [r["step_ms"] for r in rs] for name, rs in runs.items()}
    ratios = [a / s for a, s in zip(step_ms["attnres"], step_ms["standard"])]
    return {
        "standard_step_ms": statistics.median(step_ms["standard"]),
        "attnres_step_ms": statistics.median(step_ms["attnres"]),
        "overhead_round_median": statistics.median(ratios) - 1,
        "round_ms": step_ms,
        "standard_peak_mem_gb": max(r["peak_gb"] for r in runs["standard"]),
        "attnres_peak_mem_gb": max(r["peak_gb"] for r in runs["attnres"]),
        "standard_optimizer_ms": statistics.median(r["optimizer_ms"] for r in runs["standard"]),
        "attnres_optimizer_ms": statistics.median(r["optimizer_ms"] for r in runs["attnres"]),
        "main_grad_dtype": runs["attnres"][0]["main_grad_dtype"],
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"config_flags": args.config_flags, "seq": train.seq_length,
                     "micro_batch": train.micro_batch_size, "rounds": rounds, "steps": steps, "warmup": warmup,
                     "attn_res_num_blocks": attn_res_config.attn_res_num_blocks,
                     "attn_res_pair_backward": attn_res_config.attn_res_pair_backward, "smoke": not cuda},
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(f"{result['device']}  {result['date']}  {' '.join(args.config_flags)}")
    for name in ("standard", "attnres"):
        runs = " / ".join(f"{ms:.2f}" for ms in result["round_ms"][name])
        print(f"{name:<10} median {result[f'{name}_step_ms']:.2f} ms (runs {runs}), "
              f"peak {result[f'{name}_peak_mem_gb']:.2f} GB")
    print(f"AttnRes step overhead: {result['attnres_step_ms'] / result['standard_step_ms'] - 1:+.1%} (medians; "
          f"median of the rounds' ratios {result['overhead_round_median']:+.1%})")
    bench_common.finish_run(result, args.out or (None if args.smoke else DEFAULT_OUT))
    return result


if __name__ == "__main__":
    main()
