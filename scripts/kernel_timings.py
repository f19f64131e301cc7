"""Timings behind the README's fused-layer paragraphs (SmolLM2, bfloat16), each printed with what it is.

    .venv/bin/python scripts/kernel_timings.py [--threads 2] [--repeats 21] [--only products|fused|prefill ...]

1. The product kernel's streaming rate: SmolLM2's 120 layer matrices (random bfloat16 weights of
   the same shapes) for 1-4 input rows, and one 512 MB matrix for one row, beside a streamed read
   (the memory floor's bandwidth). Repeats interleave the row counts, so machine noise spreads.
   Then its compute roof: the kernel on a matrix held in cache, so the rows' arithmetic alone.
2. The fused step over n = 1-4 rows at 128 and 1,000 keys: the whole step (layers + head), and
   the layers with attention only and with the MLP only (skip sets), so the growth with rows and
   with context is split into attention and MLP.
3. A prefill's pieces: PyTorch's attention over 997 rows with a mask against causal with none,
   and PyTorch's int8 kernel against dequantize + bfloat16 GEMM for 1,000 rows of the gate/up.
Medians; one run is one machine's state (this VM's bandwidth varies run to run).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import selfspec
from selfspec.native import gemv
from selfspec.tools.roofline import measure_bandwidth
from selfspec.model.skips import SkipSet


def median_ms(jobs: dict, repeats: int) -> dict:
    """Each job's median wall time in ms, the jobs interleaved within every repeat."""
    times = {name: [] for name in jobs}
    for _ in range(repeats):
        for name, job in jobs.items():
            job()
            t = time.perf_counter()
            job()
            times[name].append(time.perf_counter() - t)
    return {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}


def products(repeats: int) -> None:
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # SmolLM2's q/k/v, o, gate/up, down
    weights = [torch.randn(n, k).bfloat16() for n, k in shapes]
    total = sum(w.numel() * 2 for w in weights)
    xs = {r: {k: torch.randn(r, k).bfloat16() for k in (576, 1536)} for r in (1, 2, 3, 4)}
    jobs = {r: (lambda r=r: [gemv.linear(xs[r][w.shape[1]], w) for w in weights]) for r in (1, 2, 3, 4)}
    big, x = torch.ones(32768, 8192, dtype=torch.bfloat16), torch.ones(1, 8192, dtype=torch.bfloat16)
    jobs["512 MB, 1 row"] = lambda: gemv.linear(x, big)
    ms = median_ms(jobs, repeats)
    print(f"streamed read (torch sum over 512 MB): {measure_bandwidth() / 1e9:.1f} GB/s")
    for r in (1, 2, 3, 4):
        print(f"product kernel, 120 layer matrices ({total / 1e6:.0f} MB), {r} row(s): {ms[r]:.2f} ms = "
              f"{total / ms[r] / 1e6:.1f} GB/s, {ms[r] / ms[1]:.2f}x one row")
    print(f"product kernel, one 512 MB matrix, 1 row: {big.numel() * 2 / ms['512 MB, 1 row'] / 1e6:.1f} GB/s")
    roofline(repeats, total, ms)


def roofline(repeats: int, total: int, streamed: dict) -> None:
    """The compute side: the same kernel on a matrix that stays in cache (no memory stream), 100
    calls per timing, as multiply-adds per second for 1-4 rows; then, for the 120 matrices, the
    time r rows' arithmetic takes at that rate beside the time their bytes take at the 1-row rate.
    Where r rows' arithmetic nears the stream time, v(r) cannot stay near 1 on this CPU."""
    w = torch.randn(1024, 576).bfloat16()  # 1.2 MB: in a 2 MB L2, split over the threads
    xs = {r: torch.randn(r, 576).bfloat16() for r in (1, 2, 3, 4)}
    jobs = {r: (lambda r=r: [gemv.linear(xs[r], w) for _ in range(100)]) for r in (1, 2, 3, 4)}
    ms = median_ms(jobs, repeats)
    macs = total // 2  # one multiply-add per bfloat16 weight per row
    for r in (1, 2, 3, 4):
        rate = 100 * r * w.numel() / (ms[r] / 1e3)
        print(f"compute roof (product kernel, 1024x576 matrix in cache, {r} row(s)): {rate / 1e9:.1f} G multiply-adds/s; "
              f"the 120 matrices' {r}-row arithmetic at that rate {macs * r / rate * 1e3:.2f} ms against their "
              f"1-row stream {streamed[1]:.2f} ms (measured {r}-row: {streamed[r]:.2f} ms)")


