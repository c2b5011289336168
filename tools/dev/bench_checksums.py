"""Time a checkpoint's checksums (megatron_ext/training/checkpoint_integrity.py) on this host, one rank.

Writes ``--files`` files of ``--gb`` GB of random bytes under ``--dir`` (default /dev/shm: page-cache speed, as
right after a save), then times ``write_manifest`` and ``damaged_files`` per file (``block_bytes`` None: one
CRC-32 per file, what manifests held before the blocks) and per block (``BLOCK_BYTES``, split over this host's
threads), each the median of ``--repeat`` runs. Both verify the same bytes; the table gives GB/s and the ratio.

    python tools/dev/bench_checksums.py [--gb 4 --files 1 --out docs/bench/checksums-HOST.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megatron_ext.training import checkpoint_integrity as integrity  # noqa: E402


def make_files(directory: Path, files: int, gb: float) -> int:
    piece = os.urandom(64 << 20)
    size = int(gb * 1e9) // len(piece) * len(piece)
    for i in range(files):
        with open(directory / f"__{i}_0.distcp", "wb") as f:
            for _ in range(size // len(piece)):
                f.write(piece)
    return files * size


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=2.0, help="size of each file (default 2)")
    p.add_argument("--files", type=int, default=1, help="files, as one rank's shards (default 1)")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    directory = Path(tempfile.mkdtemp(prefix="bench-checksums-", dir=args.dir))
    try:
        total = make_files(directory, args.files, args.gb)
        rows = []
        for name, block_bytes in (("per file", None), ("per block", integrity.BLOCK_BYTES)):
            write_s = timed(lambda: integrity.write_manifest(str(directory), block_bytes=block_bytes), args.repeat)
            verify_s = timed(lambda: integrity.damaged_files(str(directory)), args.repeat)
            assert integrity.damaged_files(str(directory)) == []
            rows.append({"checksums": name, "block_bytes": block_bytes, "write_s": write_s, "verify_s": verify_s,
                         "write_gb_per_s": total / write_s / 1e9, "verify_gb_per_s": total / verify_s / 1e9})
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {"host": platform.node(), "cores": len(os.sched_getaffinity(0)), "threads": integrity._threads(),
              "bytes": total, "files": args.files, "dir": args.dir, "repeat": args.repeat, "rows": rows,
              "date": time.strftime("%Y-%m-%d")}
    print(f"{total / 1e9:.1f} GB in {args.files} file(s), {result['cores']} cores, {result['threads']} threads")
    print(f"{'checksums':>10} | {'write s':>8} | {'GB/s':>6} | {'verify s':>8} | {'GB/s':>6}")
    for r in rows:
        print(f"{r['checksums']:>10} | {r['write_s']:8.2f} | {r['write_gb_per_s']:6.2f} | {r['verify_s']:8.2f} | "
              f"{r['verify_gb_per_s']:6.2f}")
    print(f"per block vs per file: {rows[0]['verify_s'] / rows[1]['verify_s']:.2f}x (verify)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
