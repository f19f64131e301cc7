"""Why float32 weights are stored [in, out]: one-row (and n-row) products over SmolLM2-sized layer
matrices, x·Wᵀ with W [out, in] against x·W with W stored [in, out], float32 and bfloat16.

    .venv/bin/python scripts/layout_bench.py

60 matrices of 3072×576 (SmolLM2's 30 layers' gate/up-sized products, 425 MB in float32, far past
the caches), median of 15 passes, ms per pass over all 60.
"""

import time

import torch
import torch.nn.functional as F


def timed(fn, reps: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


def main() -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    weights = [torch.randn(3072, 576) for _ in range(60)]
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            out_in = [w.to(dtype) for w in weights]
            in_out = [w.t().contiguous().to(dtype) for w in weights]
            for n in (1, 2, 3, 4, 8):
                x = torch.randn(n, 576, dtype=dtype)
                a = timed(lambda: [F.linear(x, w) for w in out_in])
                b = timed(lambda: [x @ w for w in in_out])
                print(f"{str(dtype):15} rows {n}: x·Wᵀ [out, in] {a:6.1f} ms   x·W [in, out] {b:6.1f} ms")


if __name__ == "__main__":
    main()
