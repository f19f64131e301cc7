#!/usr/bin/env bash
# A short, real LayerSkip run (`selfspec train`) on the bundled SmolLM2-135M-Instruct, on the CPU in
# float32: the model answers 40 bundled training prompts, 32 of them become its training data and 8
# are held out; 150 steps of 2 windows × 64 tokens. Every 25 steps it prints the held-out
# cross-entropy at exits 8, 15 and 22 (and of the full model), then α before and after.
# The checkpoint goes to $1 (default: a fresh directory under /tmp), never into the repository.
#
#   scripts/train_example.sh | tee results/train_smollm2.out
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d /tmp/selfspec-layerskip-smollm2.XXXXXX)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # the CPU is shared: one thread avoids oversubscription
exec .venv/bin/python -m selfspec.cli train --model smollm2 --dtype float32 --out "$out" \
    --num-prompts 40 --max-new-tokens 48 --holdout 0.2 \
    --steps 150 --batch-size 2 --seq-len 64 --lr 1e-4 --p-max 0.1 --curriculum rotational --rotation 8 \
    --exit-layers 8,15,22 --eval-every 25 --seed 0
