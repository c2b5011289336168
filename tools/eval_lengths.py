"""Held-out loss and perplexity of a checkpoint at several context lengths (length extrapolation).

    python tools/eval_lengths.py runs/tiny/checkpoints --multiples 1,2,4,8,16 --out lengths.json --plot lengths.png
    python tools/eval_lengths.py CKPT/iter_0000300 --lengths 2048,8192,32768 --tokens 262144

One process, one device: bf16 on a GPU (the checkpoint's own dtype when it trained in bf16), fp32 on the CPU.
The model, its tokenizer and its data come from the checkpoint's saved config (``--data-path`` points at other
indexed data). Held-out text is the validation split of that data: for the stdlib corpus its validation files,
for indexed data (``PREFIX.bin/.idx``) the validation documents by Megatron's document split of ``split``.

For every length L one row: the same first ``--tokens`` held-out tokens (rounded down to whole windows; at
least one window) cut into windows of L tokens, each predicting its next tokens from position 0 (no state
carried between windows), the mean token loss, its perplexity, and the mean loss over the positions at or past
the training length (what the model never saw in training: the extrapolation signal). Windows go through the
model in batches of about ``--batch-tokens`` tokens (at least one window), so memory grows with L only through
one window: the KDA layers walk their chunked state (kernel on the GPU), the attention layers run SDPA (flash on
the GPU). Writes a JSON (``--out``; schema: ``ROW_KEYS`` per row) and, with ``--plot``, loss against length.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROW_KEYS = ("length", "multiple", "windows", "tokens", "loss", "ppl", "loss_beyond_train", "nonfinite",
            "seconds", "tokens_per_s")


class UsageError(ValueError):
    """A bad argument or file, named in the message."""


def _int_list(text: str, flag: str, kind=int) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag}={text!r}: expected comma-separated numbers, e.g. 1,2,4") from None
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"{flag}={text!r}: expected positive numbers, e.g. 1,2,4")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a save directory (its newest complete checkpoint) or one iter_XXXXXXX")
    p.add_argument("--lengths", default=None, help="context lengths in tokens, e.g. 2048,4096 (wins over --multiples)")
    p.add_argument("--multiples", default="1,2,4,8,16",
                   help="lengths as multiples of the training length (default 1,2,4,8,16)")
    p.add_argument("--train-length", type=int, default=None, help="default: the checkpoint's seq_length")
    p.add_argument("--tokens", type=int, default=65536, help="held-out tokens per length (default 65536)")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="tokens per forward (default: the longest length), at least one window")
    p.add_argument("--data-path", nargs="+", default=None, help="indexed data prefixes instead of the checkpoint's")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--label", default=None, help="name of this model in the JSON and plot")
    p.add_argument("--out", default=None, help="JSON output path (default: print only)")
    p.add_argument("--plot", default=None, help="PNG of loss against length")
    return p


# --------------------------------------------------------------------------- held-out data


def split_document_range(num_docs: int, split: str) -> tuple[int, int]:
    """[begin, end) of the validation documents: Megatron's rule (normalised weights, cumulative rounded
    counts, the last bound pinned to num_docs)."""
    weights = [float(w) for w in split.split(",")] + [0.0, 0.0]
    weights = weights[:3]
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * num_docs)))
    shift = bounds[-1] - num_docs
    bounds = [bounds[0]] + [b - shift for b in bounds[1:]]
    return max(0, bounds[1]), max(0, bounds[2])


def held_out_tokens(data: dict, needed: int, log=print):
    """(1-D int64 array of at least ``needed`` + 1 tokens when the split has them, description)."""
    import numpy as np

    from megatron_ext.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(data.get("tokenizer_json"))
    split = data.get("split") or "969,30,1"
    if not data.get("data_path"):
        from megatron_ext.data.stdlib_corpus import load_stdlib_tokens
        from megatron_ext.training.sections import DataConfig

        weights = DataConfig(split=split).split_weights()
        stream = load_stdlib_tokens(tokenizer, weights, data.get("stdlib_max_mb"))["valid"]
        return np.asarray(stream, dtype=np.int64), f"stdlib corpus, validation files (split {split})"
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import get_blend_from_list

    prefixes = get_blend_from_list(list(data["data_path"]))[0]
    parts, count = [], 0
    for prefix in prefixes:
        if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
            raise UsageError(f"--data-path: {prefix}.bin / {prefix}.idx not found")
        ds = IndexedDataset(prefix)
        begin, end = split_document_range(len(ds), split)
        for i in range(begin, end):
            doc = np.asarray(ds[i], dtype=np.int64)
            parts.append(doc)
            count += len(doc)
            if count > needed:
                break
        if count > needed:
            break
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return stream, f"indexed {', '.join(prefixes)}: validation documents (split {split})"


# --------------------------------------------------------------------------- model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_checkpoint(path: str) -> tuple[str, int | None, str]:
    """(load_dir, iteration or None for the newest, the checkpoint directory) of a save directory or an
    iter_XXXXXXX directory."""
    from megatron_ext.training.checkpointing import complete_checkpoints, is_complete_checkpoint

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise UsageError(f"checkpoint {path} is not a directory")
    match = re.fullmatch(r"iter_(\d+)", os.path.basename(path))
    if match and is_complete_checkpoint(path):
        return os.path.dirname(path), int(match.group(1)), path
    found = complete_checkpoints(path)
    if not found:
        raise UsageError(f"checkpoint {path} holds no complete checkpoint (iter_XXXXXXX with metadata.json)")
    return path, None, found[0][1]


def load_model(path: str, device: str, max_length: int, log=print):
    """(model in eval mode, saved flat config, iteration, dtype name) for a one-process job on ``device``."""
    import torch
    import torch.distributed as dist

    from megatron_ext import cpu_compat
    from megatron_ext.config import USER_FIELDS, HybridConfig
    from megatron_ext.parallel import build_model_chunks, initialize_parallel
    from megatron_ext.training.checkpointing import common_state_of, load_checkpoint

    load_dir, iteration, ckpt = resolve_checkpoint(path)
    saved = common_state_of(ckpt).get("config") or {}
    if not saved:
        raise UsageError(f"checkpoint {ckpt} has no saved config (not written by launch/train.py?)")
    on_gpu = device == "cuda"
    bf16 = bool(saved.get("bf16")) and on_gpu  # the GPU evaluates as trained; the CPU in fp32
    dtype = torch.bfloat16 if bf16 else torch.float32
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    if on_gpu:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    else:
        cpu_compat.install()
        dist.init_process_group("gloo", rank=0, world_size=1)
    values = {k: saved[k] for k in USER_FIELDS if k in saved}
    values["max_sequence_length"] = max(int(values.get("max_sequence_length") or 0), max_length)
    config = HybridConfig(bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=not on_gpu,
                          **values)
    initialize_parallel(config, int(saved.get("seed", 1234)))
    model = build_model_chunks(config)[0]
    if not on_gpu:
        model = model.float()
    loaded = load_checkpoint(load_dir, lambda: {"model0": model.sharded_state_dict()}, iteration=iteration,
                             load_rng=False, log=log)
    if loaded is None:
        raise UsageError(f"checkpoint {path}: nothing to load")
    state, common = loaded
    model.load_state_dict(state["model0"])
    model.eval()
    return model, saved, int(common["iteration"]), "bf16" if bf16 else "fp32"


# --------------------------------------------------------------------------- evaluation


def evaluate_length(model, stream, length: int, train_length: int, tokens: int, batch_tokens: int, device: str):
    """One row (see ``ROW_KEYS``) for windows of ``length`` tokens, or None when the split is too short."""
    import numpy as np
    import torch

    windows = min(max(1, tokens // length), (len(stream) - 1) // length)
    if windows < 1:
        return None
    per_batch = max(1, batch_tokens // length)
    total = beyond = 0.0
    n_beyond = nonfinite = 0
    start = time.perf_counter()
    with torch.no_grad():
        for w0 in range(0, windows, per_batch):
            rows = range(w0, min(windows, w0 + per_batch))
            x = np.stack([stream[i * length:(i + 1) * length + 1] for i in rows])
            t = torch.from_numpy(x).to(device)
            tok, lab = t[:, :-1].contiguous(), t[:, 1:].contiguous()
            pos = torch.arange(length, device=device).expand_as(tok)
            loss = model(tok, pos, None, labels=lab).float()  # [b, s] per-token losses
            nonfinite += int((~torch.isfinite(loss)).sum())
            total += float(loss.sum())
            if length > train_length:
                beyond += float(loss[:, train_length:].sum())
                n_beyond += loss[:, train_length:].numel()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    count = windows * length
    mean = total / count
    return dict(length=length, multiple=round(length / train_length, 4), windows=windows, tokens=count, loss=mean,
                ppl=math.exp(mean) if mean < 700 else float("inf"),
                loss_beyond_train=beyond / n_beyond if n_beyond else None, nonfinite=nonfinite,
                seconds=round(seconds, 3), tokens_per_s=round(count / max(seconds, 1e-9), 1))


def plot_series(series: dict, path: str, train_length: int | None = None, title: str = "held-out loss vs context"):
    """Loss against length, one line per label: ``series`` maps label -> rows (``ROW_KEYS``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in series.items():
        rows = [r for r in rows if r and r.get("loss") is not None and math.isfinite(r["loss"])]
        if rows:
            ax.plot([r["length"] for r in rows], [r["loss"] for r in rows], marker="o", label=label)
    if train_length:
        ax.axvline(train_length, color="grey", linestyle=":", label=f"training length {train_length}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def resolve_device(choice: str) -> str:
    """``--device`` (auto / cuda / cpu) -> the device a checkpoint tool runs on."""
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here")
    return choice


def run(args, log=print) -> dict:
    device = resolve_device(args.device)
    for flag in ("tokens", "batch_tokens", "train_length"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')}={value}: must be >= 1")
    lengths = _int_list(args.lengths, "--lengths") if args.lengths else None
    multiples = None if lengths else _int_list(args.multiples, "--multiples", float)
    _, _, ckpt = resolve_checkpoint(args.checkpoint)  # fail on a bad path before any process group
    from megatron_ext.training.checkpointing import common_state_of

    saved0 = common_state_of(ckpt).get("config") or {}
    train_length = args.train_length or int(saved0.get("seq_length") or 0)
    if not train_length:
        raise UsageError("--train-length: the checkpoint's config has no seq_length; give it")
    if lengths is None:
        lengths = [int(round(m * train_length)) for m in multiples]
    longest = max(lengths)
    log(f"> eval_lengths: {args.checkpoint} on {device}, lengths {lengths} (training length {train_length})")
    model, saved, iteration, dtype = load_model(args.checkpoint, device, longest, log=log)
    data = {k: saved.get(k) for k in ("data_path", "split", "tokenizer_json", "stdlib_max_mb")}
    if args.data_path:
        data["data_path"] = args.data_path
    needed = max(args.tokens, longest)
    stream, described = held_out_tokens(data, needed, log=log)
    log(f"> held-out data: {described}, {len(stream)} tokens read")
    if len(stream) < min(lengths) + 1:
        raise UsageError(f"held-out split has {len(stream)} tokens, fewer than the shortest length {min(lengths)} "
                         "+ 1 (more data, another --data-path or shorter --lengths)")
    batch_tokens = args.batch_tokens or longest
    rows = []
    for length in lengths:
        row = evaluate_length(model, stream, length, train_length, args.tokens, batch_tokens, device)
        if row is None:
            log(f"  length {length}: skipped, the held-out split has only {len(stream)} tokens")
            row = dict(length=length, multiple=round(length / train_length, 4), windows=0, tokens=0, loss=None,
                       ppl=None, loss_beyond_train=None, nonfinite=0, seconds=0.0, tokens_per_s=None,
                       skipped="held-out split too short")
        else:
            beyond = row["loss_beyond_train"]
            log(f"  length {length:>7} ({row['multiple']:g}x): loss {row['loss']:.4f} ppl {row['ppl']:.3f}"
                + (f" | past training length {beyond:.4f}" if beyond is not None else "")
                + f" | {row['windows']} windows, {row['tokens_per_s']:.0f} tokens/s"
                + (f" | {row['nonfinite']} NON-FINITE" if row["nonfinite"] else ""))
        rows.append(row)
    result = dict(tool="eval_lengths", label=args.label or os.path.basename(os.path.abspath(args.checkpoint)),
                  checkpoint=os.path.abspath(args.checkpoint), iteration=iteration, train_length=train_length,
                  device=device, dtype=dtype, data=described, tokens_per_length=args.tokens,
                  batch_tokens=batch_tokens, rows=rows)
    if args.out:
        write_json(args.out, result, log)
    if args.plot:
        plot_series({result["label"]: rows}, args.plot, train_length)
        log(f"> wrote {args.plot}")
    return result


def write_json(path: str, result: dict, log=print) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"> wrote {path}")


def run_checkpoint_tool(parser: argparse.ArgumentParser, run_fn, argv=None) -> int:
    """A checkpoint tool's ``main``: parse, ``run_fn(args)``, a usage error as one line (exit 2); the one-process
    group the model was loaded in is left either way."""
    args = parser.parse_args(argv)
    try:
        run_fn(args)
    except (UsageError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    return run_checkpoint_tool(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
