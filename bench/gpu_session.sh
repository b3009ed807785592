#!/usr/bin/env bash
# Everything the training runtime needs proven on a GPU machine, in stages that each fit in a
# 10-minute command. Results go under $OUT (default ./gpu-out): logs, junit XML, JSON, nvidia-smi.
#
#   bash bench/gpu_session.sh setup tests        # install (offline), GPU tests   (~6-8 min on an H100)
#   bash bench/gpu_session.sh throughput         # megalaunch vs bare pretrain     (~4-5 min)
#   bash bench/gpu_session.sh save               # sync/async save, signal-to-exit (~2-3 min)
#   bash bench/gpu_session.sh eval               # the 1B model's milestone eval (~3-4 min): docs/eval.md
#   bash bench/gpu_session.sh speed              # 4 GPUs: SDPA kernels, speed flags, 8B MFU (~6 min)
#   bash bench/gpu_session.sh plan               # 4 GPUs: the planner's 8B ranking, trained (~8 min)
#   bash bench/gpu_session.sh storage            # the 1B chain on the disk: peak, saves, bandwidth (~8 min)
#   bash bench/gpu_session.sh profile            # where a save's time goes, beside dd (~4 min)
#   bash bench/gpu_session.sh load               # where a resumed segment's load goes (~3 min)
#   bash bench/gpu_session.sh staging            # async saves: Megatron's staging vs the pinned arena, threaded load (~5 min)
#   bash bench/gpu_session.sh kernels            # liger-kernel vs Megatron: ops, 1B end to end, tests (~8 min)
#   bash bench/gpu_session.sh mfu8b              # llama3-8b on all GPUs, planner's first layout, profiled (~5 min)
#   bash bench/gpu_session.sh sft                # 1B SFT from a converted checkpoint beside pre-training (~4 min)
#   bash bench/gpu_session.sh fp8                # FP8 GEMMs without TE beside bf16: GEMMs, 1B end to end (~6 min)
#   bash bench/gpu_session.sh fp8loss            # 1B loss curves bf16 vs fp8 on a corpus with a loss floor (~6 min)
#   bash bench/gpu_session.sh fp8_8b             # 4 GPUs: llama3-8b bf16 beside fp8, one layout (FP8_8B_SETS) (~8 min)
#   bash bench/gpu_session.sh fp8tests           # fp8's GPU tests: Triton casts, exact resume (~5 min)
#   bash bench/gpu_session.sh fsdptests          # 4 GPUs: Megatron-FSDP's GPU tests, bf16 and fp8 side by side (~5 min)
#   bash bench/gpu_session.sh fsdp_e2e           # parallel.data_sharding=optimizer_grads_params: bf16, fp8 (FSDP_*) (~5 min)
#   bash bench/gpu_session.sh fsdp_probe         # 4 GPUs: llama3-8b under Megatron-FSDP (TP 1) via megatron_args, bf16/fp8 (~6 min)
#   bash bench/gpu_session.sh moe                # MoE on one GPU: SequentialMLP vs grouped-GEMM experts, moe-3b + Mixtral-like (~5 min)
#   bash bench/gpu_session.sh moe_ops            # one GPU: the experts' memory-bound ops (bench/moe_ops.py) and their GPU tests (~1-2 min)
#   bash bench/gpu_session.sh moe_sweep          # one GPU: MoE recipes over micro-batches (MOE_SWEEP), the planner's speed model's points
#   bash bench/gpu_session.sh post_training      # one GPU: 1B DPO beside SFT (same tokens per step), the reference stage (~6 min)
#   bash bench/gpu_session.sh all                # the lot (only where no time limit applies)
#
# The machine has no network: Python packages travel as wheels in .carry/wheels (carry that path).
# torch is preinstalled there. Wheels needed (pip download --no-deps --only-binary=:all:
# --python-version 3.12 -d .carry/wheels ...): megatron-core==0.19.2 psutil pyyaml jinja2 markupsafe
# packaging pytest pluggy iniconfig pytest-timeout einops (Megatron-FSDP's checkpoints) (the kernels stage: liger-kernel). numpy must be there already (torch images have it).
# The sft stage needs nothing more: its Hugging Face-shaped checkpoint is written and converted by
# megalaunch's own code (no transformers or safetensors package).
# The eval stage also needs (same command): typer annotated-doc click rich markdown-it-py mdurl pygments
# shellingham transformers tokenizers safetensors huggingface-hub hf-xet httpx2 httpcore2 h11 anyio idna
# truststore filelock fsspec regex tqdm typing-extensions (no lm-eval: held-out perplexity and the
# local task runner need none; EVAL_ARGS=--lm-eval needs lm-eval, accelerate and their dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python}
WHEELS=${WHEELS:-.carry/wheels}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export MEGALAUNCH_ALLOW_UNPINNED_MEGATRON=${MEGALAUNCH_ALLOW_UNPINNED_MEGATRON:-0}

