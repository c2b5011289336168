"""MoE load-balancing study: train the tiny MoE model once per balancer, same seed and data.

Balancers: ``none``, ``aux_loss``, ``sign_bias``, ``qb_bias``, ``qb_capacity``, ``qb_both`` (our
router, ``HybridConfig.moe_balancer``) and ``megatron_qb``: Megatron-Core's own
``moe_router_load_balancing_type="quantile_balancing"``. For ``megatron_qb`` the model is built
with our router (``moe_balancer="none"``) and each router's selection is replaced by
:func:`use_megatron_quantile_balancing`: logits -> Megatron's unbound
``TopKRouter.quantile_balancing`` (its ``qb_dual_update`` selection on ``logits - qb_beta`` and
its ``topk_routing_with_score_function`` gates), with Megatron's ``qb_beta`` buffers on our
router; the bias update is Megatron's own ``finalize_model_grads`` -> ``_update_router_qb_beta``
(it runs because the config says ``quantile_balancing``). Nothing of Megatron's code is copied.

Each iteration logs MaxVio (mean and max over the MoE layers, global counts of the step's
microbatches, via :func:`megatron_ext.moe.metrics.collect_moe_metrics`). Writes
``docs/bench/balance.json``, ``docs/bench/balance.md`` and ``docs/balance_study.svg``.

    python tools/balance_study.py [--iters 80] [--balancers none,qb_bias] [--out-dir docs]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import types
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

# ours (megatron_ext.moe.balancers) plus Megatron-Core's own quantile balancing, "megatron_qb"
BALANCERS = ("none", "aux_loss", "sign_bias", "megatron_qb", "qb_bias", "qb_capacity", "qb_both")


@dataclass
class StudyConfig:
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_experts: int = 8
    topk: int = 2
    moe_ffn_hidden_size: int = 64
    seq_length: int = 64
    micro_batch_size: int = 4
    num_microbatches: int = 2
    iters: int = 80
    lr: float = 3e-3
    capacity_factor: float = 1.25
    aux_loss_coeff: float = 1e-2
    sign_bias_rate: float = 1e-3
    seed: int = 1234
    stdlib_max_mb: float = 2.0
    last_n: int = 20  # the markdown table averages MaxVio over the last N iterations


def model_config(study: StudyConfig, balancer: str):
    from megatron_ext.config import HybridConfig
    from megatron_ext.moe.balancers import CAPACITY_BALANCERS

    balancing = {}
    if balancer == "aux_loss":
        balancing = dict(moe_aux_loss_coeff=study.aux_loss_coeff)
    elif balancer == "sign_bias":
        balancing = dict(moe_router_bias_update_rate=study.sign_bias_rate)
    elif balancer in CAPACITY_BALANCERS:
        balancing = dict(moe_expert_capacity_factor=study.capacity_factor)
    elif balancer == "megatron_qb":
        balancing = dict(moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0)
    return HybridConfig(
        num_layers=study.num_layers, hidden_size=study.hidden_size,
        num_attention_heads=study.num_attention_heads, ffn_hidden_size=4 * study.hidden_size,
        num_moe_experts=study.num_experts, moe_router_topk=study.topk,
        moe_ffn_hidden_size=study.moe_ffn_hidden_size, moe_layer_freq=[1] * study.num_layers,
        moe_router_score_function="sigmoid",
        moe_balancer="none" if balancer == "megatron_qb" else balancer,
        max_sequence_length=study.seq_length, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, **balancing)


def _megatron_qb_forward(router, hidden: torch.Tensor):
    """Our router's contract (Routing, counts) with Megatron's quantile-balancing decision."""
    from megatron.core.transformer.moe.router import TopKRouter as MegatronTopKRouter
    from megatron_ext.moe.quantile import Routing
    from megatron_ext.moe.router import expert_counts

    logits = F.linear(hidden.float(), router.weight.float())
    probs, routing_map = MegatronTopKRouter.quantile_balancing(router, logits)
    experts = routing_map.to(torch.int8).topk(router.topk, dim=1).indices  # the k True columns
    zero = torch.zeros((), dtype=torch.int64, device=logits.device)
    routing = Routing(experts, probs.gather(1, experts).float(), zero, zero.clone())
    counts = expert_counts(experts, router.num_experts)
    router.record_statistics(routing, counts, router.training and torch.is_grad_enabled())
    return routing, counts


def use_megatron_quantile_balancing(model_chunks) -> None:
    """Give every router of ``model_chunks`` Megatron's ``qb_beta`` state and QB selection."""
    from megatron_ext.moe.router import TopKRouter

    for chunk in model_chunks:
        for router in [m for m in chunk.modules() if isinstance(m, TopKRouter)]:
            zeros = torch.zeros(router.num_experts, device=router.weight.device)
            router.register_buffer("qb_beta", zeros.clone())
            router.register_buffer("qb_beta_accum", zeros.clone(), persistent=False)
            router.register_buffer("qb_beta_count", torch.zeros((), dtype=torch.long, device=zeros.device),
                                   persistent=False)
            router.tp_cp_group = None  # one rank: Megatron gathers logits over TP x CP only
            router.forward = types.MethodType(_megatron_qb_forward, router)


