#!/usr/bin/env bash
# The README's Qwen2.5-Coder figures: tune and bench on chat and code prompts, one model per call.
#   BENCH_K=21 bash scripts/qwen_results.sh qwen2.5-coder-0.5b results/qwen_coder_05b --threads 2
#   BENCH_K=25 N=32 CODE_PROMPTS=2 TUNE_SETS=code bash scripts/qwen_results.sh qwen2.5-coder-1.5b results/qwen_coder_15b --threads 2
# Environment: BENCH_K, the exit layer bench's early exit and hybrid run at (default: bench's 3/4
# of depth); N, new tokens per prompt (48); CODE_PROMPTS, code prompts per category in bench (3,
# of 4; tune uses 2 of the held-out set); TUNE_SETS, which sets to tune ("chat code").
# Needs the extra (bash scripts/setup.sh --with-qwen). tune writes its profile under OUT, not into
# the cache, so nothing here changes what auto runs. Bench's γ is 3: exact mode's most.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1 out=$2
shift 2
n=${N:-48}
mkdir -p "$out"
run() { echo "+ $*" >&2; "$@"; }
for set in ${TUNE_SETS:-chat code}; do
  per=1; [ "$set" = code ] && per=2
  run .venv/bin/selfspec tune --model "$model" --prompts $set --per-category $per -n $n "$@" \
    --output "$out/tune_$set.profile.json" --json "$out/tune_$set.json" --plots "$out/plots_$set" \
    > "$out/tune_$set.out" 2> "$out/tune_$set.err"
done
for set in code chat; do
  per=1; [ "$set" = code ] && per=${CODE_PROMPTS:-3}
  run .venv/bin/selfspec bench --model "$model" --prompts $set --per-category $per -n $n --method all -g 3 \
    ${BENCH_K:+-k $BENCH_K} "$@" \
    --json "$out/bench_$set.json" --markdown "$out/bench_$set.md" > "$out/bench_$set.out" 2> "$out/bench_$set.err"
done
