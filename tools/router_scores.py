"""Router scores of a trained checkpoint: how skewed the routing that training meets is.

    python tools/router_scores.py CKPT --tokens 16384 --out router-scores.json --scores-out scores.pt
    python tools/dev/bench_routing.py --scores scores.pt     # the routing timed on those scores
    python tools/bench_moe.py --scores scores.pt             # the MoE layer timed on them

The benchmarks' own scores are synthetic (``bench_moe``: Megatron's router init, near uniform;
``bench_routing``: per-expert logit offsets of ``--skew``). This measures the real thing: the checkpoint's
routers on its own held-out data (``eval_lengths``' loading and data), ``--tokens`` tokens in windows of the
training length, each MoE layer's fp32 scores taken at its router (a forward pre-hook calls
``router.scores`` on the router's input) together with its selection bias. Evaluation routes by plain top-k,
so capturing changes nothing in the forward.

Per MoE layer (``layers`` in the JSON, ``LAYER_KEYS``):

* ``topk_max_vio``: MaxVio of plain top-k on the biased scores, max expert load / mean - 1 (what the layer
  would dispatch without capacity); ``unbiased_topk_max_vio`` the same without the bias;
* ``expert_logit_spread``: std over experts of each expert's mean logit (``bench_routing --skew s`` draws
  offsets with spread s / sqrt(3)); ``token_logit_std``: mean over experts of the std over tokens;
* ``capacity``: per ``--capacity-factors`` value, the capacity routing with host reads on all tokens at once:
  ``rounds`` it needed, ``rerouted`` and ``dropped`` as fractions of the N k pairs.

``--scores-out``: a torch file ``{"scores": {layer: fp16 [N, E]}, "bias": {layer: fp32 [E] or None},
"meta": {...}}`` that the benchmarks take with ``--scores`` (:func:`load_scores`; the most skewed layer unless
they name one), tiled to their token count (:func:`tile_rows`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.eval_lengths import (  # noqa: E402
    UsageError, held_out_tokens, load_model, resolve_checkpoint, resolve_device, run_checkpoint_tool, write_json,
)

LAYER_KEYS = ("layer", "experts", "topk", "tokens", "topk_max_vio", "unbiased_topk_max_vio", "expert_logit_spread",
              "token_logit_std", "capacity")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a save directory (its newest complete checkpoint) or one iter_XXXXXXX")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens to route (default 16384)")
    p.add_argument("--capacity-factors", default="1.0,1.25", help="capacity routing rows (default 1.0,1.25)")
    p.add_argument("--data-path", nargs="+", default=None, help="other indexed data (default: the checkpoint's)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--out", default=None, help="JSON path")
    p.add_argument("--scores-out", default=None, help="torch file of the scores, for the benchmarks' --scores")
    return p


def max_vio(experts, num_experts: int) -> float:
    """MaxVio of a routing's ``[N, k]`` experts (dropped pairs, -1, left out), as training's metrics compute it."""
    from megatron_ext.moe.metrics import max_violation
    from megatron_ext.moe.router import expert_counts

    return max_violation(expert_counts(experts, num_experts))


def layer_summary(layer: int, scores, bias, k: int, capacity_factors: list[float]) -> dict:
    """One ``layers`` entry (``LAYER_KEYS``) for fp32 ``scores [N, E]`` (sigmoid) and the selection ``bias``."""
    import torch

    from megatron_ext.moe.quantile import capacity_routing

    num_tokens, num_experts = scores.shape
    biased = scores if bias is None else scores + bias
    logits = torch.logit(scores.double().clamp(1e-12, 1 - 1e-12))
    capacity = {}
    for factor in capacity_factors:
        routing = capacity_routing(scores, k, factor, bias=bias, host_reads=True)
        capacity[f"{factor:g}"] = dict(rounds=routing.rounds, max_vio=max_vio(routing.experts, num_experts),
                                       rerouted=int(routing.rerouted) / (num_tokens * k),
                                       dropped=int(routing.dropped) / (num_tokens * k))
    return dict(layer=layer, experts=num_experts, topk=k, tokens=num_tokens,
                topk_max_vio=max_vio(biased.topk(k, dim=1).indices, num_experts),
                unbiased_topk_max_vio=max_vio(scores.topk(k, dim=1).indices, num_experts),
                expert_logit_spread=float(logits.mean(0).std()), token_logit_std=float(logits.std(0).mean()),
                capacity=capacity)


def capture_scores(model, stream, length: int, tokens: int, device: str) -> dict:
    """{layer number: (fp32 scores [windows * length, E] on the CPU, bias or None)} of every MoE router over
    ``tokens`` held-out tokens (whole windows of ``length``, at least one)."""
    import numpy as np
    import torch

    from megatron_ext.moe.router import TopKRouter

    routers = {}
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter):
            routers[name] = module
    if not routers:
        raise UsageError("the checkpoint's model has no MoE layer (num_moe_experts / moe_layer_freq)")
    captured = {name: [] for name in routers}
    hooks = [router.register_forward_pre_hook(
        lambda module, args, name=name: captured[name].append(module.scores(args[0]).float().cpu()))
        for name, router in routers.items()]
    windows = min(max(1, tokens // length), (len(stream) - 1) // length)
    if windows < 1:
        raise UsageError(f"held-out split has {len(stream)} tokens, fewer than one window of {length} + 1")
    try:
        with torch.no_grad():
            for w in range(windows):
                t = torch.from_numpy(np.asarray(stream[w * length:(w + 1) * length], dtype=np.int64))
                tok = t.to(device).unsqueeze(0)
                pos = torch.arange(length, device=device).unsqueeze(0)
                model(tok, pos, None)
    finally:
        for hook in hooks:
            hook.remove()
    result = {}
    for name, router in routers.items():
        layer = _layer_of(name)
        bias = None if router.expert_bias is None else router.expert_bias.detach().float().cpu()
        result[layer] = (torch.cat(captured[name]), bias)
    return dict(sorted(result.items()))


def _layer_of(module_name: str) -> int:
    """1-based layer number from a module path like ``decoder.layers.3.mlp.router``."""
    parts = module_name.split(".")
    return int(parts[parts.index("layers") + 1]) + 1


def load_scores(path: str, layer: int | None = None):
    """(fp32 scores [N, E], bias [E] or None, what they are) from a ``--scores-out`` file: ``layer``, or the layer
    whose plain top-k is most skewed (largest ``topk_max_vio``). What they are, for a benchmark's JSON: ``file``,
    ``layer``, ``topk`` (the router's k), ``recorded_tokens``, ``how`` and the layer's ``topk_max_vio``."""
    import torch

    data = torch.load(path, map_location="cpu")
    layers, meta = data["scores"], data["meta"]
    if layer is None:
        layer = max(meta["topk_max_vio"].items(), key=lambda item: item[1])[0]
    if layer not in layers:
        raise UsageError(f"{path}: no layer {layer}; it holds layers {sorted(layers)}")
    scores = layers[layer].float()
    info = dict(file=path, layer=layer, topk=meta["topk"], recorded_tokens=scores.shape[0], how=meta["how"],
                topk_max_vio=meta["topk_max_vio"][layer])
    return scores, data["bias"][layer], info


def tile_rows(scores, num_tokens: int, seed: int = 0):
    """``num_tokens`` rows of ``scores``: the rows in a seeded random order, repeated as often as needed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    reps = math.ceil(num_tokens / scores.shape[0])
    order = torch.cat([torch.randperm(scores.shape[0], generator=g) for _ in range(reps)])[:num_tokens]
    return scores[order]


def run(args, log=print) -> dict:
    import torch

    device = resolve_device(args.device)
    if args.tokens < 1:
        raise UsageError(f"--tokens={args.tokens}: must be >= 1")
    try:
        factors = [float(v) for v in args.capacity_factors.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--capacity-factors={args.capacity_factors!r}: expected numbers, e.g. 1.0,1.25") from None
    if not factors or any(f <= 0 for f in factors):
        raise UsageError(f"--capacity-factors={args.capacity_factors!r}: expected positive numbers")
    _, _, ckpt = resolve_checkpoint(args.checkpoint)  # fail on a bad path before any process group
    from megatron_ext.training.checkpointing import common_state_of

    saved0 = common_state_of(ckpt).get("config") or {}
    length = int(saved0.get("seq_length") or 0)
    if not length:
        raise UsageError("the checkpoint's config has no seq_length")
    log(f"> router_scores: {args.checkpoint} on {device}, {args.tokens} tokens in windows of {length}")
    model, saved, iteration, dtype = load_model(args.checkpoint, device, length, log=log)
    data = {k: saved.get(k) for k in ("data_path", "split", "tokenizer_json", "stdlib_max_mb")}
    if args.data_path:
        data["data_path"] = args.data_path
    stream, described = held_out_tokens(data, max(args.tokens, length), log=log)
    captured = capture_scores(model, stream, length, args.tokens, device)
    k = int(saved.get("moe_router_topk") or 2)
    layers = []
    for layer, (scores, bias) in captured.items():
        summary = layer_summary(layer, scores, bias, k, factors)
        layers.append(summary)
        caps = ", ".join(f"cf {f}: {c['rounds']} rounds, {c['rerouted']:.1%} rerouted, {c['dropped']:.2%} dropped"
                         for f, c in summary["capacity"].items())
        log(f"  layer {layer:>3}: top-k MaxVio {summary['topk_max_vio']:.3f} (unbiased "
            f"{summary['unbiased_topk_max_vio']:.3f}), expert logit spread {summary['expert_logit_spread']:.3f}, "
            f"token logit std {summary['token_logit_std']:.3f} | {caps}")
    how = (f"{len(next(iter(captured.values()))[0])} held-out tokens ({described}) through the checkpoint's model "
           f"in windows of {length} on {device} in {dtype}; scores taken at each router's input")
    result = dict(tool="router_scores", checkpoint=os.path.abspath(args.checkpoint), iteration=iteration,
                  balancer=saved.get("moe_balancer"), device=device, dtype=dtype, data=described, how=how,
                  layers=layers)
    if args.out:
        write_json(args.out, result, log)
    if args.scores_out:
        meta = dict(checkpoint=result["checkpoint"], iteration=iteration, how=how, topk=k,
                    topk_max_vio={s["layer"]: s["topk_max_vio"] for s in layers})
        torch.save({"scores": {layer: s.half() for layer, (s, _) in captured.items()},
                    "bias": {layer: b for layer, (_, b) in captured.items()}, "meta": meta}, args.scores_out)
        log(f"> wrote {args.scores_out}")
    return result


def main(argv=None) -> int:
    return run_checkpoint_tool(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
