#!/usr/bin/env bash
# The weight prefetch in the bfloat16 pair products (kernels/product.h, on by default on Intel CPUs):
# kernel_timings.py with it off and on, interleaved three times, so drift hits both alike.
cd "$(dirname "$0")/.."
for i in 1 2 3; do
  for D in 0 1024; do
    echo "SELFSPEC_PREFETCH=$D (run $i)"
    SELFSPEC_PREFETCH=$D .venv/bin/python scripts/kernel_timings.py --threads 2 --repeats 11 2>&1 | sed -n '2,12p'
  done
done
