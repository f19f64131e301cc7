#!/usr/bin/env bash
# Every figure of the README's lean-step tables with the one-row product kernel (SmolLM2, 2
# threads): step costs per dtype and mode, then bench against transformers and llama.cpp (the
# llama.cpp rows need llama-cpp-python). Run on a quiet machine: every figure is a timing.
set -x
cd "$(dirname "$0")/.."
R=results/gemv
mkdir -p $R
B=".venv/bin/selfspec bench --threads 2 -n 64"
.venv/bin/python scripts/step_costs.py --dtype float32 bfloat16 int8 int4 --mode general eager compiled exact --markdown $R/step_costs.md
$B --method lookup --method early-exit -k 28 -g 3 --dtype bfloat16 --exact --json $R/bench_bf16_exact.json --markdown $R/bench_bf16_exact.md
$B --method lookup --method early-exit -k 28 -g 3 --dtype bfloat16 --no-exact --no-hf --json $R/bench_bf16.json --markdown $R/bench_bf16.md
for flags in "--dtype int4 --exact" "--dtype int8 --exact" "--dtype int8 --no-exact" "--dtype bfloat16 --exact"; do
  name=$(echo "$flags" | sed 's/--dtype //; s/ --/_/g; s/-//g')
  $B --method lookup -g 3 --no-hf --llamacpp $flags --json $R/bench_llamacpp_$name.json --markdown $R/bench_llamacpp_$name.md
done
$B --method lookup -g 3 --dtype float32 --json $R/bench_float32.json --markdown $R/bench_float32.md
