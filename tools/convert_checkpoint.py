"""Convert checkpoints between our Megatron dist checkpoints and Hugging Face's Kimi Linear format.

    python tools/convert_checkpoint.py export CKPT_DIR HF_DIR [--max-shard-size 5GB]
    python tools/convert_checkpoint.py import HF_DIR CKPT_DIR [--tensor-model-parallel-size 2
        --expert-model-parallel-size 2 --sequence-parallel ...] [--moe-balancer qb_bias] [--bf16]

``export`` takes a dist checkpoint of any layout (a save directory: its newest checkpoint; or one
``iter_XXXXXXX``) and writes ``config.json`` + ``model-0000x-of-0000y.safetensors`` + the index, in the
released Kimi-Linear-48B-A3B names, one layer at a time. ``import`` writes a dist checkpoint and
``CKPT_DIR/train.yaml`` (model keys, the layout, ``load``), for ``launch/train.py --config``.
See docs/convert.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.errors import ConfigError  # noqa: E402

_UNITS = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", text.upper())
    if not match:
        raise ConfigError(f"--max-shard-size={text!r}: expected e.g. 5GB, 500MB or a byte count")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="dist checkpoint -> Hugging Face Kimi Linear directory")
    export.add_argument("ckpt_dir")
    export.add_argument("hf_dir")
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    imp = sub.add_parser("import", help="Hugging Face Kimi Linear directory -> dist checkpoint + YAML")
    imp.add_argument("hf_dir")
    imp.add_argument("ckpt_dir")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1)
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    imp.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    imp.add_argument("--expert-model-parallel-size", type=int, default=1)
    imp.add_argument("--sequence-parallel", action="store_true")
    imp.add_argument("--moe-balancer", default="qb_bias",
                     help="router balancer to train on with (default qb_bias, which keeps the correction bias)")
    imp.add_argument("--bf16", action="store_true", help="store bf16 weights (decay params and bias stay fp32)")
    imp.add_argument("--yaml", default=None, help="where to write the training YAML (default CKPT_DIR/train.yaml)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "export":
            from megatron_ext.convert.export import export_checkpoint

            out = export_checkpoint(args.ckpt_dir, args.hf_dir, parse_size(args.max_shard_size))
            print(f"exported {out['checkpoint']} -> {args.hf_dir}: {out['tensors']} tensors, "
                  f"{out['bytes'] / 2**20:.1f} MiB in {len(out['shards'])} shard(s)")
        else:
            from megatron_ext.convert.hf_import import LAYOUT_FLAGS, import_checkpoint

            layout = {k: getattr(args, k) for k in LAYOUT_FLAGS}
            import_checkpoint(args.hf_dir, args.ckpt_dir, layout, args.moe_balancer, args.bf16, args.yaml)
            print(f"imported {args.hf_dir} -> {args.ckpt_dir} (config: {args.yaml or os.path.join(args.ckpt_dir, 'train.yaml')})")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