def _biases(model_chunks) -> list:
    from megatron_ext.moe.router import TopKRouter

    return [getattr(m, "qb_beta", None) if getattr(m, "expert_bias", None) is None else m.expert_bias
            for c in model_chunks for m in c.modules() if isinstance(m, TopKRouter)]


def train_one(study: StudyConfig, balancer: str, log=print) -> dict:
    """Train ``study.iters`` steps with ``balancer`` on one rank; per-iteration curves back."""
    from megatron.core import parallel_state as ps
    from megatron_ext.data.build import build_data_iterators
    from megatron_ext.moe.metrics import collect_moe_metrics
    from megatron_ext.moe.router import update_expert_biases
    from megatron_ext.parallel import (build_model_chunks, build_optimizer, destroy_parallel, initialize_parallel,
                                       registered_groups, wrap_ddp)
    from megatron_ext.training.arguments import DataConfig
    from megatron_ext.training.step import forward_backward

    config = model_config(study, balancer)
    groups_before = registered_groups()
    initialize_parallel(config, study.seed)
    try:
        chunks = build_model_chunks(config)
        if balancer == "megatron_qb":
            use_megatron_quantile_balancing(chunks)
        chunks = wrap_ddp(chunks, config)
        optimizer = build_optimizer(chunks, lr=study.lr, weight_decay=0.0)
        global_batch = study.micro_batch_size * study.num_microbatches
        data = build_data_iterators(DataConfig(stdlib_max_mb=study.stdlib_max_mb), seq_length=study.seq_length,
                                    micro_batch_size=study.micro_batch_size, global_batch_size=global_batch,
                                    train_iters=study.iters, seed=study.seed, log=lambda *_: None).train
        curves = {key: [] for key in ("maxvio", "maxvio_max", "ep_load_factor", "loss", "dropped", "rerouted")}
        start = time.perf_counter()
        for iteration in range(1, study.iters + 1):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            microbatches = [next(data) for _ in range(study.num_microbatches)]
            loss = forward_backward(chunks, microbatches, study.seq_length, study.micro_batch_size)
            optimizer.step()
            scalars = collect_moe_metrics(chunks, ps.get_expert_model_parallel_group(),
                                          dp_group=ps.get_data_parallel_group()).scalars()
            update_expert_biases(chunks, ps.get_data_parallel_group())
            for key, tag in (("maxvio", "moe/maxvio/mean"), ("maxvio_max", "moe/maxvio/max"),
                             ("ep_load_factor", "moe/ep_load_factor/max"), ("dropped", "moe/dropped"),
                             ("rerouted", "moe/rerouted")):
                curves[key].append(scalars[tag])
            curves["loss"].append(loss)
            if iteration == 1 or iteration % 10 == 0 or iteration == study.iters:
                log(f"  [{balancer:>11}] iter {iteration:4d}/{study.iters} | loss {loss:.4f} | "
                    f"MaxVio mean {scalars['moe/maxvio/mean']:.3f} max {scalars['moe/maxvio/max']:.3f} | "
                    f"dropped {scalars['moe/dropped']} | {time.perf_counter() - start:.1f}s")
        bias = [b.tolist() for b in _biases(chunks) if b is not None]
    finally:
        destroy_parallel(groups_before)  # the next balancer builds them again
    return {**curves, "final_loss": curves["loss"][-1], "dropped_total": sum(curves["dropped"]),
            "dropped": sum(curves["dropped"]), "rerouted_total": sum(curves["rerouted"]), "final_bias": bias,
            "seconds": time.perf_counter() - start}


def run_study(study: StudyConfig, balancers=BALANCERS, log=print) -> dict:
    from megatron_ext import cpu_compat

    cpu_compat.install()
    results = {}
    for balancer in balancers:
        log(f"> balancer {balancer}")
        results[balancer] = train_one(study, balancer, log)
    return {"balancers": results, "capacity_factor": study.capacity_factor, "config": asdict(study),
            "date": datetime.date.today().isoformat(), "device": "cpu",
            "notes": ("maxvio[i] = mean over the MoE layers of (max_j load_j - mean load) / mean load, global "
                      "counts of iteration i's microbatches; maxvio_max = max over layers; dropped = pairs "
                      "dropped summed over the run; final_loss = training loss of the last iteration")}


