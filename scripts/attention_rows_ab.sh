#!/usr/bin/env bash
# A verify's rows attending together (kernels/layer.h, attend16_rows) against one (row, head) per
# task: kernel_timings.py's fused step with SELFSPEC_ATTN_ROWS=1 (each row alone, as before), 2 and
# 4 rows per task, interleaved twice, so drift hits all alike (each value builds its own library).
cd "$(dirname "$0")/.."
for i in 1 2; do
  for R in 1 4 2; do
    echo "SELFSPEC_ATTN_ROWS=$R (run $i)"
    SELFSPEC_ATTN_ROWS=$R .venv/bin/python scripts/kernel_timings.py --threads 2 --repeats 11 --only fused 2>&1 | grep 'fused'
  done
done
