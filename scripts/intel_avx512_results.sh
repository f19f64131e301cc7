#!/usr/bin/env bash
# The README's figures for a CPU with AVX-512 and no AVX512-BF16 (a 2-core Intel Xeon, Ice Lake):
# the bench prompts on the AVX-512 product path against the AVX2 one, SmolLM2 bfloat16, 2 threads.
# Outputs in results/intel_avx512/. One run each.
set -e
cd "$(dirname "$0")/.."
out=results/intel_avx512
mkdir -p "$out"
for P in avx2 avx512; do
  SELFSPEC_GEMV=$P .venv/bin/selfspec bench --method hybrid,feature,lookup -g 1 --threads 2 -n 64 --no-hf \
    --markdown "$out/bench_g1_$P.md" > "$out/bench_g1_$P.out" 2>&1
  SELFSPEC_GEMV=$P .venv/bin/selfspec bench --method hybrid -g 3 --threads 2 -n 64 --no-hf \
    --markdown "$out/bench_g3_$P.md" > "$out/bench_g3_$P.out" 2>&1
done
# What a fresh install runs here (the shipped choice, which now names the avx512 path), idle and
# beside one busy process (no --threads: selfspec picks the free cores).
.venv/bin/selfspec bench --method auto --threads 2 -n 64 --no-hf --markdown "$out/bench_auto.md" > "$out/bench_auto.out" 2>&1
python3 -c "while True: pass" &
busy=$!
.venv/bin/selfspec bench --method auto -n 64 --no-hf --markdown "$out/bench_auto_busy.md" > "$out/bench_auto_busy.out" 2>&1 || true
kill $busy
