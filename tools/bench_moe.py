"""MoE layer forward+backward timing: our ``MoELayer`` (plain top-k, qb_capacity, qb_bias) against
stock Megatron-Core's ``MoELayer`` (``TopKRouter`` + ``MoEAlltoAllTokenDispatcher`` + experts).

Shapes (default, GPU): E in {64, 256}, top-8, 16384 tokens per rank (``[16384, 1, 2048]``),
hidden 2048, expert FFN 1024 (SwiGLU, so fc1 is 2048 x 2048 and fc2 1024 x 2048 per expert: a
fine-grained expert about half the hidden size, as in recent fine-grained MoEs), bf16 params,
sigmoid router, no shared expert. qb_capacity uses capacity factor 1.25. Router weights are
Megatron's default init (std 0.02), so routing is close to uniform: this times the machinery,
not a skewed load. Megatron's experts are ``TEGroupedMLP`` when Transformer Engine is
importable, else ``SequentialMLP`` (a loop over experts; 0.19 has no other non-TE path);
the JSON records which.

Timing: one shared function; CUDA events around ``forward + backward`` (input grad too) of
one layer, median over ``--iters`` (>= 10) after ``--warmup``, ranks aligned by a barrier
before each iteration; under EP the reported time is the max over ranks of their medians.
The qb_bias update (once per optimizer step) is outside the timed region; its histogram is
inside (it is built in the forward).

    python tools/bench_moe.py [--out docs/bench/moe-h200.json]           # one GPU
    torchrun --nproc-per-node 2 tools/bench_moe.py --out docs/bench/moe-h200-ep2.json   # EP2
    python tools/bench_moe.py --smoke --out /tmp/moe.json                 # CPU, tiny, gloo

``--scores FILE`` (``tools/router_scores.py --scores-out``): every variant routes a trained checkpoint's
recorded scores instead of its own router's (the most skewed MoE layer, or ``--scores-layer``; rows tiled to
the token count; E and top-k from the file), straight-through: the values are the recorded ones, the gradient
flows through the router's own scores as in training. qb_bias takes the recorded selection bias (what its
training state would hold); topk and qb_capacity have none. This times the layer under the skew training
meets.

With torchrun each rank routes its own 16k tokens and EP = world size (TP = PP = 1). Rows with
``gpus`` = world size; run both and merge if one file is wanted. A variant that raises is
reported as ``null`` with ``<variant>_error`` and the others still run (e.g. ``--smoke`` under
torchrun: Megatron's all-to-all dispatcher turns its split sizes into lists only for CUDA
tensors, so its EP > 1 path fails on the CPU; on GPUs it is the normal path).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.bench_common import init_expert_parallel, init_process_group, median_ms  # noqa: E402

VARIANTS = ("topk", "qb_capacity", "qb_bias", "megatron")
OUR_BALANCER = {"topk": "none", "qb_capacity": "qb_capacity", "qb_bias": "qb_bias"}
CAPACITY_FACTOR = 1.25


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", default=None, help="comma-separated E values (default 64,256; smoke 8)")
    p.add_argument("--topk", type=int, default=None, help="default 8; smoke 2")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 16384; smoke 64)")
    p.add_argument("--hidden", type=int, default=None, help="default 2048; smoke 32")
    p.add_argument("--ffn", type=int, default=None, help="expert FFN size (default 1024; smoke 16)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 20; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="default 5; smoke 1")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--scores", default=None, help="recorded scores (tools/router_scores.py --scores-out)")
    p.add_argument("--scores-layer", type=int, default=None, help="its layer (default: the most skewed)")
    p.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny sizes, gloo: checks the code path")
    p.add_argument("--out", default=None, help="JSON path (default docs/bench/moe-h200.json; none for --smoke)")
    args = p.parse_args(argv)
    small = dict(experts="8", topk=2, tokens=64, hidden=32, ffn=16, iters=2, warmup=1)
    full = dict(experts="64,256", topk=8, tokens=16384, hidden=2048, ffn=1024, iters=20, warmup=5)
    for key, value in (small if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None and not args.smoke:
        args.out = "docs/bench/moe-h200.json"
    if not args.smoke and args.iters < 10:
        p.error("--iters must be >= 10 for GPU timings")
    args.experts = [int(e) for e in args.experts.split(",")]
    args.recorded = None
    if args.scores:
        from tools.router_scores import load_scores

        scores, bias, source = load_scores(args.scores, args.scores_layer)
        args.recorded = dict(scores=scores, bias=bias, source=source)
        args.experts, args.topk = [scores.shape[1]], source["topk"]
    args.variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(args.variants) - set(VARIANTS))
    if bad:
        p.error(f"unknown variants {bad}; known: {', '.join(VARIANTS)}")
    return args


def init_distributed(smoke: bool):
    """One process (world 1) or torchrun's world; Megatron's groups with EP = world size."""
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench_moe.py needs a CUDA GPU (use --smoke on the CPU)")
    rank, world = init_process_group(cuda=not smoke)
    init_expert_parallel(seed=1234)
    return rank, world


def layer_config(args, num_experts: int, variant: str):
    """One config for both implementations; our knobs are set as attributes (MoELayer reads them)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.float32 if args.smoke else torch.bfloat16
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=max(1, args.hidden // 128),
        num_moe_experts=num_experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        moe_router_score_function="sigmoid", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=variant == "megatron" and _have_te(),
        expert_model_parallel_size=dist.get_world_size(), expert_tensor_parallel_size=1,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=args.smoke,
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        moe_expert_capacity_factor=CAPACITY_FACTOR if variant == "qb_capacity" else None)
    config.moe_balancer = OUR_BALANCER.get(variant, "none")
    config.moe_qb_num_bins = 1000
    return config


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def build_layer(args, num_experts: int, variant: str):
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = layer_config(args, num_experts, variant)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    if variant == "megatron":
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

        builder = get_moe_module_spec(use_te=_have_te(), num_experts=num_experts, moe_grouped_gemm=_have_te())
        layer = builder(config=config, pg_collection=pgs)
    else:
        from megatron_ext.moe.layer import MoELayer

        layer = MoELayer(config, pgs)
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    layer = layer.to(device).train()
    if args.recorded is not None:
        route_recorded_scores(layer, variant, args.recorded, args.tokens, device)
    return layer, config.params_dtype, device


