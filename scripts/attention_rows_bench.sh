#!/usr/bin/env bash
# End to end, the rows of a verify attending together (SELFSPEC_ATTN_ROWS=4, the AVX-512 path's
# default) against each row alone (1): the shipped hybrid (γ ≤ 3) and hybrid γ = 1 beside AR,
# interleaved per prompt within each run (feature_policy_sweep.py), on the 6 bench prompts × 64
# tokens, twice 2 repeats each, the two settings alternating.
cd "$(dirname "$0")/.."
for i in 1 2; do
  for R in 4 1; do
    echo "SELFSPEC_ATTN_ROWS=$R (run $i)"
    SELFSPEC_ATTN_ROWS=$R .venv/bin/python scripts/feature_policy_sweep.py --bench --policies hybrid:3:2,hybrid:1:2 --repeats 2 2>&1 | grep -v Warning
  done
done
