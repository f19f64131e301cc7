"""The feature head's drafting step alone, timed per draft token on a device, with the attention
backends a step may use: whether cuDNN's attention is what made the head's c 12-18 on an H200
(torch.profiler put 70-86% of host time in it: results/gpu_h200/profile_feature.log).

A random head of the shipped head's shapes (SmolLM2: d 576, 4 heads × 64, MLP 576) in bfloat16
drafts one position at a time into its own KV cache from position `--start`, the key length growing
by one per step, as in decoding. Rows: the step as selfspec runs it (`context_head._attend`: not
cuDNN on CUDA), and forced to each single backend. No model weights are needed.

    python scripts/head_step_timing.py --device cuda [--steps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from selfspec.feature_head import FeatureHead  # noqa: E402


def time_steps(head: FeatureHead, device: str, steps: int, start: int, backends) -> float:
    """Median milliseconds a draft step over `steps` steps (the first 10 are a warm-up)."""
    d = head.hidden_size
    kv = head.new_kv(start + steps + 16, dtype=torch.bfloat16, device=device)
    head.block.extend(torch.randn(1, start, d, dtype=torch.bfloat16, device=device), 0, kv)
    x = torch.randn(1, 1, d, dtype=torch.bfloat16, device=device)
    times = []
    for i in range(steps):
        sync(device)
        t = time.perf_counter()
        if backends is None:
            f = head.block.step(x, start + i, kv)
        else:
            with sdpa_kernel(backends):
                f = head.block.step(x, start + i, kv)
        token = f.float().argmax()  # the drafter reads its token on the host: one sync a draft token
        int(token)
        times.append(time.perf_counter() - t)
    times = sorted(times[10:])
    return 1e3 * times[len(times) // 2]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--start", type=int, default=100, help="positions already in the head's cache")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    head = FeatureHead(576, 30, heads=4, head_dim=64).to(args.device, torch.bfloat16).eval()
    for p in (head.block.o.weight, head.block.down.weight):
        torch.nn.init.normal_(p, std=0.02)
    rows = {"as selfspec runs it": None, "math only": [SDPBackend.MATH],
            "flash only": [SDPBackend.FLASH_ATTENTION], "memory-efficient only": [SDPBackend.EFFICIENT_ATTENTION],
            "cuDNN only (before)": [SDPBackend.CUDNN_ATTENTION]}
    results = {}
    with torch.inference_mode():
        for name, backends in rows.items():
            try:
                results[name] = round(time_steps(head, args.device, args.steps, args.start, backends), 4)
            except RuntimeError as error:  # a backend that cannot run these shapes here
                results[name] = f"unavailable: {str(error).splitlines()[0][:120]}"
            print(f"{name:24s} {results[name]} ms a draft step", flush=True)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{where}, torch {torch.__version__}, {args.steps} steps from position {args.start}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=where, torch=torch.__version__, ms=results,
                                                   steps=args.steps, start=args.start), indent=1))


if __name__ == "__main__":
    main()
