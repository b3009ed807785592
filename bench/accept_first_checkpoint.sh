#!/usr/bin/env bash
# Issue #10 acceptance on a GPU machine: a shipped recipe as shipped, with only `--cluster local`
# and the GPUs per node changed, trains to its first checkpoint. The chain runs in the foreground
# (local backend); once its segment has started, an `exit` trigger asks for a save at the end of
# the first iteration, after which the chain stops. Prints the status, the checkpoint and the peak
# GPU memory, then deletes the checkpoint (an 8B one is ~100 GB).
#
#   bash bench/accept_first_checkpoint.sh [RECIPE] [GPUS]      (default: train/llama3-8b 4)
set -uo pipefail
cd "$(dirname "$0")/.."
RECIPE=${1:-train/llama3-8b}
GPUS=${2:-4}
OUT=${OUT:-$PWD/gpu-out}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
ML=("$PY" -m megalaunch.cli.main)
ROOT=${MEGALAUNCH_ACCEPT_ROOT:-$HOME/megalaunch-runs}
before=$(ls -d "$ROOT"/*/ 2>/dev/null | sort)
start=$(date +%s)
"${ML[@]}" submit "$RECIPE" --cluster local --set "cluster.gpus_per_node=$GPUS" > "$OUT/accept-submit.txt" 2>&1 &
sub=$!
run=""
for _ in $(seq 1 600); do
  run=$(comm -13 <(echo "$before") <(ls -d "$ROOT"/*/ 2>/dev/null | sort) | head -n 1)
  if [ -n "$run" ] && grep -q '"event": "started"' "$run/state/ledger.jsonl" 2>/dev/null; then break; fi
  if ! kill -0 "$sub" 2>/dev/null; then break; fi
  sleep 1
done
run=${run%/}
echo "run: $run ($(( $(date +%s) - start )) s after submit)"
if [ -n "$run" ] && kill -0 "$sub" 2>/dev/null; then
  "${ML[@]}" trigger exit "$run" --reason "acceptance: stop at the first checkpoint"
fi
peak=0
while kill -0 "$sub" 2>/dev/null; do
  if command -v nvidia-smi >/dev/null; then
    m=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -n 1)
    [ "${m:-0}" -gt "$peak" ] && peak=$m
  fi
  sleep 2
done
wait "$sub"; rc=$?
echo "submit exit status $rc after $(( $(date +%s) - start )) s; peak GPU memory used (nvidia-smi, busiest GPU) ${peak} MiB"
tail -n 15 "$OUT/accept-submit.txt"
if [ -n "$run" ]; then
  "${ML[@]}" status "$run"
  echo "tracker: $(cat "$run/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null)"
  du -sh "$run"/checkpoints/iter_* 2>/dev/null
  grep -hE "decision|checkpoint at iteration|outcome|elapsed time per iteration|iteration +1/" "$run"/logs/*.out 2>/dev/null | head -n 20
  cp "$run"/logs/*.out "$OUT/" 2>/dev/null
  cp "$run/state/ledger.jsonl" "$OUT/accept-ledger.jsonl" 2>/dev/null
  rm -rf "$run/checkpoints"
fi
