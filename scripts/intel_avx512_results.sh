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
# int8 weights on the avx512 path: the shipped int8 hybrid (γ ≤ 2) beside AR.
.venv/bin/selfspec bench --dtype int8 --method hybrid -g 2 --threads 2 -n 64 --no-hf --markdown "$out/bench_int8_hybrid_g2.md" > "$out/bench_int8_hybrid_g2.out" 2>&1
# The step's costs (v(n), c(k)) and the end-to-end A/B of rows attending together.
.venv/bin/python scripts/step_costs.py --dtype bfloat16 int8 --mode eager --repeats 9 --markdown "$out/step_costs.md" > "$out/step_costs.out" 2>&1
bash scripts/attention_rows_bench.sh > "$out/attention_rows_bench.out" 2>&1
# The headline: the shipped auto and γ = 1 drafts, 3 interleaved rounds (bench --repeats).
.venv/bin/selfspec bench --method auto,hybrid,feature,lookup -g 1 --threads 2 -n 64 --no-hf --repeats 3 --markdown "$out/bench_repeats3.md" > "$out/bench_repeats3.out" 2>&1
# What tune picks on this CPU (its own profile dir, not the user's), the head's two siblings, and sampling.
mkdir -p /tmp/ssprof_avx512
(cd /tmp && SELFSPEC_PROFILES=/tmp/ssprof_avx512 "$OLDPWD/.venv/bin/selfspec" tune -g 3 --threads 2) > "$out/tune.out" 2>&1
.venv/bin/selfspec bench --method auto --siblings 2 --threads 2 -n 64 --no-hf --repeats 2 --markdown "$out/bench_auto_siblings.md" > "$out/bench_auto_siblings.out" 2>&1
for T in 0.7 1.0; do
  .venv/bin/selfspec bench --method auto --threads 2 -n 64 --no-hf -t $T --markdown "$out/bench_auto_t$T.md" > "$out/bench_auto_t$T.out" 2>&1
done
