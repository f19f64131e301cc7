#!/usr/bin/env bash
# The AVX2-only AMD EPYC's figures (README, "A fourth CPU"), in the order they were measured:
# bench_bf16 before selfspec.wide_product (the prefill's bfloat16 GEMMs emulated), bench_bf16_wide
# after it, bench_bf16_evenodd after the AVX2 products' one-load bfloat16 widening.
cd "$(dirname "$0")/.."
R=results/amd_avx2
mkdir -p $R
(lscpu; grep -m1 flags /proc/cpuinfo) > $R/cpu.txt
.venv/bin/python scripts/step_costs.py --dtype bfloat16 float32 int8 --mode eager --repeats 5 --markdown $R/step_costs.md
B=".venv/bin/selfspec bench --threads 2 -n 64 --no-hf"
$B --dtype bfloat16 --method auto,feature,lookup -g 1 --json $R/bench_bf16.json --markdown $R/bench_bf16.md
$B --dtype float32 --method hybrid,feature,lookup -g 1 --json $R/bench_f32.json --markdown $R/bench_f32.md
.venv/bin/python scripts/kernel_timings.py --only products fused --repeats 7 > $R/kernel_timings.out
.venv/bin/python scripts/wide_product_timing.py > $R/wide_product_timing.out
$B --dtype bfloat16 --method auto,feature,lookup -g 1 --json $R/bench_bf16_wide.json --markdown $R/bench_bf16_wide.md
# The weight prefetch in the AVX2 products, off and at three distances, interleaved twice:
for i in 1 2; do for D in 0 512 1024 2048; do
  echo "SELFSPEC_PREFETCH=$D (run $i)"
  SELFSPEC_PREFETCH=$D .venv/bin/python scripts/kernel_timings.py --threads 2 --repeats 5 --only products 2>&1 | grep -E "streamed|row\(s\):" | grep -v compute
done; done > $R/prefetch_ab.out
# evenodd_ab.out: kernel_timings.py --only products --repeats 5 with the one-load widening ("after")
# and kernels/product.h as it was before it ("before"), interleaved twice.
.venv/bin/python scripts/step_costs.py --dtype bfloat16 --mode eager --repeats 5 --markdown $R/step_costs_evenodd.md
$B --dtype bfloat16 --method hybrid,feature,lookup -g 1 --json $R/bench_bf16_evenodd.json --markdown $R/bench_bf16_evenodd.md
# Do the other shipped choices still beat AR here? int4 (hybrid) and Gemma 3 (lookup):
$B --dtype int4 --method auto -g 1 --json $R/bench_int4_auto.json --markdown $R/bench_int4_auto.md
$B --model gemma3 --dtype bfloat16 --method auto -g 3 --json $R/bench_gemma3_auto.json --markdown $R/bench_gemma3_auto.md
# What tune picks here (its 6 calibration prompts; a scratch profile dir), then that choice on the bench prompts:
SELFSPEC_PROFILES=/tmp/ssprof .venv/bin/selfspec tune -g 3 --threads 2 > $R/tune.out 2>&1
$B --dtype bfloat16 --method hybrid -g 2 --json $R/bench_bf16_hybrid_g2.json --markdown $R/bench_bf16_hybrid_g2.md
# A busy neighbour: one python busy loop beside a bench with no --threads (selfspec picks the free cores).
python3 -c "while True: pass" & BUSY=$!
.venv/bin/selfspec bench -n 64 --no-hf --method auto --json $R/bench_auto_busy.json --markdown $R/bench_auto_busy.md
kill $BUSY
