#!/usr/bin/env bash
# Stage branches for an A/B on the GPU machine, which receives only this working tree: each branch's
# code goes into the ignored folder .ab/<branch>/ (carry ".ab" with the call), where a benchmark runs
# from inside that folder against the branch's kernels:
#   bash tools/dev/stage_branches.sh kda-dqk-da short-conv-bwd        # here, before the call
#   (cd .ab/kda-dqk-da && PYTHONPATH=/tmp/site:$PWD python3 tools/bench_kda.py --skip-fla --out ...)  # there
set -eu
cd "$(dirname "$0")/../.."
[ $# -gt 0 ] || { echo "usage: $0 BRANCH [BRANCH ...]" >&2; exit 2; }
for branch in "$@"; do
  git rev-parse --verify --quiet "$branch" > /dev/null || { echo "no branch '$branch'" >&2; exit 2; }
  dest=".ab/$branch"
  rm -rf "$dest" && mkdir -p "$dest"
  git archive "$branch" kimi_kernels megatron_ext tools tests configs launch pyproject.toml | tar -x -C "$dest"
  echo "staged $branch ($(git rev-parse --short "$branch")) in $dest ($(du -sh "$dest" | cut -f1))"
done
