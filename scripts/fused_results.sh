#!/usr/bin/env bash
# Every figure of the README's fused-layer tables (SmolLM2 unless named, 2 threads): step costs
# per dtype, then bench against transformers and llama.cpp (those rows need llama-cpp-python),
# exact and default modes, a busy neighbour, Gemma 3, Qwen2.5-Coder 0.5B, and tune. Run on a
# quiet machine: every figure is a timing.
set -x
cd "$(dirname "$0")/.."
R=results/fused
mkdir -p $R
B=".venv/bin/selfspec bench --threads 2 -n 64"
.venv/bin/python scripts/step_costs.py --dtype bfloat16 int8 float32 int4 --mode eager exact --repeats 9 --markdown $R/step_costs.md
$B --method lookup --method early-exit -k 28 -g 3 --dtype bfloat16 --exact --json $R/bench_bf16_exact.json --markdown $R/bench_bf16_exact.md
$B --method lookup -g 3 --dtype bfloat16 --no-exact --no-hf --json $R/bench_bf16_noexact.json --markdown $R/bench_bf16_noexact.md
$B --method lookup -g 3 --dtype float32 --json $R/bench_float32.json --markdown $R/bench_float32.md
$B --method lookup -g 1 --no-hf --json $R/bench_bf16_lookup_g1.json --markdown $R/bench_bf16_lookup_g1.md
for flags in "--dtype int8 --no-exact" "--dtype bfloat16 --exact" "--dtype int4 --exact"; do
  name=$(echo "$flags" | sed 's/--dtype //; s/ --/_/g; s/-//g')
  $B --method lookup -g 3 --no-hf --llamacpp $flags --json $R/bench_llamacpp_$name.json --markdown $R/bench_llamacpp_$name.md
done
# (bench_llamacpp_int8_noexact.md predates the int8 prefill change; _prefill.md is the same command after it.)
$B --model gemma3 --method lookup -g 3 --json $R/bench_gemma3.json --markdown $R/bench_gemma3.md
.venv/bin/selfspec bench --threads 2 --model qwen2.5-coder-0.5b --prompts code --per-category 3 -n 48 --method lookup -g 3 \
  --json $R/bench_qwen05_code.json --markdown $R/bench_qwen05_code.md
# A busy neighbour: one python busy loop beside a bench with no --threads (selfspec picks the free cores).
.venv/bin/python -c "while True: pass" & BUSY=$!  # the venv's interpreter itself, so $! is the loop (a pyenv shim would not be)
.venv/bin/selfspec bench -n 64 --method lookup -g 3 --no-hf --json $R/bench_bf16_exact_busy.json --markdown $R/bench_bf16_exact_busy.md
kill $BUSY
.venv/bin/selfspec tune --threads 2 --output $R/tune_profile.json --plots $R/tune_plots --json $R/tune.json > $R/tune.out 2>&1
.venv/bin/selfspec tune --threads 2 --dtype int8 --output $R/tune_int8_profile.json --plots $R/tune_int8_plots --json $R/tune_int8.json > $R/tune_int8.out 2>&1
.venv/bin/selfspec tune --threads 2 --model gemma3 --output $R/tune_gemma3_profile.json --plots $R/tune_gemma3_plots --json $R/tune_gemma3.json > $R/tune_gemma3.out 2>&1
mkdir -p results/bench_smollm2_fused
.venv/bin/selfspec bench --method all -g 3 --per-category 1 -n 64 --threads 2 --json results/bench_smollm2_fused/bench.json --markdown results/bench_smollm2_fused/bench.md
.venv/bin/python scripts/readme_bench.py results/bench_smollm2_fused/bench.md
mkdir -p $R/sampling
for T in 0 0.7 1.0; do
  $B --method auto --no-hf --temperature $T --seed 0 --json $R/sampling/auto_t$T.json --markdown $R/sampling/auto_t$T.md
done
.venv/bin/selfspec bench --threads 2 --model qwen2.5-coder-1.5b --prompts code --per-category 2 -n 48 --method lookup -g 3 --no-hf \
  --json $R/bench_qwen15_code.json --markdown $R/bench_qwen15_code.md
.venv/bin/python -c "while True: pass" & BUSY=$!  # the venv's interpreter itself, so $! is the loop (a pyenv shim would not be)
.venv/bin/selfspec bench -n 64 --method auto --no-hf --json $R/bench_bf16_auto_busy.json --markdown $R/bench_bf16_auto_busy.md
kill $BUSY
for i in 1 2 3; do .venv/bin/python scripts/kernel_timings.py > $R/kernel_timings_$i.out 2>&1; done
.venv/bin/python scripts/lookup_replay.py > $R/lookup_replay.out 2>&1
