"""Peak host memory of ``tools/convert_checkpoint.py export`` for a model larger than one shard.

    python tools/dev/bench_export_memory.py --hidden 1024 --experts 16 --shard 256MB [--json out.json]

Builds a Kimi-Linear-compatible model (random weights, one rank, fp32), saves it as a dist checkpoint,
then exports it in a fresh process and reports that process's peak RSS, its RSS once everything is
imported (the floor), the checkpoint's tensor bytes and the largest layer group. Streaming holds about
one layer group plus one shard above the floor, never the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_CHILD = """
import json, sys, psutil
sys.path.insert(0, {root!r})
import torch, megatron.core.dist_checkpointing, safetensors.torch
from megatron_ext.convert.export import export_checkpoint
floor = psutil.Process().memory_info().rss
out = export_checkpoint({ckpt!r}, {hf!r}, {shard})
# VmHWM, not getrusage's ru_maxrss: Linux carries the forking parent's high-water mark into ru_maxrss
# across exec (the parent here built the whole model).
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps(dict(floor_bytes=floor, peak_bytes=peak, tensor_bytes=out["bytes"], shards=len(out["shards"]))))
"""


def model_fields(hidden: int, experts: int, layers: int) -> dict:
    return dict(num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=8,
                vocab_size=32768, attention_pattern="KKKM", kda_num_heads=8, kda_head_dim=hidden // 8,
                kda_gate_rank=hidden // 8, kda_gate="softplus", kda_output_gate_bias=False, kv_lora_rank=hidden // 4,
                qk_head_dim=hidden // 8, qk_pos_emb_head_dim=hidden // 16, v_head_dim=hidden // 8,
                num_moe_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=hidden,
                moe_shared_expert_intermediate_size=hidden, moe_layer_freq=[0] + [1] * (layers - 1),
                moe_router_score_function="sigmoid", moe_balancer="qb_bias", max_sequence_length=128)


def save_model(ckpt: str, fields: dict) -> int:
    import torch

    from megatron_ext.config import HybridConfig
    from megatron_ext.convert.dist_reader import one_rank_group
    from megatron_ext.parallel import build_model_chunks, initialize_parallel
    from megatron_ext.training.checkpointing import save_checkpoint
    from megatron.core import parallel_state as ps

    config = HybridConfig(params_dtype=torch.float32, use_cpu_initialization=True, **fields)
    with one_rank_group():
        initialize_parallel(config, seed=0)
        (model,) = build_model_chunks(config)
        layer_bytes = max(sum(p.numel() * p.element_size() for p in layer.parameters())
                          for layer in model.decoder.layers)
        save_checkpoint(ckpt, 1, {"model0": model.sharded_state_dict()}, {"consumed_samples": 0},
                        config={**fields, "bf16": False}, save_rng=False)
        ps.destroy_model_parallel()
    return layer_bytes


def measure(hidden: int, experts: int, layers: int, shard_bytes: int, workdir: str) -> dict:
    ckpt, hf = os.path.join(workdir, "ckpt"), os.path.join(workdir, "hf")
    layer_bytes = save_model(ckpt, model_fields(hidden, experts, layers))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = _CHILD.format(root=root, ckpt=ckpt, hf=hf, shard=shard_bytes)
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = json.loads(result.stdout.strip().splitlines()[-1])
    out.update(largest_layer_bytes=layer_bytes, max_shard_bytes=shard_bytes,
               above_floor_bytes=out["peak_bytes"] - out["floor_bytes"])
    return out


def main(argv=None) -> None:
    from tools.convert_checkpoint import parse_size

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shard", default="256MB")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        out = measure(args.hidden, args.experts, args.layers, parse_size(args.shard), workdir)
    mib = {k: round(v / 2**20, 1) for k, v in out.items() if k.endswith("_bytes")}
    print(json.dumps({"shards": out["shards"], **{k.replace("_bytes", "_mib"): v for k, v in mib.items()}}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