def route_recorded_scores(layer, variant: str, recorded: dict, num_tokens: int, device) -> None:
    """Make ``layer``'s router see ``recorded["scores"]`` (tiled to ``num_tokens`` rows) in place of its own, keeping
    the gradient path of its own (straight-through); qb_bias also takes the recorded bias."""
    from tools.router_scores import tile_rows

    scores = tile_rows(recorded["scores"], num_tokens, seed=dist.get_rank()).to(device)
    router = layer.router
    if variant == "megatron":  # Megatron's router takes logits from gating() and applies the sigmoid itself
        own_gating, logits = router.gating, torch.logit(scores.double().clamp(1e-6, 1 - 1e-6)).float()

        def gating(hidden):
            own = own_gating(hidden)
            return own + (logits.view_as(own).to(own.dtype) - own).detach()

        router.gating = gating
        return
    own_scores = router.scores

    def recorded_scores(hidden):
        own = own_scores(hidden)
        return own + (scores - own).detach()

    router.scores = recorded_scores
    if variant == "qb_bias" and recorded["bias"] is not None:
        with torch.no_grad():
            router.expert_bias.copy_(recorded["bias"].to(device))


def time_variant(args, num_experts: int, variant: str) -> float:
    layer, dtype, device = build_layer(args, num_experts, variant)
    g = torch.Generator(device="cpu").manual_seed(100 + dist.get_rank())  # each rank its own tokens
    x = torch.randn(args.tokens, 1, args.hidden, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(args.tokens, 1, args.hidden, generator=g).to(device, dtype)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)[0]
        out.backward(dy)

    ms = median_ms(step, args.warmup, args.iters, device)
    del layer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ms


def run(args, log=print) -> dict:
    rank, world = init_distributed(args.smoke)
    device_name = "cpu" if args.smoke else torch.cuda.get_device_name()
    rows = []
    for num_experts in args.experts:
        row = {"E": num_experts, "gpus": world, "tokens_per_rank": args.tokens, "topk": args.topk,
               "hidden": args.hidden, "ffn": args.ffn}
        for variant in VARIANTS:
            key = f"{variant}_ms"
            row[key] = None
            if variant not in args.variants:
                continue
            try:
                row[key] = time_variant(args, num_experts, variant)
            except Exception as exc:  # keep the other variants' numbers; say why this one is missing
                if rank == 0:
                    traceback.print_exc()
                row[f"{variant}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if rank == 0:
                shown = "failed" if row[key] is None else f"{row[key]:.2f} ms"
                log(f"> E={num_experts:4d} gpus={world} tokens/rank={args.tokens} {variant:>11}: {shown}")
        rows.append(row)
    scores = "Megatron's router init (near uniform)" if args.recorded is None else args.recorded["source"]
    result = {"rows": rows, "scores": scores, "device": device_name, "date": datetime.date.today().isoformat(),
              "dtype": "fp32" if args.smoke else "bf16", "capacity_factor": CAPACITY_FACTOR,
              "megatron_experts": "TEGroupedMLP" if _have_te() else "SequentialMLP",
              "torch": torch.__version__, "smoke": args.smoke}
    if rank == 0:
        log(format_table(rows))
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            log(f"> wrote {args.out}")
    return result


def format_table(rows) -> str:
    header = ["E", "gpus", "tokens/rank"] + [f"{v} ms" for v in VARIANTS]
    lines = [" | ".join(f"{h:>12}" for h in header)]
    for r in rows:
        cells = [r["E"], r["gpus"], r["tokens_per_rank"]] + [
            "-" if r[f"{v}_ms"] is None else f"{r[f'{v}_ms']:.2f}" for v in VARIANTS]
        lines.append(" | ".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        return run(args, log=lambda line: print(line, flush=True))
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