stage_setup() {
  {
    nvidia-smi || true
    "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  } > "$OUT/machine.txt" 2>&1
  cat "$OUT/machine.txt"
  if ! "$PY" -c "import megatron.core, psutil, yaml, jinja2, pytest, einops" 2>/dev/null; then
    "$PY" -m pip install --no-index --no-deps --find-links "$WHEELS" \
      megatron-core==0.19.2 psutil pyyaml jinja2 markupsafe packaging pytest pluggy iniconfig pytest-timeout einops \
      2>&1 | tail -n 3
  fi
  # The package itself (no dependencies, no network); PYTHONPATH=src covers a failure here.
  "$PY" -m pip install --no-deps --no-build-isolation -e . > "$OUT/pip-megalaunch.txt" 2>&1 \
    || echo "note: pip install -e . failed (see $OUT/pip-megalaunch.txt); using PYTHONPATH=src"
  "$PY" -c "import numpy, megatron.core as m; print('megatron-core', m.__version__, 'numpy', numpy.__version__)"
}

stage_tests() {
  "$PY" -m pytest -m gpu tests/gpu/test_train_gpu.py -s -q -p no:cacheprovider \
    --basetemp="$OUT/pytest" --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.txt" \
    | grep -E "^\[|passed|failed|error|Error" || true
}

stage_throughput() {
  "$PY" bench/train_overhead.py --stage throughput --attention "${ATTENTION:-sdpa}" --out "$OUT/train_overhead" \
    2>&1 | tee "$OUT/throughput.txt"
}

stage_save() {
  "$PY" bench/train_overhead.py --stage save --attention "${ATTENTION:-sdpa}" --out "$OUT/train_overhead" \
    2>&1 | tee "$OUT/save.txt"
}

stage_eval() {
  if ! "$PY" -c "import transformers, tokenizers, typer" 2>/dev/null; then
    "$PY" -m pip install --no-index --no-deps --find-links "$WHEELS" \
      typer annotated-doc click rich markdown-it-py mdurl pygments shellingham transformers tokenizers \
      safetensors huggingface-hub hf-xet httpx2 httpcore2 h11 anyio idna truststore filelock fsspec regex tqdm \
      typing-extensions 2>&1 | tail -n 3
  fi
  # shellcheck disable=SC2086
  "$PY" bench/eval_milestone.py --out "$OUT/eval" ${EVAL_ARGS:-} 2>&1 | tee "$OUT/eval.txt" | tail -n 40
}

# The device's GPU type for the planner (memory and speed): H200 or H100.
gpu_type() { nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -q H200 && echo H200 || echo H100; }

# Bulky run directories go to $WORK; $OUT gets the tables, the JSON and the logs as one archive.
WORK=${WORK:-/tmp/megalaunch-bench}

stage_speed() {  # issue 13: the kernels side by side, the flags on one GPU each, the 8B before/after
  "$PY" bench/sdpa_backends.py 2>&1 | tee "$OUT/sdpa_backends.txt"
  "$PY" bench/speed_flags.py --stage flags --out "$WORK/flags" 2>&1 | tee "$OUT/speed_flags.txt" | grep -v "^  "
  local layout=()  # the whole 8B with TP 1 needs ~127 GiB: on 80 GB cards, the planner's TP 2 + SP
  [ "$(gpu_type)" = H200 ] || layout=(--layout parallel.tensor_model_parallel_size=2 --layout parallel.sequence_parallel=true)
  # shellcheck disable=SC2086
  "$PY" bench/speed_flags.py --stage full --gpus "$(nvidia-smi -L | wc -l)" "${layout[@]}" ${SPEED_ARGS:-} \
    --out "$WORK/full" 2>&1 | tee -a "$OUT/speed_flags.txt" | grep -v "^  "
  cp "$WORK"/flags/*.json "$WORK"/full/*.json "$OUT"/ 2>/dev/null || true
  tar -czf "$OUT/speed_logs.tgz" -C "$WORK" --exclude runs flags full 2>/dev/null || true
}

stage_plan() {  # issue 13: the planner's ranking of the whole 8B on this node, each layout trained
  # shellcheck disable=SC2086
  "$PY" bench/plan.py --recipe train/llama3-8b --gpus "$(nvidia-smi -L | wc -l)" --gpu "$(gpu_type)" \
    --set training.global_batch_size=${PLAN_GBS:-16} ${PLAN_ARGS:---top 5 --families} --iters 6 \
    --out "$WORK/plan" 2>&1 | tee "$OUT/plan.txt" | grep -v "^  "
  cp "$WORK"/plan/*.json "$OUT"/ 2>/dev/null || true
  tar -czf "$OUT/plan_logs.tgz" -C "$WORK" --exclude runs plan 2>/dev/null || true
}

need_liger() {
  "$PY" -c "import liger_kernel" 2>/dev/null \
    || "$PY" -m pip install --no-index --no-deps --find-links "$WHEELS" liger-kernel 2>&1 | tail -n 1
}

stage_kernels() {  # issue 27: liger-kernel vs Megatron's kernels, per op and llama3-1b end to end, then the tests
  need_liger
  timeout "${KERNELS_OPS_S:-150}" "$PY" bench/kernels.py --stage ops --out "$OUT/kernels" 2>&1 \
    | tee "$OUT/kernels_ops.txt" | grep -vE "warn|Warn" || true
  # shellcheck disable=SC2086
  timeout "${KERNELS_E2E_S:-330}" "$PY" bench/kernels.py --stage e2e --out "$WORK/kernels" ${KERNELS_ARGS:-} 2>&1 \
    | tee "$OUT/kernels_e2e.txt" | grep -v "^  {" || true
  cp "$WORK"/kernels/*.json "$OUT"/ 2>/dev/null || true
  tar -czf "$OUT/kernels_logs.tgz" -C "$WORK" --exclude runs kernels 2>/dev/null || true
  timeout "${KERNELS_TESTS_S:-200}" "$PY" -m pytest -m gpu tests/gpu/test_kernels_gpu.py -s -q -p no:cacheprovider \
    --basetemp="$OUT/pytest-kernels" --junitxml="$OUT/kernels-tests.xml" 2>&1 | tee "$OUT/kernels-tests.txt" \
    | grep -E "^\[|passed|failed|error|Error" || true
}

stage_mfu8b() {  # issue 27: llama3-8b on every GPU of the node, the planner's first layout, profiled
  need_liger
  local gpus mib sets
  gpus=$(nvidia-smi -L | wc -l)
  mib=$(nvidia-smi -i 0 --query-gpu=memory.total --format=csv,noheader,nounits)
  # the planner's first layout for 4 GPUs: TP 1 x DP 4 where ~115 GiB fit (H200), else TP 2 x DP 2 + SP (H100)
  if [ "$mib" -gt 120000 ]; then sets="parallel.tensor_model_parallel_size=1,parallel.sequence_parallel=false"
  else sets="parallel.tensor_model_parallel_size=2,parallel.sequence_parallel=true"; fi
  # shellcheck disable=SC2086
  timeout "${MFU8B_S:-420}" "$PY" bench/kernels.py --stage e2e --recipe train/llama3-8b --gpus "$gpus" --seq 8192 \
    --gbs "${MFU8B_GBS:-32}" --sets "${MFU8B_SETS:-$sets}" --cases "${MFU8B_CASES:-megatron-mb1+prof}" --iters 6 \
    --timeout 400 --out "$WORK/mfu8b" 2>&1 | tee "$OUT/mfu8b.txt" | grep -v "^  {" || true
  cp "$WORK"/mfu8b/*.json "$OUT"/ 2>/dev/null || true
  tar -czf "$OUT/mfu8b_logs.tgz" -C "$WORK" --exclude runs mfu8b 2>/dev/null || true
}

stage_storage() {  # issue 23: the 1B chain on this machine's disk with the shipped keep_last: 2
  rm -rf "$WORK/storage"
  # shellcheck disable=SC2086
  "$PY" bench/storage_chain.py --out "$OUT/storage" --root "$WORK/storage" ${STORAGE_ARGS:-} 2>&1 \
    | tee "$OUT/storage.txt" | grep -vE "^\s+\[" | tail -n 80
  tar -czf "$OUT/storage_logs.tgz" -C "$WORK/storage" --exclude checkpoints . 2>/dev/null || true
}

stage_profile() {  # issue 23: a save's phases and writer threads against the disk's own bandwidth
  rm -rf "$WORK/profile"
  # shellcheck disable=SC2086
  "$PY" bench/save_profile.py --dir "$WORK/profile" --json "$OUT/save_profile.json" ${PROFILE_ARGS:-} 2>&1 \
    | grep -vE "warn|Warn" | tee "$OUT/save_profile.txt"
  rm -rf "$WORK/profile"
}

stage_load() {  # issue 25: where a resumed segment's checkpoint load goes (allocator variants, a profile)
  rm -rf "$WORK/load"
  # shellcheck disable=SC2086
  "$PY" bench/load_profile.py --dir "$WORK/load" --json "$OUT/load_profile.json" ${LOAD_ARGS:-} 2>&1 \
    | grep -vE "warn|Warn" | tee "$OUT/load_profile.txt"
  rm -rf "$WORK/load"
}

stage_staging() {  # issue 35: the first save's blocking part and the load, before/after megalaunch's levers
  rm -rf "$WORK/staging"
  timeout 170 "$PY" bench/staging_check.py --dir "$WORK/staging" --mode megatron --saves 2 --no-load --dd \
    --json "$OUT/staging_megatron.json" 2>&1 | grep -vE "warn|Warn" | tee "$OUT/staging.txt"
  timeout 170 "$PY" bench/staging_check.py --dir "$WORK/staging" --mode arena --saves 3 \
    --json "$OUT/staging_arena.json" 2>&1 | grep -vE "warn|Warn" | tee -a "$OUT/staging.txt"
  rm -rf "$WORK/staging"
}

stage_sft() {  # issue 26: tokens/s and MFU of SFT (from a converted 1B checkpoint) beside pre-training
  rm -rf "$WORK/sft"
  # shellcheck disable=SC2086
  "$PY" bench/sft_throughput.py --out "$WORK/sft" --attention "${ATTENTION:-sdpa}" ${SFT_ARGS:-} 2>&1 \
    | tee "$OUT/sft.txt" | grep -vE "warn|Warn" | tail -n 12
  cp "$WORK/sft/sft_throughput.json" "$OUT/" 2>/dev/null || true
  tar -czf "$OUT/sft_logs.tgz" -C "$WORK/sft" pretrain.log sft.log 2>/dev/null || true
  rm -rf "$WORK/sft"
}

stage_fp8() {  # issue 34: FP8 GEMMs without transformer-engine beside bf16: per layer, then llama3-1b end to end
  need_liger
  timeout "${FP8_GEMM_S:-120}" "$PY" bench/fp8.py --stage gemm --out "$OUT/fp8" 2>&1 | tee "$OUT/fp8_gemm.txt" \
    | grep -vE "warn|Warn" || true
  # shellcheck disable=SC2086
  timeout "${FP8_E2E_S:-330}" "$PY" bench/fp8.py --stage e2e --out "$WORK/fp8" ${FP8_E2E_ARGS:-} 2>&1 \
    | tee "$OUT/fp8_e2e.txt" | grep -v "^  {" || true
  cp "$WORK"/fp8/*.json "$OUT"/ 2>/dev/null || true
  tar -czf "$OUT/fp8_logs.tgz" -C "$WORK" --exclude runs fp8 2>/dev/null || true
}

stage_fp8loss() {  # issue 34: llama3-1b trained bf16 and fp8 side by side on a corpus with a known loss floor
  need_liger
  [ -f "$WORK/corpus/bigram.idx" ] || "$PY" bench/entropy_corpus.py --out "$WORK/corpus/bigram" --tokens 60000000
  # shellcheck disable=SC2086
  timeout "${FP8_LOSS_S:-560}" "$PY" bench/fp8.py --stage loss --data "$WORK/corpus/bigram" --seq 2048 --mb 4 \
    --gbs 8 --iters "${FP8_LOSS_ITERS:-400}" --cases bf16,fp8 --timeout 280 --out "$WORK/fp8loss" ${FP8_LOSS_ARGS:-} 2>&1 \
    | tee "$OUT/fp8_loss.txt" | grep -v "^  {" || true
  cp "$WORK"/fp8loss/*.json "$WORK"/fp8loss/*.jsonl "$WORK"/corpus/*.json "$OUT"/ 2>/dev/null || true
}

stage_fp8_8b() {  # issue 34: llama3-8b on all GPUs, bf16 beside fp8 in one layout (FP8_8B_SETS; default the H100 one)
  need_liger
  # shellcheck disable=SC2086
  timeout "${FP8_8B_S:-560}" "$PY" bench/fp8.py --stage e2e --recipe train/llama3-8b --per-case "$(nvidia-smi -L | wc -l)" \
    --seq 8192 --gbs "${FP8_8B_GBS:-32}" --iters "${FP8_8B_ITERS:-6}" --cases "${FP8_8B_CASES:-bf16,fp8}" \
    --sets "${FP8_8B_SETS:-parallel.tensor_model_parallel_size=2,parallel.sequence_parallel=true}" --timeout 270 \
    --out "$WORK/fp8_8b" 2>&1 | tee -a "$OUT/fp8_8b.txt" | grep -v "^  {" || true
  cp "$WORK/fp8_8b/fp8_e2e.json" "$OUT/fp8_8b-$(date +%H%M%S).json" 2>/dev/null || true
  tar -czf "$OUT/fp8_8b_logs-$(date +%H%M%S).tgz" -C "$WORK" --exclude runs fp8_8b 2>/dev/null || true
}

stage_fsdp_probe() {  # issue 34: Megatron-FSDP (ZeRO-3, TP 1) through megatron_args, bf16 and fp8, before it is a setting
  need_liger
  # shellcheck disable=SC2086
  BENCH_MAX_CONNECTIONS=8 timeout "${FSDP_S:-400}" "$PY" bench/fp8.py --stage e2e --recipe train/llama3-8b \
    --per-case "$(nvidia-smi -L | wc -l)" --seq 8192 --gbs 32 --iters "${FSDP_ITERS:-6}" --cases "${FSDP_CASES:-bf16,fp8}" \
    --sets "megatron_args.use-megatron-fsdp=true,megatron_args.data-parallel-sharding-strategy=optim_grads_params,megatron_args.ckpt-format=fsdp_dtensor" \
    --timeout 300 --out "$WORK/fsdp" 2>&1 | tee -a "$OUT/fsdp.txt" | grep -v "^  {" || true
  cp "$WORK/fsdp/fp8_e2e.json" "$OUT/fsdp-$(date +%H%M%S).json" 2>/dev/null || true
  tar -czf "$OUT/fsdp_logs-$(date +%H%M%S).tgz" -C "$WORK" --exclude runs fsdp 2>/dev/null || true
}

stage_fsdptests() {  # issue 34: Megatron-FSDP's GPU tests, bf16 on GPUs 0-1 beside fp8 on 2-3: exact resume, fsdp_dtensor saves
  local k pids=()
  for k in bf16 fp8; do
    local devs=0,1
    [ "$k" = fp8 ] && devs=2,3
    CUDA_VISIBLE_DEVICES=$devs timeout "${FSDP_TESTS_S:-420}" "$PY" -m pytest -m gpu tests/gpu/test_fsdp_gpu.py -k "$k" -s -q \
      -p no:cacheprovider --basetemp="$OUT/pytest-fsdp-$k" --junitxml="$OUT/fsdp-tests-$k.xml" > "$OUT/fsdp-tests-$k.txt" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}" || true
  grep -hE "^\[|passed|failed|Error" "$OUT"/fsdp-tests-*.txt || true
}

stage_fsdp_e2e() {  # issue 34: parallel.data_sharding=optimizer_grads_params, bf16 beside fp8 (FSDP_RECIPE, FSDP_PER_CASE GPUs each)
  need_liger
  BENCH_MAX_CONNECTIONS=8 timeout "${FSDP_S:-420}" "$PY" bench/fp8.py --stage e2e --recipe "${FSDP_RECIPE:-train/llama3-8b}" \
    --per-case "${FSDP_PER_CASE:-$(nvidia-smi -L | wc -l)}" --seq "${FSDP_SEQ:-8192}" --gbs "${FSDP_GBS:-32}" --mb "${FSDP_MB:-1}" \
    --iters "${FSDP_ITERS:-6}" --cases "${FSDP_CASES:-bf16,fp8}" --sets "parallel.data_sharding=optimizer_grads_params" \
    --timeout 300 --out "$WORK/fsdp_e2e" 2>&1 | tee -a "$OUT/fsdp_e2e.txt" | grep -v "^  {" || true
  cp "$WORK/fsdp_e2e/fp8_e2e.json" "$OUT/fsdp_e2e-$(date +%H%M%S).json" 2>/dev/null || true
}

stage_fp8tests() {  # issue 34: the GPU tests of fp8: Triton casts bit for bit, exact resume (tensorwise, rowwise)
  timeout "${FP8_TESTS_S:-500}" "$PY" -m pytest -m gpu tests/gpu/test_fp8_gpu.py -s -q -p no:cacheprovider \
    --basetemp="$OUT/pytest-fp8" --junitxml="$OUT/fp8-tests.xml" 2>&1 | tee "$OUT/fp8-tests.txt" \
    | grep -E "^\[|passed|failed|error|Error" || true
}

stage_moe() {  # issue 48: the experts on torch's grouped GEMM beside Megatron's SequentialMLP, one GPU, same seed and data
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=${MOE_GPU:-0} timeout "${MOE_S:-560}" "$PY" bench/moe.py --out "$WORK/moe" ${MOE_ARGS:-} 2>&1 \
    | tee "$OUT/moe.txt" | grep -v "^  {" || true
  cp "$WORK/moe/moe.json" "$OUT/" 2>/dev/null || true
  tar -czf "$OUT/moe_logs.tgz" -C "$WORK" --exclude runs moe 2>/dev/null || true
}

stage_moe_ops() {  # issue 48: the way back's gather + sum and SwiGLU x probs, eager beside compiled; then their tests
  need_liger
  timeout "${MOE_OPS_S:-150}" "$PY" bench/moe_ops.py --out "$OUT" 2>&1 | tee "$OUT/moe_ops.txt" | grep -vE "warn|Warn" || true
  timeout "${MOE_OPS_TESTS_S:-150}" "$PY" -m pytest -m gpu tests/gpu/test_moe_fused_gpu.py -s -q -p no:cacheprovider \
    --basetemp="$OUT/pytest-moe" 2>&1 | tee "$OUT/moe-tests.txt" | grep -E "^\[|passed|failed|error|Error|ms" || true
}

# MOE_SWEEP: runs separated by ";", each "recipe|global batch|sets (comma-separated)|bench/kernels.py cases"
MOE_SWEEP_DEFAULT="train/moe-3b|64||auto-mb16,auto-mb8,auto-mb4;train/mixtral-8x7b|16|model.num_layers=2|auto-mb1,auto-mb2"
stage_moe_sweep() {  # issue 48: MoE recipes end to end at several micro-batches, seq 4096 (the speed model's points)
  need_liger
  local run recipe gbs sets cases i=0
  IFS=';' read -ra runs <<< "${MOE_SWEEP:-$MOE_SWEEP_DEFAULT}"
  for run in "${runs[@]}"; do
    IFS='|' read -r recipe gbs sets cases <<< "$run"
    i=$((i + 1))
    timeout "${MOE_SWEEP_S:-300}" "$PY" bench/kernels.py --stage e2e --recipe "$recipe" --seq 4096 --gbs "$gbs" \
      --sets "$sets" --cases "$cases" --iters "${MOE_SWEEP_ITERS:-5}" --timeout "${MOE_SWEEP_S:-300}" \
      --out "$WORK/moe_sweep/$i" 2>&1 | tee "$OUT/moe_sweep_$i.txt" | grep -v "^  {" || true
    cp "$WORK/moe_sweep/$i/kernels_e2e.json" "$OUT/moe_sweep_$i.json" 2>/dev/null || true
  done
}

stage_post_training() {  # issue 51: DPO's tokens/s beside SFT's (same model, sequence length, tokens per step) and the reference stage's
  rm -rf "$WORK/post_training"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=${PT_GPU:-0} timeout "${PT_S:-560}" "$PY" bench/post_training.py --out "$WORK/post_training" \
    --attention "${ATTENTION:-sdpa}" ${PT_ARGS:-} 2>&1 | tee "$OUT/post_training.txt" | grep -vE "warn|Warn" | tail -n 8
  cp "$WORK/post_training/post_training.json" "$OUT/" 2>/dev/null || true
  tar -czf "$OUT/post_training_logs.tgz" -C "$WORK/post_training" sft.log dpo.log 2>/dev/null || true
  rm -rf "$WORK/post_training"
}

[ $# -gt 0 ] || set -- all
for stage in "$@"; do
  case "$stage" in
    setup|tests|throughput|save|eval|speed|plan|storage|profile|load|staging|kernels|mfu8b|sft|fp8|fp8_8b|fp8loss|fp8tests|fsdp_probe|fsdptests|fsdp_e2e|moe|moe_ops|moe_sweep|post_training) echo "== $stage ($(date +%T))"; "stage_$stage" ;;
    all) for s in setup tests throughput save; do echo "== $s ($(date +%T))"; "stage_$s"; done ;;
    *) echo "unknown stage $stage (setup, tests, throughput, save, eval, speed, plan, storage, profile, load, staging, kernels, mfu8b, sft, fp8, fp8_8b, fp8loss, fp8tests, fsdp_probe, fsdptests, fsdp_e2e, moe, moe_ops, moe_sweep, post_training, all)" >&2; exit 2 ;;
  esac
done
# Run directories with checkpoints are large: keep only logs and results in $OUT.
find "$OUT" -type d -name checkpoints -prune -exec rm -rf {} + 2>/dev/null || true
echo "results in $OUT"
