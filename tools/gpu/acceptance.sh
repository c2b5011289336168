#!/usr/bin/env bash
# The user's job on the GPU in one device call (steps and rules: tools/gpu/acceptance.py). From this machine, on a
# clean tree (the commit is recorded), with the cp312 wheels of megatron-core (and fla-core for fla-test) in .whl/:
#   device run, carry [".whl"]:  ACCEPTANCE_COMMIT=<git rev-parse HEAD> bash tools/gpu/acceptance.sh [steps]
# writes $OUT/acceptance-<gpu>.json (h200, h100, ... from nvidia-smi's name) and $OUT/acceptance.log; copy the
# JSON to docs/bench/ (two calls of one commit: python tools/gpu/acceptance.py merge A.json B.json --out ...).
set -u
OUT=${OUT:-/tmp/acceptance-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE '[A-Z]+[0-9]{2,3}' | head -1 | tr 'A-Z' 'a-z')
python3 tools/gpu/acceptance.py --out "$OUT/acceptance-${gpu:-gpu}.json" ${1:+--steps "$1"} 2>&1 | tee "$OUT/acceptance.log"
exit "${PIPESTATUS[0]}"
