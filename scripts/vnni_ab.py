"""The int8 products with and without the integer (VNNI) kernel, interleaved in one process so the
machine's drift hits both alike: SmolLM2's 120 decoder-layer matrices as distinct random int8
weights (106 MB, so they stream from memory as a step's do) and its head (49152 x 576) as int8 and
as bfloat16, for 1-4 rows. Medians of the rounds, and each row count's ratio to one row.

    .venv/bin/python scripts/vnni_ab.py [--rounds 9] [--threads 2]

Needs a CPU with AVX512-VNNI (selfspec.gemv.vnni); SELFSPEC_VNNI=0 builds the float-FMA kernel beside it.
"""

import argparse
import os
import time

import torch

from selfspec import gemv

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # qkv, o, gate/up, down, 30 layers
ROWS = (1, 2, 3, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not gemv.vnni(gemv.kernel_path()):
        raise SystemExit(f"this CPU's kernel path ({gemv.kernel_path()}) has no integer int8 products")
    libs = {}
    for on in ("1", "0"):
        os.environ["SELFSPEC_VNNI"] = on
        libs["VNNI" if on == "1" else "float FMAs"] = gemv._build()
    torch.manual_seed(0)
    layers = [(torch.randint(-127, 128, s, dtype=torch.int8), torch.rand(s[0]).bfloat16()) for s in SHAPES]
    head8 = (torch.randint(-127, 128, (49152, 576), dtype=torch.int8), torch.rand(49152).bfloat16())
    head16 = torch.randn(49152, 576).bfloat16()
    xs = {r: {k: torch.randn(r, k).bfloat16() for k in (576, 1536)} for r in ROWS}
    parts = {
        "layers, int8": lambda r: [gemv.linear(xs[r][w.shape[1]], w, None, s) for w, s in layers],
        "head, int8": lambda r: gemv.linear(xs[r][576], head8[0], None, head8[1]),
        "head, bfloat16": lambda r: gemv.linear(xs[r][576], head16),
    }
    times: dict = {}
    for _ in range(args.rounds):
        for kernel, lib in libs.items():
            gemv._STATE["lib"] = lib
            for r in ROWS:
                for part, run in parts.items():
                    t = time.perf_counter()
                    run(r)
                    times.setdefault((part, kernel, r), []).append(time.perf_counter() - t)
    print(f"{gemv._cpuinfo('model name') and ' '.join(gemv._cpuinfo('model name'))}, {args.threads} threads; "
          f"medians of {args.rounds} interleaved rounds, ms (x one row)")
    for part in parts:
        for kernel in libs:
            ms = [sorted(times[(part, kernel, r)])[args.rounds // 2] * 1e3 for r in ROWS]
            print(f"{part:15s} {kernel:10s} " + "  ".join(f"{r} rows {m:6.2f} ({m / ms[0]:.2f})" for r, m in zip(ROWS, ms)))


if __name__ == "__main__":
    main()
