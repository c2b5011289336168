#!/usr/bin/env bash
# Issue 32's g_min sweep on one H200 in ONE device call (600 s, start-ups included). From the repo root, with the
# cp312 megatron-core wheel in .whl/:
#   device run, carry [".whl"]:  bash tools/gpu/gmin_sweep.sh [steps=100] [budget_s=550]
# 1. an offline text corpus from the machine's own Python installation (tools/text_corpus.py: documentation files,
#    site-packages docstrings, /usr/share/doc; 16 MB, deterministic) -> indexed dataset (tools/preprocess_data.py);
# 2. tools/gmin_sweep.py: chunk_kda timed per gate, then 6 models of ~90M parameters (configs/gmin-sweep.yaml: g_min
#    -5 -3 -8 -12, softplus, and the full-attention RoPE reference) trained through launch/train.py at seq 2048, each
#    evaluated by tools/eval_lengths.py at 1-16x the training length. The sweep shares what is left of budget_s among
#    the settings still to run and SIGTERMs a trainer at the end of its share, so the JSON (rewritten after every
#    model) and the plot always come back.
# Writes $OUT/gmin-sweep-h200.json (-> docs/bench/gmin-sweep-h200.json), $OUT/gmin-sweep-h200.png, the corpus
# manifest, $OUT/gmin-sweep.log and each run's train.log / lengths.json; the table is printed last.
# Dry run of the flow on a CPU (no wheels, tiny model, small corpus):
#   NO_WHEELS=1 CONFIG=configs/gmin-sweep-tiny.yaml CORPUS_MB=2 MULTIPLES=1,2 OUT=/tmp/x bash tools/gpu/gmin_sweep.sh 2 400
set -u
START=$(date +%s)
STEPS=${1:-100}
BUDGET=${2:-550}
OUT=${OUT:-/tmp/gmin-out}
DATA=${DATA:-/tmp/gmin-data}
RUNS=${RUNS:-/tmp/gmin-runs}
CONFIG=${CONFIG:-configs/gmin-sweep.yaml}
CORPUS_MB=${CORPUS_MB:-16}
MULTIPLES=${MULTIPLES:-1,2,4,8,16}
mkdir -p "$OUT" "$DATA"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -z "${NO_WHEELS:-}" ] && [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD
PYTHON=${PYTHON:-$(command -v python3)}  # a path: the function below must not call itself
python3() { "$PYTHON" "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
{
  python3 tools/text_corpus.py --out "$DATA/text.jsonl" --max-mb "$CORPUS_MB" \
    && python3 tools/preprocess_data.py --input "$DATA/text.jsonl" --output-prefix "$DATA/text" --log-interval 1000000
} 2>&1 | tee "$OUT/data.log"
[ -f "$DATA/text.idx" ] || { echo "corpus build failed (see $OUT/data.log)"; exit 1; }
cp "$DATA/text.jsonl.manifest.json" "$OUT/corpus-manifest.json"
LEFT=$(( BUDGET - ($(date +%s) - START) ))
echo "> $(( $(date +%s) - START ))s spent on set-up; sweep budget ${LEFT}s, ${STEPS} steps per model"
python3 tools/gmin_sweep.py --config "$CONFIG" --out-dir "$RUNS" --data-path "$DATA/text" --multiples "$MULTIPLES" \
  --steps "$STEPS" --time-budget "$LEFT" --json "$OUT/gmin-sweep-h200.json" --plot "$OUT/gmin-sweep-h200.png" \
  2>&1 | tee "$OUT/gmin-sweep.log"
RC=${PIPESTATUS[0]}
mkdir -p "$OUT/runs"
for d in "$RUNS"/*/; do
  name=$(basename "$d"); mkdir -p "$OUT/runs/$name"
  cp "$d"/metrics.jsonl "$d"/lengths.json "$OUT/runs/$name/" 2>/dev/null
  tail -n 60 "$d/train.log" > "$OUT/runs/$name/train.log.tail" 2>/dev/null
done
echo "> total $(( $(date +%s) - START ))s"
exit "$RC"
