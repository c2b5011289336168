#!/usr/bin/env bash
# Launch launch/train.py on this node with torchrun; run it once per node.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 GPUS_PER_NODE=8 launch/torchrun.sh --config configs/x.yaml
#
# Environment (defaults): NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500),
# GPUS_PER_NODE (number of visible GPUs, or 1 without GPUs), PYTHON (python), TRAIN_SCRIPT
# (launch/train.py next to this file), MAX_RESTARTS (0). Every argument is passed on to the training
# script, except --dry-run (first argument), which prints the command instead of running it.
#
# Faults: when torchrun fails (a rank died), it is run again, at most MAX_RESTARTS times; with
# --load = --save the run resumes from its newest checkpoint. SIGTERM / SIGINT sent to this script go
# to the training processes only: they finish the step, save, and exit 0, and so does this script
# (no restart). When torchrun is signalled itself, or stops the others after a rank died, it waits
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT (300) seconds before it kills them: time to save, and the longest a
# rank hung in a collective (its peer gone) holds up the restart.
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
MAX_RESTARTS="${MAX_RESTARTS:-0}"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=1
    if command -v nvidia-smi >/dev/null 2>&1; then
        count="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
        if [[ "${count}" -gt 0 ]]; then GPUS_PER_NODE="${count}"; fi
    fi
fi

for name in NNODES NODE_RANK MASTER_PORT GPUS_PER_NODE MAX_RESTARTS; do
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
# torchrun's grace period for its workers after it is signalled itself (default 30 s): time to save.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}"

CMD=("${PYTHON}" -m torch.distributed.run
     --nnodes "${NNODES}" --node-rank "${NODE_RANK}" --nproc-per-node "${GPUS_PER_NODE}"
     --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT}"
     "${TRAIN_SCRIPT}" "$@")

if (( DRY_RUN )); then
    printf '%q ' "${CMD[@]}"
    printf '\n'
    exit 0
fi

# torchrun in the background, so that a signal reaches the trap at once; the trap passes it to the
# workers (torchrun's children), which save and exit 0; torchrun then exits 0 too.
STOP_SIGNAL=""
TORCHRUN_PID=""
forward_to_workers() {
    STOP_SIGNAL="$1"
    echo "torchrun.sh: SIG$1: passing it to the training processes (they save and exit)" >&2
    if [[ -n "${TORCHRUN_PID}" ]]; then pkill "-$1" -P "${TORCHRUN_PID}" || true; fi
}
trap 'forward_to_workers TERM' TERM
trap 'forward_to_workers INT' INT

attempt=0
while true; do
    "${CMD[@]}" &
    TORCHRUN_PID=$!
    status=0
    wait "${TORCHRUN_PID}" || status=$?
    while kill -0 "${TORCHRUN_PID}" 2>/dev/null; do  # wait returned early for a trapped signal
        status=0
        wait "${TORCHRUN_PID}" || status=$?
    done
    if (( status == 0 )) || [[ -n "${STOP_SIGNAL}" ]] || (( attempt >= MAX_RESTARTS )); then
        exit "${status}"
    fi
    attempt=$((attempt + 1))
    echo "torchrun.sh: torchrun failed (status ${status}); restart ${attempt} of ${MAX_RESTARTS}" >&2
done
