"""torchao's CPU weight-only int8 and int4 linears beside the kernels selfspec uses, on one weight
shape (docs/internals.md, "torchao"). Needs torchao importable beside selfspec; it is not a
dependency:

    python -m venv /tmp/tao && /tmp/tao/bin/pip install torch==<selfspec's> torchao
    PYTHONPATH=. /tmp/tao/bin/python scripts/torchao_kernels.py [--threads 2] [--out 8960 --in 1536] [--compile]

For 1 and 4 input rows (bfloat16) it times each call of each path, interleaved, over `--copies`
weights of the shape used in turn (more bytes than a CPU's last-level cache, so weights stream from
memory as in decoding), and prints the fastest call and the median in ms (on a shared machine the
fastest is the one least disturbed):
  bf16       F.linear on the bfloat16 weight (the reference)
  int8 (one scale per output row):
    torchao  quantize_(Int8WeightOnlyConfig()), eager: its linear converts the int8 weight to
             bfloat16 and runs mm, every call
    aten     torch.ops.aten._weight_int8pack_mm on the same int8 weight and scales
    selfspec selfspec's product kernel (selfspec.native.gemv.linear) on that weight
  int4 (groups of 32, a scale and zero each):
    torchao  quantize_(PrototypeInt4WeightOnlyConfig(group_size=32)): Int4OpaqueTensor, whose
             linear calls torch.ops.aten._weight_int4pack_mm_for_cpu
    aten     _weight_int4pack_mm_for_cpu directly (selfspec's "int4pack" layout)
    selfspec selfspec's 4-bit kernel (selfspec.native.gemv.int4_linear, the "blocks" layout)
and whether each path's first row is bit-identical when computed alone and beside 1, 3 or 15 other
rows (what exact decoding needs: a verify's rows must round as the one-row AR step does).
--compile: also print the kernels torch.compile's generated code calls for torchao's int8 linear.
"""

from __future__ import annotations

import argparse
import copy
import platform
import re
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def paths_for(weight: torch.Tensor) -> dict:
    """Every path's callable x -> x · weightᵀ for one bfloat16 weight [out, in]."""
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from selfspec.model.quantize import Int4Linear, Int8Linear
    from selfspec.native import gemv

    bf16 = torch.bfloat16
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=bf16)
    linear.weight.data = weight
    tao8 = copy.deepcopy(linear)
    quantize_(tao8, Int8WeightOnlyConfig())
    ours8 = Int8Linear.from_linear(linear, bf16)
    tao4 = copy.deepcopy(linear)
    quantize_(tao4, PrototypeInt4WeightOnlyConfig(group_size=32))
    pack4 = Int4Linear.quantize(weight, bf16, layout="int4pack")
    group = pack4.packed.shape[1] * 2 // pack4.scales_zeros.shape[0]
    paths = {
        "bf16 F.linear": lambda x: F.linear(x, weight),
        "int8 torchao (eager)": tao8,
        "int8 aten _weight_int8pack_mm": lambda x: torch.ops.aten._weight_int8pack_mm(x, ours8.weight, ours8.scale),
        "int4 torchao (Int4OpaqueTensor)": tao4,
        "int4 aten _weight_int4pack_mm_for_cpu": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, pack4.packed, group, pack4.scales_zeros),
    }
    if gemv.available():
        blocks4 = Int4Linear.quantize(weight, bf16, layout="blocks")
        paths["int8 selfspec gemv"] = lambda x: gemv.linear(x, ours8.weight, scale=ours8.scale)
        paths["int4 selfspec blocks"] = lambda x: gemv.int4_linear(x, blocks4.packed, blocks4.scales_zeros)
    return paths


def compiled_kernels(weight: torch.Tensor) -> list[str]:
    """The kernels inductor's code calls for torchao's int8 weight-only linear on 4 rows."""
    from torch._inductor.utils import run_and_get_code
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
    linear.weight.data = weight
    quantize_(linear, Int8WeightOnlyConfig())
    with torch.inference_mode():
        _, code = run_and_get_code(torch.compile(linear), torch.randn(4, weight.shape[1], dtype=torch.bfloat16))
    return sorted({k for c in code for k in re.findall(r"extern_kernels\.\w+|aten\.\w+|cpp_fused_\w+", c)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=int, default=8960, help="output features (default: Qwen2.5-1.5B's gate/up)")
    parser.add_argument("--in", dest="inp", type=int, default=1536, help="input features")
    parser.add_argument("--copies", type=int, default=16, help="weights of the shape, used in turn (16 int4 copies "
                        "of the default shape are 110 MB)")
    parser.add_argument("--repeats", type=int, default=21, help="interleaved rounds; a round calls every path once "
                        "on each copy")
    parser.add_argument("--compile", action="store_true", help="also show what torch.compile makes of torchao's int8 "
                        "linear (about a minute to compile)")
    args = parser.parse_args()

    import torchao

    from selfspec.native import gemv

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(args.out, args.inp).mul_(0.02).to(torch.bfloat16) for _ in range(args.copies)]
    sets = [paths_for(w) for w in weights]
    order = ["bf16 F.linear", "int8 torchao (eager)", "int8 aten _weight_int8pack_mm", "int8 selfspec gemv",
             "int4 torchao (Int4OpaqueTensor)", "int4 aten _weight_int4pack_mm_for_cpu", "int4 selfspec blocks"]
    order = [name for name in order if name in sets[0]]

    inputs = {rows: torch.randn(rows, args.inp, dtype=torch.bfloat16) for rows in (1, 4)}
    times = {(name, rows): [] for name in order for rows in inputs}
    with torch.inference_mode():
        for paths in sets:  # warm-up (and any lazy packing)
            for name in order:
                paths[name](inputs[1])
        for _ in range(args.repeats):
            for rows, x in inputs.items():
                for name in order:
                    for paths in sets:
                        t0 = time.perf_counter()
                        paths[name](x)
                        times[name, rows].append((time.perf_counter() - t0) * 1e3)
        alone = {}
        for name in order:  # on 8 weights and inputs: a path that rounds by row count shows it on some
            alone[name] = True
            for paths, wide in zip(sets[:8], torch.randn(8, 16, args.inp, dtype=torch.bfloat16)):
                one = paths[name](wide[:1])
                alone[name] &= all(torch.equal(paths[name](wide[:n])[:1], one) for n in (2, 4, 16))

    print(f"{args.out}x{args.inp} weights ({args.copies} in turn), bfloat16 rows; {cpu_name()}, {args.threads} "
          f"threads; torch {torch.__version__}, torchao {torchao.__version__}; selfspec kernel path: "
          f"{gemv.kernel_path() if gemv.available() else 'not built'}; {args.repeats} rounds")
    print()
    print("| path | 1 row: fastest, median (ms) | 4 rows: fastest, median (ms) | row 0 the same beside 1, 3, 15 other rows |")
    print("|---|---|---|---|")
    for name in order:
        cells = [f"{min(times[name, rows]):.2f}, {statistics.median(times[name, rows]):.2f}" for rows in inputs]
        print(f"| {name} | {cells[0]} | {cells[1]} | {'yes' if alone[name] else 'no'} |")
    if args.compile:
        print()
        print("torch.compile of torchao's int8 linear calls:", ", ".join(compiled_kernels(weights[0])))


if __name__ == "__main__":
    main()
