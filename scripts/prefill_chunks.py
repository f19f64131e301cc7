"""A short prompt's prefill: PyTorch's path against 16-row fused-layer calls (selfspec.step,
PREFILL_CHUNKS), interleaved in one process, on the bundled SmolLM2.

    .venv/bin/python scripts/prefill_chunks.py [--dtype bfloat16 int8] [--rows 17 24 32 ...] [--repeats 7]

Prints, per dtype and prompt length, the median prefill milliseconds each way (the 30 layers
and the head's last row, from position 0 in a fresh cache) and the largest logit difference
between the two.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import selfspec
from selfspec import gemv, step


def prefill(model, ids: torch.Tensor, chunks: int) -> tuple[float, torch.Tensor]:
    adapter = model.adapter
    step.PREFILL_CHUNKS = chunks
    cache = adapter.new_cache(ids.numel() + 8)
    t = time.perf_counter()
    h = adapter.run_layers(adapter.embed(ids), range(adapter.n_layers), 0, cache)
    logits = adapter.head(h[:, -1:])
    return time.perf_counter() - t, logits.float()


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "int8"])
    parser.add_argument("--rows", nargs="+", type=int, default=[17, 24, 32, 36, 40, 48, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernel path {gemv.kernel_path()}, native bfloat16 {gemv.native_bfloat16()}, {args.threads} threads")
    text = open(__file__).read()
    for dtype in args.dtype:
        model = selfspec.load("smollm2", dtype=dtype, progress=False)
        all_ids = model.encode(text, chat=False)
        for n in args.rows:
            ids = all_ids[:n]
            for chunks in (0, n):
                prefill(model, ids, chunks)  # warm up each way
            times = {0: [], n: []}
            for _ in range(args.repeats):
                for chunks in (0, n):
                    seconds, logits = prefill(model, ids, chunks)
                    times[chunks].append(seconds)
            _, torch_logits = prefill(model, ids, 0)
            _, fused_logits = prefill(model, ids, n)
            diff = (torch_logits - fused_logits).abs().max().item()
            same = int(torch_logits.argmax()) == int(fused_logits.argmax())
            a, b = statistics.median(times[0]) * 1e3, statistics.median(times[n]) * 1e3
            print(f"{dtype:9s} {n:3d} tokens: PyTorch {a:6.1f} ms, fused 16-row calls {b:6.1f} ms "
                  f"({b / a:.2f}x); max |logit diff| {diff:.3g}, same argmax {same}", flush=True)


if __name__ == "__main__":
    main()
