"""A prefill's product in bfloat16 on this CPU: PyTorch's bfloat16 GEMM against the float32 GEMM
and against selfspec.wide_product's bfloat16-through-float32 (weights widened per call), 700 rows
of SmolLM2's gate/up (3072 x 576), plus causal attention and an elementwise op for scale.

    .venv/bin/python scripts/wide_product_timing.py [--threads 2] [--rows 700]

On CPUs without native bfloat16 (AVX2 only) PyTorch's bfloat16 GEMM is emulated; see README,
"A fourth CPU". Means of 5 after one warm-up; one run is one machine's state.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from selfspec import gemv


def ms(f, n: int = 5) -> float:
    f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=700)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.rows
    print(f"native bfloat16: {gemv.native_bfloat16()}, {args.threads} threads, {n} rows, torch {torch.__version__}")
    for dt in (torch.bfloat16, torch.float32):
        x, w = torch.randn(n, 576, dtype=dt), torch.randn(3072, 576, dtype=dt)
        q, k = torch.randn(1, 9, n, 64, dtype=dt), torch.randn(1, 3, n, 64, dtype=dt)
        print(f"{dt}: gate/up GEMM {ms(lambda: F.linear(x, w)):.2f} ms, causal attention "
              f"{ms(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)):.2f} ms")
    x, w = torch.randn(n, 576).bfloat16(), torch.randn(3072, 576).bfloat16()
    print(f"bfloat16 through float32 (x and w widened, result rounded): "
          f"{ms(lambda: F.linear(x.float(), w.float()).bfloat16()):.2f} ms")


if __name__ == "__main__":
    main()
