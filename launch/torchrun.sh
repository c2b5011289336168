#!/usr/bin/env bash
# Launch launch/train.py on this node with torchrun; run it once per node.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 GPUS_PER_NODE=8 launch/torchrun.sh --config configs/x.yaml
#
# Environment (defaults): NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500),
# GPUS_PER_NODE (number of visible GPUs, or 1 without GPUs), PYTHON (python), TRAIN_SCRIPT
# (launch/train.py next to this file). Every argument is passed on to the training script,
# except --dry-run (first argument), which prints the command instead of running it.
set -euo pipefail

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY_RUN=1
    shift
fi

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
TRAIN_SCRIPT="${TRAIN_SCRIPT:-${HERE}/train.py}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=1
    if command -v nvidia-smi >/dev/null 2>&1; then
        count="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
        if [[ "${count}" -gt 0 ]]; then GPUS_PER_NODE="${count}"; fi
    fi
fi

for name in NNODES NODE_RANK MASTER_PORT GPUS_PER_NODE; do
    if ! [[ "${!name}" =~ ^[0-9]+$ ]]; then
        echo "torchrun.sh: ${name} must be a non-negative integer, got '${!name}'" >&2
        exit 2
    fi
done
if (( NODE_RANK >= NNODES )); then
    echo "torchrun.sh: NODE_RANK (${NODE_RANK}) must be < NNODES (${NNODES})" >&2
    exit 2
fi

# Megatron's TP/SP overlap expects one connection per device; harmless elsewhere.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"

CMD=("${PYTHON}" -m torch.distributed.run
     --nnodes "${NNODES}" --node-rank "${NODE_RANK}" --nproc-per-node "${GPUS_PER_NODE}"
     --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT}"
     "${TRAIN_SCRIPT}" "$@")

if (( DRY_RUN )); then
    printf '%q ' "${CMD[@]}"
    printf '\n'
    exit 0
fi
exec "${CMD[@]}"