def fused_step(model, repeats: int) -> None:
    adapter = model.adapter
    layers = range(adapter.n_layers)
    every = frozenset(layers)
    for context in (128, 1000):
        cache = adapter.new_cache(context + 8)
        with torch.inference_mode():
            adapter.run_layers(adapter.embed(torch.zeros(context, dtype=torch.long)), layers, 0, cache)
        jobs = {}
        for n in (1, 2, 3, 4):
            tokens = torch.zeros(n, dtype=torch.long)
            for part, skip in (("step", None), ("attention", SkipSet(mlp=every)), ("mlp", SkipSet(attn=every))):
                def job(tokens=tokens, skip=skip):
                    with torch.inference_mode():
                        h = adapter.run_layers(adapter.embed(tokens), layers, context, cache, skip=skip or SkipSet())
                        if skip is None:
                            adapter.head(h)
                jobs[(part, n)] = job
        ms = median_ms(jobs, repeats)
        for part in ("step", "attention", "mlp"):
            cells = ", ".join(f"{n} rows {ms[(part, n)]:.2f} ms ({ms[(part, n)] / ms[(part, 1)]:.2f}x)" for n in (1, 2, 3, 4))
            label = {"step": "whole step (layers + head)", "attention": "layers, attention sublayers only",
                     "mlp": "layers, MLP sublayers only"}[part]
            print(f"fused, {context} keys, {label}: {cells}")


def prefill(repeats: int) -> None:
    n, nh, nkv, hd = 997, 9, 3, 64
    q = torch.randn(1, nh, n, hd).bfloat16()
    k, v = torch.randn(1, nkv, n, hd).bfloat16(), torch.randn(1, nkv, n, hd).bfloat16()
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    x = torch.randn(1000, 576).bfloat16()
    w = torch.randint(-127, 128, (3072, 576), dtype=torch.int8)
    scale = (torch.rand(3072) / 100).bfloat16()
    ms = median_ms({
        "masked": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        "causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "int8 kernel": lambda: torch.ops.aten._weight_int8pack_mm(x, w, scale),
        "dequantize + GEMM": lambda: (x @ w.to(torch.bfloat16).t()) * scale,
    }, repeats)
    print(f"prefill attention, one layer, {n} rows: masked {ms['masked']:.1f} ms, causal without a mask "
          f"{ms['causal']:.1f} ms")
    print(f"int8 gate/up product, 1,000 rows: PyTorch's int8 kernel {ms['int8 kernel']:.1f} ms, dequantize + "
          f"bfloat16 GEMM {ms['dequantize + GEMM']:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--only", nargs="+", choices=("products", "fused", "prefill"),
                    default=("products", "fused", "prefill"), help="which of the three parts to time (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not gemv.available():
        raise SystemExit("the product kernel does not run here (no g++ or no AVX2/FMA)")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"{cpu}, {args.threads} threads, torch {torch.__version__}, medians of {args.repeats}")
    if "products" in args.only:
        products(args.repeats)
    if "fused" in args.only:
        fused_step(selfspec.load("smollm2", dtype="bfloat16", progress=False), args.repeats)
    if "prefill" in args.only:
        prefill(max(5, args.repeats // 4))


if __name__ == "__main__":
    main()
