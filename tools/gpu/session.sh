#!/usr/bin/env bash
# One device-machine call that checks and times everything (see docs/benchmarks.md).
# Usage on the GPU machine, from the repo root, with the cp312 wheels in .whl/:
#   bash tools/gpu/session.sh [steps]      steps: comma list of tests,train,attnres,attnres-ab,attnres-config,moe,routing,skew,kda,
#                                          e2e,e2e-ab,e2e2,profile (and moe2, rmsnorm, checksums)
# Each step has its own time limit, logs to $OUT/session.log and writes its JSON under $OUT.
# Independent steps can share one call on a two-GPU machine, one track per GPU:
#   bash tools/gpu/session.sh install
#   CUDA_VISIBLE_DEVICES=0 OUT=$OUT/g0 bash tools/gpu/session.sh tests,e2e &
#   CUDA_VISIBLE_DEVICES=1 OUT=$OUT/g1 bash tools/gpu/session.sh kda; wait
# A/B of branches in the same call: tools/dev/stage_branches.sh here (carry ".ab"), tools/dev/ab.sh there.
# At most 8 files come back from $OUT: point each step at its own file and concatenate the logs.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
STEPS=${1:-tests,train,attnres,moe,routing}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -f /tmp/site/.installed ]; then  # once per machine: parallel tracks must not reinstall
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  touch /tmp/site/.installed
fi
[ "$STEPS" = install ] && exit 0
export PYTHONPATH=/tmp/site:$PWD
LOG="$OUT/session.log"
wants() { [[ ",$STEPS," == *",$1,"* ]]; }  # wants NAME: the call asked for step NAME
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  wants "$name" || return 0
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$LOG"
step tests ${TESTS_LIMIT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS_PATHS:-tests/kernels tests/moe tests/kda tests/attn_res tests/tools} ${TESTS_EXTRA:-tests/parallel/test_fused_adamw_step.py tests/test_grad_norm.py}
step train ${TRAIN_LIMIT:-200} python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu_training.py ${TRAIN_FLAGS:-}
step attnres ${ATTNRES_LIMIT:-150} python3 tools/bench_attnres.py --out "$OUT/attnres-h200.json"
# AttnRes with and without the paired backward (attn_res_pair_backward) as more models of the same interleaved rounds
step attnres-ab ${ATTNRES_LIMIT:-240} python3 tools/bench_attnres.py --ab-pair --out "$OUT/attnres-ab-h200.json"
step attnres-config ${ATTNRES_CONFIG_LIMIT:-420} python3 tools/dev/bench_attnres_config.py --out "$OUT/attnres-config-h200.json"
step moe ${MOE_LIMIT:-60} python3 tools/bench_moe.py --out "$OUT/moe-h200.json"
step moe2 ${MOE_LIMIT:-60} torchrun --standalone --nproc-per-node 2 tools/bench_moe.py --out "$OUT/moe-h200x2.json"
step routing 45 python3 tools/dev/bench_routing.py --out "$OUT/routing-h200.json"
# The skew training meets: configs/h200.yaml trained SKEW_ITERS iterations, its routers' scores recorded on held-out
# data (tools/router_scores.py), then the routing and the MoE layer timed on those scores
SKEW_DIR=/tmp/skew; SKEW_ITERS=${SKEW_ITERS:-100}
step skew ${SKEW_LIMIT:-480} bash -c "rm -rf $SKEW_DIR && python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
  launch/train.py --config configs/h200.yaml --train-iters $SKEW_ITERS --save $SKEW_DIR/ckpt --save-interval $SKEW_ITERS \
  --no-save-optim --metrics-dir $SKEW_DIR \
  && python3 tools/router_scores.py $SKEW_DIR/ckpt --tokens 16384 --out $OUT/router-scores-h200.json --scores-out $SKEW_DIR/scores.pt \
  && python3 tools/dev/bench_routing.py --scores $SKEW_DIR/scores.pt --out $OUT/routing-skew-h200.json \
  && python3 tools/bench_moe.py --scores $SKEW_DIR/scores.pt --out $OUT/moe-skew-h200.json"
step rmsnorm 60 python3 tools/dev/bench_rms_norm.py --out "$OUT/rms-norm-h200.json"
# checkpoint checksums per file vs per block on this host's cores (8 GB in /dev/shm, host-side only)
step checksums 120 python3 tools/dev/bench_checksums.py --gb 8 --out "$OUT/checksums-h200.json"
# fla autotunes for minutes per head count (238 s at B4 T8192 H32). Its choices are Triton cache_results files
# (*.autotune.json: configs, not timings; docs/benchmarks.md, KDA kernels): the step packs them into
# $OUT/kda-autotune.tgz, and KDA_AUTOTUNE=<that file, carried> unpacks them first, so a call cut short in fla's
# autotune leaves the next one less to tune. tools/gpu/fla-autotune-h200.tgz: the choices of an H200 call at H 32
# (bench_kda --shapes 0, 2026-12-06, triton 3.6.0, fla-core 0.6.0: they apply to that pair and to an H200 only).
if wants kda; then
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
  mkdir -p "$TRITON_CACHE_DIR"
  [ -n "${KDA_AUTOTUNE:-}" ] && tar xzf "$KDA_AUTOTUNE" -C "$TRITON_CACHE_DIR"
fi
step kda ${KDA_LIMIT:-300} python3 tools/bench_kda.py --shapes 0,1 ${KDA_FLAGS:-} --out "$OUT/kda-h200.json"
if wants kda; then
  (cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar czf "$OUT/kda-autotune.tgz" -T -)
fi
# expandable segments: the five variants of one process reuse memory of different shapes
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
step e2e ${E2E_LIMIT:-400} python3 tools/bench_e2e.py ${E2E_FLAGS:-} --out "$OUT/e2e-h200.json"
# ours_full as training runs it (one GPU: graphed capacity routing, no host reads) and as A/B rows (+host-reads:
# the eager routing that reads between rounds), in one process beside ours_base (the criterion's other side)
step e2e-ab ${E2E_LIMIT:-300} python3 tools/bench_e2e.py --out "$OUT/e2e-ab-h200.json" \
  --variants ${E2E_AB_VARIANTS:-ours_base,ours_full,ours_full+host-reads,ours_full,ours_full+host-reads,ours_base}
step e2e2 ${E2E_LIMIT:-300} torchrun --standalone --nproc-per-node 2 tools/bench_e2e.py ${E2E_FLAGS:-} --out "$OUT/e2e-h200x2.json"
step profile ${PROFILE_LIMIT:-150} python3 tools/bench_e2e.py --profile ${PROFILE_VARIANT:-ours_full} --profile-out "$OUT/profile-${PROFILE_VARIANT:-ours_full}.md"
tail -n 60 "$LOG" | grep -E "^===|passed|failed|error|Error" | tail -40