def write_svg(study_result: dict, path: str, width: int = 760, height: int = 420) -> None:
    """MaxVio per iteration per balancer as a hand-written SVG line chart (no matplotlib)."""
    runs = study_result["balancers"]
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    left, right, top, bottom = 60, 170, 30, 45
    iters = max(len(r["maxvio"]) for r in runs.values())
    ymax = max(max(r["maxvio"]) for r in runs.values()) * 1.05 or 1.0
    def px(i, v):
        x = left + (width - left - right) * (i / max(iters - 1, 1))
        return x, top + (height - top - bottom) * (1 - v / ymax)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="18" font-size="14">MaxVio (mean over MoE layers) per iteration</text>']
    for t in range(6):  # y grid
        v = ymax * t / 5
        _, y = px(0, v)
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for t in range(5):  # x ticks
        i = round((iters - 1) * t / 4)
        x, _ = px(i, 0)
        out.append(f'<text x="{x:.1f}" y="{height - bottom + 16}" text-anchor="middle">{i + 1}</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 8}" text-anchor="middle">iteration</text>')
    for n, (name, run) in enumerate(runs.items()):
        color = colors[n % len(colors)]
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in (px(i, v) for i, v in enumerate(run["maxvio"])))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
        y = top + 18 * n
        out.append(f'<line x1="{width - right + 12}" x2="{width - right + 32}" y1="{y}" y2="{y}" stroke="{color}" '
                   f'stroke-width="3"/><text x="{width - right + 38}" y="{y + 4}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def write_markdown(study_result: dict, path: str) -> None:
    cfg = study_result["config"]
    n = cfg["last_n"]
    lines = [
        "# MoE load-balancing study (CPU, tiny model)",
        "",
        f"Generated by `tools/balance_study.py` on {study_result['date']} ({study_result['device']}). "
        f"{cfg['num_layers']} MoE layers, hidden {cfg['hidden_size']}, {cfg['num_experts']} experts top-"
        f"{cfg['topk']}, seq {cfg['seq_length']}, {cfg['micro_batch_size'] * cfg['num_microbatches']} sequences "
        f"per step ({cfg['num_microbatches']} microbatches), {cfg['iters']} iterations, AdamW lr {cfg['lr']}, "
        f"seed {cfg['seed']}, stdlib byte corpus; the same data in every run. Capacity factor "
        f"{study_result['capacity_factor']} (capacity modes), aux-loss coeff {cfg['aux_loss_coeff']}, "
        f"sign-rule rate {cfg['sign_bias_rate']}.",
        "",
        "MaxVio = (max_j load_j - mean load) / mean load on the global counts of one step, averaged over "
        "the MoE layers; max-over-layers is the worst layer in any iteration. Plot: `docs/balance_study.svg`.",
        "",
        f"| balancer | final MaxVio | mean MaxVio, last {n} it. | worst layer MaxVio, any it. | final loss | "
        f"mean loss, last {n} it. | dropped pairs | rerouted pairs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in study_result["balancers"].items():
        tail = r["maxvio"][-n:]
        loss_tail = r["loss"][-n:]
        lines.append(f"| {name} | {r['maxvio'][-1]:.3f} | {sum(tail) / len(tail):.3f} | {max(r['maxvio_max']):.3f} | "
                     f"{r['final_loss']:.4f} | {sum(loss_tail) / len(loss_tail):.4f} | {r['dropped']} | "
                     f"{r['rerouted_total']} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _init_single_process() -> None:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            from tests._dist import free_port

            os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = StudyConfig()
    for key, value in asdict(defaults).items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--balancers", default=",".join(BALANCERS))
    parser.add_argument("--out-dir", default="docs", help="writes bench/balance.{json,md} and balance_study.svg")
    args = vars(parser.parse_args(argv))
    balancers = [b for b in args.pop("balancers").split(",") if b]
    unknown = sorted(set(balancers) - set(BALANCERS))
    if unknown:
        parser.error(f"unknown balancers {unknown}; known: {', '.join(BALANCERS)}")
    out_dir = args.pop("out_dir")
    study = StudyConfig(**args)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    _init_single_process()
    result = run_study(study, balancers, log=lambda line: print(line, flush=True))
    os.makedirs(os.path.join(out_dir, "bench"), exist_ok=True)
    with open(os.path.join(out_dir, "bench", "balance.json"), "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(result, os.path.join(out_dir, "bench", "balance.md"))
    write_svg(result, os.path.join(out_dir, "balance_study.svg"))
    print(f"> wrote {out_dir}/bench/balance.json, {out_dir}/bench/balance.md, {out_dir}/balance_study.svg")
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
