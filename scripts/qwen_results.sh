#!/usr/bin/env bash
# The README's Qwen2.5-Coder figures: tune and bench, chat and code prompts, one model per call.
#   BENCH_K=21 bash scripts/qwen_results.sh qwen2.5-coder-0.5b results/qwen_coder_05b [extra selfspec flags]
# BENCH_K: the exit layer bench's early exit and its family run at (default: bench's 3/4 of depth).
# Needs the extra (bash scripts/setup.sh --with-qwen). Every command writes its table under OUT;
# tune writes its profile there too (not into the cache), so nothing here changes what auto runs.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1 out=$2
shift 2
mkdir -p "$out"
run() { echo "+ $*" >&2; "$@"; }
for set in chat code; do
  per=1; [ "$set" = code ] && per=2
  run .venv/bin/selfspec tune --model "$model" --prompts $set --per-category $per -n 48 "$@" \
    --output "$out/tune_$set.profile.json" --json "$out/tune_$set.json" --plots "$out/plots_$set" \
    > "$out/tune_$set.out" 2> "$out/tune_$set.err"
done
for set in chat code; do
  per=1; [ "$set" = code ] && per=3
  run .venv/bin/selfspec bench --model "$model" --prompts $set --per-category $per -n 48 --method all \
    ${BENCH_K:+-k $BENCH_K} "$@" \
    --json "$out/bench_$set.json" --markdown "$out/bench_$set.md" > "$out/bench_$set.out" 2> "$out/bench_$set.err"
done
