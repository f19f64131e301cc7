#!/usr/bin/env bash
# The AVX-512 product path (kernels/product.h, rows over Vec<16>; the default on CPUs with AVX-512 and no
# AVX512-BF16) against the AVX2 one it replaces there: kernel_timings.py's products and fused step
# under SELFSPEC_GEMV=avx2 and avx512, interleaved three times, so drift hits both alike.
cd "$(dirname "$0")/.."
for i in 1 2 3; do
  for P in avx2 avx512; do
    echo "SELFSPEC_GEMV=$P (run $i)"
    SELFSPEC_GEMV=$P .venv/bin/python scripts/kernel_timings.py --threads 2 --repeats 11 --only products fused 2>&1 | grep -v '^compute roof'
  done
done
