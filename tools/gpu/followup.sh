#!/usr/bin/env bash
# Second device call of a session: GPU unit tests with a failure summary, our KDA kernel timings
# (without fla: its autotuning alone takes minutes) and the MoE layer vs stock Megatron at E=64.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rfE --timeout 90 \
  tests/kernels tests/moe tests/kda tests/attn_res > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | tail -20
timeout 150 python3 tools/bench_kda.py --shapes 0 --skip-fla --out "$OUT/kda-h200.json" > "$OUT/kda.log" 2>&1
echo "kda rc=$?"; tail -15 "$OUT/kda.log"
timeout 70 python3 tools/bench_moe.py --experts 64 --out "$OUT/moe-h200.json" > "$OUT/moe.log" 2>&1
echo "moe rc=$?"; grep "^>" "$OUT/moe.log"
