#!/usr/bin/env bash
# Every figure of the README's int4 and attention-fold rows (SmolLM2, 2 threads): the step costs
# per dtype and mode, then bench against llama.cpp (needs llama-cpp-python) and transformers.
set -x
cd "$(dirname "$0")/.."
R=results/int4
B=".venv/bin/selfspec bench --threads 2 -n 64"
.venv/bin/python scripts/step_costs.py --dtype float32 bfloat16 int8 int4 --mode general eager compiled exact --markdown $R/step_costs.md
for flags in "--dtype int4 --exact" "--dtype int4 --no-exact" "--dtype int4 --exact --compile" "--dtype int8 --exact" "--dtype bfloat16 --exact"; do
  name=$(echo "$flags" | sed 's/--dtype //; s/ --/_/g; s/-//g')
  $B --method lookup -g 3 --no-hf --llamacpp $flags --json $R/bench_llamacpp_$name.json --markdown $R/bench_llamacpp_$name.md
done
$B --method lookup --method early-exit -k 28 -g 3 --dtype bfloat16 --json $R/bench_hf_bfloat16_exact.json --markdown $R/bench_hf_bfloat16_exact.md
$B --method lookup -g 3 --dtype float32 --json $R/bench_hf_float32.json --markdown $R/bench_hf_float32.md
