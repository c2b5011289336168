#!/usr/bin/env bash
# On the GPU machine: run one benchmark command for the working tree and for each branch staged by
# tools/dev/stage_branches.sh (in .ab/<branch>), one after the other on the same GPU, so the results
# are from one run. "{name}" in the command becomes "main" or the branch name (use it in --out paths).
#   bash tools/dev/ab.sh 'python3 tools/bench_kda.py --shapes 0,1 --skip-fla --out $OUT/kda-{name}.json' kda-dqk-da
set -u
[ $# -ge 1 ] || { echo "usage: $0 'COMMAND with {name}' [BRANCH ...]" >&2; exit 2; }
cmd=$1; shift
root=$PWD
export OUT=${OUT:-/tmp/gpu-out} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
for name in main "$@"; do
  dir=$root; [ "$name" = main ] || dir=$root/.ab/$name
  [ -d "$dir" ] || { echo "=== $name: $dir missing (run tools/dev/stage_branches.sh here first)"; continue; }
  echo "=== $name ($(date -u +%H:%M:%S))"
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir bash -c "${cmd//\{name\}/$name}")
  echo "=== $name rc=$?"
done
