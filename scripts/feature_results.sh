#!/usr/bin/env bash
# Every figure of the README's feature-head section (SmolLM2, bfloat16 exact, 2 threads): make the
# head (the command that made the shipped file), bench it against AR and lookup, tune, sampling.
# Run on a quiet machine: every figure but the α table is a timing.
set -x
cd "$(dirname "$0")/.."
R=results/feature
mkdir -p $R/sampling
# The head: ~27 min of decoding (438 prompts, greedy + 1 sampled continuation each) and ~8 min of training.
.venv/bin/python scripts/calibration_prompts.py ../shared/bench/spec_bench_questions.jsonl -o /tmp/feature_prompts.jsonl
.venv/bin/selfspec calibrate --head feature --prompts /tmp/feature_prompts.jsonl --num-prompts 438 -n 128 --samples 1 \
  --threads 2 --output $R/head > $R/calibrate.out 2> $R/calibrate.err
cp $R/head/*.feature.safetensors selfspec/data/heads/   # what the package ships
B=".venv/bin/selfspec bench --threads 2 -n 64 --no-hf"
$B --method lookup,feature,hybrid -g 1 --json $R/bench_g1.json --markdown $R/bench_g1.md
$B --method feature,hybrid -g 2 --json $R/bench_g2.json --markdown $R/bench_g2.md
$B --method feature,hybrid -g 3 --json $R/bench_g3.json --markdown $R/bench_g3.md
# bench_hybrid_g1.md was measured with hybrid falling back to the feature head (0.99x), a change not kept:
# hybrid still falls back to early exit, so this line now measures that instead.
$B --method lookup,feature,hybrid -g 1 --json $R/bench_hybrid_g1.json --markdown $R/bench_hybrid_g1.md
$B --method feature -g 1 --draft-vocab 4096 --json $R/bench_v4096_g1.json --markdown $R/bench_v4096_g1.md
.venv/bin/selfspec tune --threads 2 --output $R/tune_profile.json --plots $R/tune_plots --json $R/tune.json > $R/tune.out 2>&1
for T in 0 0.7 1.0; do
  $B --method auto --temperature $T --seed 0 --json $R/sampling/auto_t$T.json --markdown $R/sampling/auto_t$T.md
done
# After the subset sampler (a pruned draft head's q computed over its own tokens), T = 1.0 twice:
for T in 0.7 1.0; do
  $B --method auto --temperature $T --seed 0 --json $R/sampling/auto_t${T}_subset_q.json --markdown $R/sampling/auto_t${T}_subset_q.md
done
$B --method auto --temperature 1.0 --seed 0 --json $R/sampling/auto_t1.0_subset_q_run2.json --markdown $R/sampling/auto_t1.0_subset_q_run2.md
# A busy neighbour: one python busy loop beside a bench with no --threads (selfspec picks the free cores).
.venv/bin/python -c "while True: pass" & BUSY=$!
.venv/bin/selfspec bench -n 64 --method auto --no-hf --json $R/bench_auto_busy.json --markdown $R/bench_auto_busy.md
kill $BUSY
# A later stop (Intel Xeon without AMX; results/intel_noamx/): 776 distinct synthetic chat prompts as
# training-only data, a 2x head on the same data, and EAGLE-3's fused inputs (training side only).
N=results/intel_noamx
.venv/bin/python scripts/synthetic_prompts.py -o /tmp/synthetic.jsonl -n 800
C=".venv/bin/selfspec calibrate --head feature --prompts /tmp/feature_prompts.jsonl --num-prompts 438 -n 128 --threads 2"
SELFSPEC_PROFILES=/tmp/feature_profiles $C --extra-prompts /tmp/synthetic.jsonl --data /tmp/fdata_synth.pt \
  --output /tmp/synth_head > $N/calibrate_synthetic.out
SELFSPEC_PROFILES=/tmp/feature_profiles $C --extra-prompts /tmp/synthetic.jsonl --data /tmp/fdata_synth.pt \
  --heads 9 --width 1536 --output /tmp/big_head > $N/calibrate_synthetic_big.out
.venv/bin/python scripts/feature_multilayer.py /tmp/fdata_synth.pt --layers 3 15 > $N/feature_multilayer.out
