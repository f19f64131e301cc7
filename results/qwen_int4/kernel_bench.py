"""The 4-bit product kernel (selfspec.native.gemv.int4_linear) against PyTorch's
`_weight_int4pack_mm_for_cpu` (the int4 path before it) and the bfloat16 kernel (gemv.linear), on
Qwen2.5-Coder-1.5B's layer shapes with random weights, for 1, 2, 4 (and 8) rows; interleaved
rounds, medians. GB/s: the weight bytes each product streams (4-bit: 16 bytes of nibbles and 4 of
scale and zero per 32 weights; PyTorch's int4: 16 bytes of nibbles and 4 of scale and zero per
32 weights too; bfloat16: 2 bytes a weight) over its median time, beside a streamed read
(selfspec/tools/roofline.py measure_bandwidth).

    .venv/bin/python results/qwen_int4/kernel_bench.py --threads 2 --rounds 15 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from selfspec.model.quantize import Int4Linear
from selfspec.native import gemv
from selfspec.tools.roofline import measure_bandwidth

SHAPES = {"qkv 2048x1536": (2048, 1536), "o 1536x1536": (1536, 1536), "gate_up 17920x1536": (17920, 1536),
          "down 1536x8960": (1536, 8960), "k 256x1536": (256, 1536), "up 8960x1536": (8960, 1536)}


def _split(pair):
    """(packed, 32, scales_zeros): `_weight_int4pack_mm_for_cpu`'s arguments after x."""
    return pair[0], 32, pair[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert gemv.available()
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    bandwidth = measure_bandwidth()
    print(f"streamed read: {bandwidth / 1e9:.1f} GB/s ({args.threads} threads); kernel path {gemv.kernel_path()}")
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k) * 0.02
            # Copies to cycle through, some 300 MB of bfloat16 in all, so no product reads its
            # weights from a cache a previous call filled (a decode step reads each matrix once).
            copies = max(2, -(-300 * 2**20 // (n * k * 2)))
            one = Int4Linear.quantize(w, torch.bfloat16, layout="blocks")
            blocks = [(one.packed.clone(), one.scales_zeros.clone()) for _ in range(copies)]
            one = Int4Linear.quantize(w, torch.bfloat16, layout="int4pack")
            packed = [(one.packed.clone(), one.scales_zeros.clone()) for _ in range(copies)]
            wb = [w.bfloat16() for _ in range(copies)]
            del one
            nbytes = {"int4 kernel": n * k // 32 * 20, "torch int4": n * k // 32 * 20, "bf16 kernel": n * k * 2}
            for r in rows:
                x = torch.randn(r, k).bfloat16()
                at = [0]

                def turn():
                    at[0] = (at[0] + 1) % copies
                    return at[0]

                calls = {
                    "int4 kernel": lambda: gemv.int4_linear(x, *blocks[turn()]),
                    "torch int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, *_split(packed[turn()])),
                    "bf16 kernel": lambda: gemv.linear(x, wb[turn()]),
                }
                times = {key: [] for key in calls}
                for f in calls.values():
                    f()
                reps = max(3, int(2e7 // (n * k)))  # one sample: reps calls, each on the next copy  # about 20M weights a sample
                for _ in range(args.rounds):  # interleaved
                    for key, f in calls.items():
                        t = time.perf_counter()
                        for _ in range(reps):
                            f()
                        times[key].append((time.perf_counter() - t) / reps)
                row = {"shape": name, "rows": r}
                for key in calls:
                    med, best = statistics.median(times[key]), min(times[key])
                    row[key + " us"] = round(med * 1e6, 1)
                    row[key + " best us"] = round(best * 1e6, 1)
                    row[key + " GB/s"] = round(nbytes[key] / med / 1e9, 1)
                results.append(row)
                print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_GBps": round(bandwidth / 1e9, 1), "threads": args.threads, "path": gemv.kernel_path(),
                       "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
