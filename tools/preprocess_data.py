"""JSONL -> Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``).

    python tools/preprocess_data.py --input docs.jsonl --output-prefix data/docs
    python tools/preprocess_data.py --input docs.jsonl --output-prefix data/docs \
        --tokenizer-json /path/to/tokenizer.json --json-key content

Each line is one JSON object; its text (``--json-key``, default ``text``) is tokenized
(byte-level by default, or a local Hugging Face ``tokenizer.json``) and written as one
document followed by EOD. Empty texts are skipped. A line that is not valid JSON, not an
object, or lacks the key stops the run with its line number (``--skip-bad-lines`` reports and
skips it instead). Outputs are written under temporary names and renamed at the end, so an
interrupted run never leaves a pair that looks complete. Use the same tokenizer for training
(``tokenizer_json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="JSONL file, one object per line")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--json-key", default="text", help="key holding the text (default: text)")
    p.add_argument("--tokenizer-json", default=None, help="local HF tokenizer.json (default: bytes)")
    p.add_argument("--eod-token", default=None, help="EOD token name in --tokenizer-json")
    p.add_argument("--skip-bad-lines", action="store_true", help="report and skip bad lines")
    p.add_argument("--log-interval", type=int, default=10000, help="progress every N lines")
    return p.parse_args(argv)


def _text_of(line: str, key: str, lineno: int, path: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise ValueError(f"{path}:{lineno}: no key {key!r} (keys: {', '.join(list(obj)[:10])})")
    if not isinstance(obj[key], str):
        raise ValueError(f"{path}:{lineno}: {key!r} is a {type(obj[key]).__name__}, not a string")
    return obj[key]


def preprocess(input_path: str, output_prefix: str, json_key: str = "text",
               tokenizer_json: str | None = None, eod_token: str | None = None,
               skip_bad_lines: bool = False, log_interval: int = 10000, log=print) -> dict:
    """Write ``output_prefix``.bin/.idx; return counts {'documents', 'tokens', 'skipped'}."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron_ext.data.tokenizer import build_tokenizer

    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input {input_path} does not exist")
    tokenizer = build_tokenizer(tokenizer_json, eod_token)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    bin_tmp, idx_tmp = output_prefix + ".bin.tmp", output_prefix + ".idx.tmp"
    builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
    counts = {"documents": 0, "tokens": 0, "skipped": 0}
    start = time.perf_counter()
    size = os.path.getsize(input_path)
    try:
        with open(input_path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                line = raw.decode("utf-8", errors="replace").strip()
                if line:
                    try:
                        text = _text_of(line, json_key, lineno, input_path)
                    except ValueError as exc:
                        if not skip_bad_lines:
                            raise
                        log(f"skipping {exc}")
                        counts["skipped"] += 1
                        text = ""
                    if text:
                        ids = np.asarray(tokenizer.tokenize(text) + [tokenizer.eod], dtype=np.int64)
                        builder.add_document(ids, [len(ids)])
                        counts["documents"] += 1
                        counts["tokens"] += len(ids)
                if lineno % log_interval == 0:
                    elapsed = time.perf_counter() - start
                    log(f"  {lineno} lines, {counts['documents']} documents, {counts['tokens']} tokens, "
                        f"{f.tell() / 1e6:.1f}/{size / 1e6:.1f} MB, {f.tell() / 1e6 / max(elapsed, 1e-9):.1f} MB/s")
        builder.finalize(idx_tmp)
    except BaseException:
        builder.data_file.close()
        for path in (bin_tmp, idx_tmp):
            if os.path.exists(path):
                os.remove(path)
        raise
    os.replace(bin_tmp, output_prefix + ".bin")
    os.replace(idx_tmp, output_prefix + ".idx")
    log(f"wrote {output_prefix}.bin/.idx: {counts['documents']} documents, {counts['tokens']} tokens "
        f"({np.dtype(dtype).name}), {counts['skipped']} lines skipped, "
        f"{time.perf_counter() - start:.1f}s")
    return counts


def main(argv=None) -> int:
    args = _parse_args(argv)
    try:
        preprocess(args.input, args.output_prefix, args.json_key, args.tokenizer_json,
                   args.eod_token, args.skip_bad_lines, args.log_interval)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
