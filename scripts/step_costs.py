"""The lean step's costs per dtype and mode: weight bytes, bandwidth, memory floor, the one-token
step, v(n) for n = 1..9 (no KV reuse), c(k) against (k/L)(1 - h) + h, and compile time.

    .venv/bin/python scripts/step_costs.py [--model smollm2] [--dtype float32 bfloat16 int8]
        [--mode general eager compiled exact] [--context 128] [--markdown FILE]

Modes: general = the adapter's per-module path (the engine before the lean step); eager = the lean
step uncompiled; compiled = torch.compile per row bucket; exact = eager, every forward in 8 rows.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import selfspec
from selfspec.api import EXACT_ROWS, SelfSpecModel
from selfspec.tools.roofline import measure_bandwidth, roofline
from selfspec.tools.tune.costs import measure_costs

MODES = {"general": dict(lean=False), "eager": dict(), "compiled": dict(compile=True),
         "exact": dict(exact=True), "exact-compiled": dict(exact=True, compile=True)}


def head_share(adapter, repeats: int = 7) -> float:
    """Seconds of the model's final norm and head on one row (h's numerator)."""
    h = adapter.embed(torch.zeros(1, dtype=torch.long))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        adapter.head(h)
        times.append(time.perf_counter() - t)
    return sorted(times)[repeats // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16", "int8"])
    ap.add_argument("--mode", nargs="+", default=["general", "eager", "compiled", "exact"], choices=list(MODES))
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    bandwidth = measure_bandwidth()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, bandwidth {bandwidth / 1e9:.1f} GB/s",
          file=sys.stderr)
    rows = []
    for dtype in args.dtype:
        base = selfspec.load(args.model, dtype=dtype, progress=False, compile=False)
        for mode in args.mode:
            options = MODES[mode]
            model = SelfSpecModel(base.hf_model, base.tokenizer, base.name, **{"lean": True, **options})
            adapter = model.adapter
            n_layers = adapter.n_layers
            ks = sorted({1, n_layers // 4, n_layers // 2, (3 * n_layers) // 4, n_layers - 1})
            t = time.perf_counter()
            with torch.inference_mode():  # warm every row bucket once: compiles happen here
                measure_costs(adapter, context=args.context, exit_layers=[], max_draft_len=8, draft_layers=[1],
                              repeats=1, progress=False)
            warm_s = time.perf_counter() - t
            with torch.inference_mode():
                costs = measure_costs(adapter, context=args.context, exit_layers=[], max_draft_len=8,
                                      draft_layers=ks, repeats=args.repeats, progress=False)
                h = head_share(adapter) / costs.step_s
            line = roofline(model.hf_model, costs.step_s, bandwidth)
            v = costs.verify[0]
            max_v = 9 if not (options.get("exact")) else EXACT_ROWS
            row = {
                "dtype": dtype, "mode": mode, "weights MB": f"{(line.layer_bytes + line.head_bytes) / 1e6:.0f}",
                "floor ms": f"{line.floor_s * 1e3:.1f}", "step ms": f"{costs.step_s * 1e3:.1f}",
                "step/floor": f"{costs.step_s / line.floor_s:.2f}", "h": f"{h:.2f}",
                **{f"v({n})": f"{v[n]:.2f}" for n in range(2, max_v + 1)},
                **{f"c({k})": f"{costs.draft[k]:.2f} ({k / n_layers * (1 - h) + h:.2f})" for k in ks},
                "warm-up s": f"{warm_s:.0f}",
            }
            rows.append(row)
            print(" | ".join(f"{k} {v}" for k, v in row.items()), file=sys.stderr, flush=True)
        del base
    keys = list(dict.fromkeys(k for row in rows for k in row))
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    table += ["| " + " | ".join(row.get(k, "–") for k in keys) + " |" for row in rows]
    print("\n".join(table))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
                    f"bandwidth {bandwidth / 1e9:.1f} GB/s, context {args.context}\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
