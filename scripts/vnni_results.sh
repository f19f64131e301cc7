#!/usr/bin/env bash
# The README's figures for int8 on a CPU with AVX512-VNNI and no AVX512-BF16 (a 2-core Intel Xeon,
# Ice Lake): the integer products against the float-FMA ones (SELFSPEC_VNNI=0), SmolLM2, 2 threads.
# Outputs in results/intel_avx512/. One run each unless rounds are named.
set -e
cd "$(dirname "$0")/.."
out=results/intel_avx512
mkdir -p "$out"
.venv/bin/python scripts/vnni_ab.py --rounds 9 > "$out/vnni_ab.out" 2>&1
# The step's costs, the two kernels alternated three times (separate processes: each builds one).
for i in 1 2 3; do
  for V in 1 0; do
    echo "SELFSPEC_VNNI=$V (run $i)"
    SELFSPEC_VNNI=$V .venv/bin/python scripts/step_costs.py --dtype int8 --mode eager --repeats 9 2>&1 | grep '^dtype'
  done
done > "$out/vnni_step_costs.out"
# What a fresh install runs in int8 (the shipped int8 choice) beside AR, 3 interleaved rounds, then
# the same on the float-FMA kernel, and beside one busy process (no --threads).
.venv/bin/selfspec bench --dtype int8 --method auto,hybrid -g 3 --threads 2 -n 64 --no-hf --repeats 3 \
  --markdown "$out/bench_int8_vnni.md" > "$out/bench_int8_vnni.out" 2>&1
SELFSPEC_VNNI=0 .venv/bin/selfspec bench --dtype int8 --method auto --threads 2 -n 64 --no-hf --repeats 3 \
  --markdown "$out/bench_int8_fma.md" > "$out/bench_int8_fma.out" 2>&1
python3 -c "while True: pass" &
busy=$!
.venv/bin/selfspec bench --dtype int8 --method auto -n 64 --no-hf --markdown "$out/bench_int8_vnni_busy.md" \
  > "$out/bench_int8_vnni_busy.out" 2>&1 || true
kill $busy
# bfloat16 and int8 AR and auto in one run each, for the absolute figures side by side.
.venv/bin/selfspec bench --method auto --threads 2 -n 64 --no-hf --repeats 2 \
  --markdown "$out/bench_bf16_beside_int8.md" > "$out/bench_bf16_beside_int8.out" 2>&1
# The kernel's arithmetic alone (a matrix held in cache, one thread), both builds, twice.
for i in 1 2; do
  for V in "-mavx512bw -mavx512vnni -DSELFSPEC_VNNI" ""; do
    g++ -O3 -std=c++17 -mavx2 -mfma -ffp-contract=off -fopenmp -mavx512f -DSELFSPEC_AVX512 $V -I selfspec/kernels \
      -o /tmp/vnni_timing scripts/vnni_timing.cpp && /tmp/vnni_timing
  done
done > "$out/vnni_timing.out"
# Why x is int16 and not int8: greedy and teacher-forced agreement with float32 of int8 weights
# with x in bfloat16, in int8 (one scale a row, or one per block) and in int16 (one scale a row).
.venv/bin/python scripts/activation_quant_quality.py > "$out/activation_quant_quality.out" 2>&1
