"""Hand-written few-row matrix products for bfloat16, int8 and float32 weights (`kernels/product.h`,
the op `gemv` of `kernels/ops.cpp`; the same library holds the fused decoder layer, selfspec.native.fused_layer,
and the feature head's step, selfspec.native.fused_feature).

Why: a decode step is a chain of one-row products (one to four rows in a verify), each reading its
whole weight matrix once, so its speed is the rate the weights stream at. PyTorch's CPU kernels
for one bfloat16 or int8 row stream at 13-15 GB/s on 2 threads here, where the machine reads
about 48 GB/s (README, "The lean step"). This kernel streams the rows of W through AVX2 FMAs into
per-row float32 accumulators, for up to four input rows per pass (up to MAX_ROWS in all).

Exactness: every output element is one thread's sum in one fixed order, the same whatever the
number of rows in the call or the thread count, so a verify's rows equal the AR step's rows bit for
bit. (Across CPUs: the AVX2 path rounds alike on every x86 CPU; CPUs with AVX512-BF16 take the
pair-dot-product path for bfloat16 weights, CPUs with AVX-512 but not those the 16-lane AVX-512
path, and CPUs with AMX the tile products: each rounds its own way. int8 weights on the AVX-512
path of a CPU with AVX512-VNNI are exact integer sums of x as int16 rows, `vnni`: the same bits
on every such CPU.)

Built once per machine and flags with torch.utils.cpp_extension (g++ and ninja; about 15 s on
first use on 2 cores, most of it ops.cpp against torch's headers) into the selfspec cache
(kernels/<hash>/), which later processes load directly. The kernels are torch ops whose C++ side
(kernels/ops.cpp) checks every tensor's shape, dtype, device and layout, so a wrong call is a
RuntimeError, not a crash. Without g++, ninja, AVX2 or FMA, or with SELFSPEC_GEMV=0,
`available()` is False and the lean step keeps PyTorch's kernels. The eager lean step calls the op
directly (`linear`, 4-5 µs a call); compiled code calls it as the custom op `torch.ops.selfspec.gemv` (14 µs), which
torch.compile keeps as one opaque call while it fuses the small ops around it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

MAX_ROWS = 16  # four per pass over the weights (eight for int8 ones on AVX512-BF16 pairs; kernels/product.h)
KERNELS = Path(__file__).with_name("kernels")
SOURCE = KERNELS / "gemv.cpp"  # and the fused layer and feature step, all over product.h, in one library
PARTS = ["layer.cpp", "feature.cpp", "quant4.cpp", "ops.cpp"]  # beside SOURCE; ops.cpp: the torch ops and their checks
HEADERS = ["product.h", "layer.h", "quant4.h", "entry.h"]
# No contraction or reassociation beyond the kernel's own FMAs: one fixed rounding per row.
# (cpp_extension adds -fPIC and its C++ standard, which torch's headers need.)
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
_STATE: dict = {}


PREFETCH = 1024  # weight elements ahead (kernels/product.h), on Intel CPUs only by default


def _prefetch() -> int:
    """How far ahead the products prefetch weights (the AVX2 and the pair paths): $SELFSPEC_PREFETCH, else
    PREFETCH on Intel CPUs and 0 (none) elsewhere. On a 2-core Intel Xeon (AVX512-BF16, AMX) it
    took SmolLM2's fused bfloat16 step from 17.4-19.4 to 15.4-15.6 ms and a 3-row verify from
    22.3-25.1 to 17.8-18.1 ms (scripts/prefetch_ab.sh, results/intel/prefetch_ab.out); the AMD EPYC
    the kernel was tuned on streamed near its read rate without it, and is left as it was.
    On the AVX2-only AMD EPYC it gave no consistent gain (results/amd_avx2/prefetch_ab.out).
    Results are bit-identical either way (prefetches change no arithmetic)."""
    value = os.environ.get("SELFSPEC_PREFETCH", "").strip()
    if value:
        if not value.isdigit():
            raise ValueError(f"SELFSPEC_PREFETCH must be a whole number of weight elements (0: none), got {value!r}")
        return int(value)
    return PREFETCH if "GenuineIntel" in _cpuinfo("vendor_id") else 0


def _attention_rows(path: str) -> int:
    """How many rows of a verify attend together per task in the fused layer (kernels/layer.h,
    attend16_rows; 64- and 128-wide heads on the AVX-512 paths): $SELFSPEC_ATTN_ROWS, else 4 on
    the avx512 path and 1 (each row alone) elsewhere. On a 2-core Ice Lake Xeon (avx512) it took a
    4-row verify's attention sublayers at 1,000 keys from 2.07-2.29x a step's to 1.36-1.46x
    (scripts/attention_rows_ab.sh, results/intel_avx512/attention_rows_ab.out); the pair and AMX
    paths were not measured with it, so they keep one row per task. Results are bit-identical
    either way (each row's arithmetic is its one-row call's)."""
    value = os.environ.get("SELFSPEC_ATTN_ROWS", "").strip()
    if value:
        if not value.isdigit() or not 1 <= int(value) <= 4:
            raise ValueError(f"SELFSPEC_ATTN_ROWS must be 1, 2, 3 or 4 (rows per attention task), got {value!r}")
        return int(value)
    return 4 if path == "avx512" else 1


def vnni(path: str) -> bool:
    """Whether int8 weights take the integer products (kernels/product.h, rows_vnni: x as int16
    rows, exact integer sums): on the avx512 path where the CPU has AVX512-VNNI, unless
    $SELFSPEC_VNNI=0 keeps them on float FMAs (for A/B). They round int8 models differently from
    the float products (x is quantized to 15 bits a row), the same on every such CPU."""
    return path == "avx512" and {"avx512_vnni", "avx512bw"} <= _cpu_flags() and os.environ.get("SELFSPEC_VNNI", "1") != "0"


def int4_vnni(path: str) -> bool:
    """Whether the 4-bit products (kernels/quant4.h) run on AVX512-VNNI's 512-bit integer dot
    products (any AVX-512 path of a CPU with AVX512-VNNI); else on AVX2's. The two round a row's
    float sums in different orders; each is exact across row counts."""
    return path != "avx2" and {"avx512f", "avx512_vnni", "avx512bw"} <= _cpu_flags()


@functools.cache
def _cpuinfo(field: str) -> list[str]:
    """The words of /proc/cpuinfo's first `field` line (empty where there is none), read once a process."""
    try:
        return next((line.split(":", 1)[-1] for line in open("/proc/cpuinfo") if line.startswith(field)), "").split()
    except OSError:
        return []


def _cpu_flags() -> set[str]:
    return set(_cpuinfo("flags"))


NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
# kernel_path()'s values, as CPU features
PATH_NAMES = {"pairs": "AVX512-BF16", "amx": "AMX", "avx512": "AVX-512", "avx2": "AVX2"}


def native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 products natively (AVX512-BF16 or AMX)."""
    return bool(NATIVE_BF16_FLAGS & _cpu_flags())


def kernel_path() -> str:
    """The products' instruction path on this machine: "amx" (AMX tiles, bfloat16 and int8
    weights), "pairs" (AVX512-BF16 pair dot products), "avx512" (AVX-512 FMAs, on CPUs with
    AVX-512 but no AVX512-BF16: Skylake-SP to Ice Lake Xeons) or "avx2"; $SELFSPEC_GEMV=pairs,
    avx512 or avx2 asks for a lesser one. float32 weights take AVX2 FMAs on the pair and AMX
    paths, AVX-512 FMAs on the avx512 path. Each path rounds its own way, the same for every row
    count and thread count."""
    flags, asked = _cpu_flags(), os.environ.get("SELFSPEC_GEMV", "")
    if "avx512f" not in flags or asked == "avx2":
        return "avx2"
    if "avx512_bf16" not in flags or asked == "avx512":
        return "avx512"
    if not {"amx_bf16", "amx_tile"} <= flags or asked == "pairs":
        return "pairs"
    return "amx"


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH: add the PyPI package's (a dependency) when the venv's
    bin directory is not on PATH (`.venv/bin/python` run without activating it)."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build():
    """The kernels' torch ops (`torch.ops.selfspec_<hash>`, kernels/ops.cpp), built on first use;
    None (and why, once, on stderr) when they cannot be."""
    if os.environ.get("SELFSPEC_GEMV", "1") == "0":
        return None
    if not {"avx2", "fma"} <= _cpu_flags():
        return None
    from selfspec.native.build import cache_root

    # Where the CPU has AVX512-BF16, bfloat16 weights go through its pair dot products (fewer
    # instructions per weight, so several rows cost little more than one); where it also has AMX,
    # through tile dot products (16 rows cost what one does); where it has AVX-512 without them,
    # through 16-lane FMAs; else AVX2 throughout. SELFSPEC_GEMV=avx2 keeps AVX2 throughout,
    # SELFSPEC_GEMV=avx512 leaves the pairs out and SELFSPEC_GEMV=pairs leaves AMX out (the tests
    # check every path the machine has).
    path = kernel_path()
    flags = FLAGS + [f"-DPREFETCH={_prefetch()}", f"-DATTN_ROWS={_attention_rows(path)}"]
    flags += ["-mavx512f", "-mavx512bf16"] if path in ("pairs", "amx") else []
    flags += ["-mavx512f", "-DSELFSPEC_AVX512"] if path == "avx512" else []
    flags += ["-mavx512bw", "-mavx512vnni", "-DSELFSPEC_VNNI"] if vnni(path) else []
    flags += ["-mavx512bw", "-mavx512vnni"] if int4_vnni(path) and not vnni(path) else []
    flags += ["-mamx-tile", "-mamx-bf16", "-DSELFSPEC_AMX"] if path == "amx" else []
    sources = [SOURCE, *(SOURCE.with_name(name) for name in PARTS)]
    text = b"".join(path.read_bytes() for path in [*sources, *(SOURCE.with_name(name) for name in HEADERS)])
    digest = hashlib.sha256(text + " ".join(flags + [torch.__version__]).encode()).hexdigest()[:16]
    # One namespace per build, so builds with other flags (the tests') load beside it in one process.
    name = f"selfspec_{digest}"
    if name in _LOADED:  # a namespace registers once per process: a second copy (another cache dir) would abort
        return getattr(torch.ops, name)
    directory = cache_root() / "kernels" / digest
    library = directory / f"{name}.so"
    try:
        # Built before (by any process) and not being built now (cpp_extension holds `lock` while it builds).
        if library.exists() and not (directory / "lock").exists():
            torch.ops.load_library(str(library))
        else:
            from torch.utils import cpp_extension

            _ninja_on_path()
            directory.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(name=name, sources=[str(source) for source in sources], build_directory=str(directory),
                               extra_cflags=flags + [f"-DSELFSPEC_NS={name}"], extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as err:
        shutil.rmtree(directory, ignore_errors=True)  # nothing half-built left behind
        detail = str(err).split("\n")
        detail = " ".join(line.strip() for line in detail if "error" in line.lower())[:200] or detail[0][:200]
        print(f"selfspec: note: could not build the one-row product kernel ({detail}); using PyTorch's",
              file=sys.stderr)
        return None
    _LOADED.add(name)
    return getattr(torch.ops, name)


_LOADED: set[str] = set()  # the kernel namespaces this process has loaded


def available() -> bool:
    """Whether the kernel runs on this machine (built or loaded once per process)."""
    if "lib" not in _STATE:
        _STATE["lib"] = _build()
    return _STATE["lib"] is not None


WEIGHTS = {torch.bfloat16: (torch.bfloat16, torch.int8), torch.float32: (torch.float32,)}  # x dtype -> w dtypes


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record an op on these tensors: the kernels have no backward, so
    such products (calibration, training) keep PyTorch's."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether linear(x, w) can run here: at most MAX_ROWS CPU rows, bfloat16 against a contiguous
    bfloat16 or int8 weight [out, in], or float32 against float32, and no gradient wanted."""
    return (x.device.type == "cpu" and x.dtype in WEIGHTS and x.dim() == 2 and x.shape[0] <= MAX_ROWS
            and w.dtype in WEIGHTS[x.dtype] and w.dim() == 2 and w.is_contiguous()
            and w.shape[1] == x.shape[1] and available() and not needs_grad(x, w))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None, rows_out: int | None = None) -> torch.Tensor:
    """x [R, in] bfloat16 (R <= MAX_ROWS) · wᵀ for w [out, in] bfloat16, or int8 times its
    per-output scale [out] (bfloat16); plus bias [out] (bfloat16). Returns [R, out] bfloat16.
    Or x, w, bias and the result all float32. rows_out > R: the result has rows_out rows, the
    extra ones copies of row R - 1 (the padding of exact mode's row bucket). The op checks every
    tensor (a wrong one is a RuntimeError)."""
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"the one-row product kernel takes 1..{MAX_ROWS} rows, got {x.shape[0]}")
    return _STATE["lib"].gemv.default(x.contiguous(), w, None if bias is None else bias.contiguous(),
                                      None if scale is None else scale.contiguous(), rows_out)


def project(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x [..., in]: through the kernel when it takes these rows (small
    drafting modules' one-row products, which PyTorch's bfloat16 path runs ~10x slower), else
    PyTorch's (training, many rows, other dtypes)."""
    rows = x.reshape(-1, x.shape[-1])
    if supports(rows, w) and (bias is None or bias.dtype == x.dtype):
        return linear(rows, w, bias).view(*x.shape[:-1], w.shape[0])
    return torch.nn.functional.linear(x, w, bias)


@torch.library.custom_op("selfspec::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None) -> torch.Tensor:
    """`linear` as a custom op, for compiled code: the current build's op (`_STATE["lib"]`, which
    the tests swap for builds with other flags), with a fake for torch.compile's tracing."""
    return linear(x, w, bias, scale)


@gemv_op.register_fake
def _(x, w, bias, scale):
    return x.new_empty(x.shape[0], w.shape[0])


# -- 4-bit blocks (kernels/quant4.h) -------------------------------------------------------------
#
# W [out, in] as blocks of 32 inputs, q [out, in / 32, 16] uint8 (each block's 16 bytes holding
# element i in the low nibble of byte i and i + 16 in its high one, a row's blocks interleaved in
# groups of 16 so each block has its own 32-bit lane: quantize.to_groups) and sz [out, groups, 38]
# uint8, each group's scale and minimum codes, steps and base (quantize.pack_scales), w = q ·
# scale - minimum, laid out by selfspec.model.quantize. The product unpacks each group once into registers for every row of a
# pass (eight rows on AVX-512, four on AVX2); each row's result is the same whatever the row count
# (one fixed order per row, as above).


def int4_linear(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None = None,
                rows_out: int | None = None) -> torch.Tensor:
    """x [R, in] bfloat16 (R <= MAX_ROWS) · Wᵀ for W as 4-bit blocks (q, sz), plus bias [out]
    (bfloat16): [R, out] bfloat16, or rows_out rows, the extra ones copies of row R - 1. The op
    checks every tensor (a wrong one is a RuntimeError)."""
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"the 4-bit product kernel takes 1..{MAX_ROWS} rows, got {x.shape[0]}")
    return _STATE["lib"].int4_gemv.default(x.contiguous(), q, sz, None if bias is None else bias.contiguous(),
                                           rows_out)


def int4_dequantize(q: torch.Tensor, sz: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [out, in] float32 (or bfloat16, each value rounded once) from its 4-bit blocks: q · scale -
    minimum."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the 4-bit blocks dequantize to float32 or bfloat16, not {dtype}")
    return _STATE["lib"].int4_dequantize.default(q, sz, dtype == torch.bfloat16)


def head_screen(x: torch.Tensor, approx: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor | None:
    """The candidates of selfspec.model.head_screen: x [n, in] bfloat16, approx [n, V] bfloat16
    (the 4-bit copy's logits of x), bounds [4, V] float32; every token (ascending, int64) that
    could hold some row's largest int8 logit. None where x is not finite."""
    rows = _STATE["lib"].head_screen.default(x.contiguous(), approx.contiguous(), bounds)
    return None if rows.numel() == 1 and int(rows[0]) < 0 else rows


INT4_ROWS = 256  # up to this many rows the 4-bit products run the decode kernel's arithmetic (int4_rows) ...
INT4_ROWS_AVX2 = 64  # ... and this many where they run on AVX2 (no AVX512-VNNI)


def int4_rows_limit() -> int:
    """The most rows a 4-bit product runs through the decode kernel's integer arithmetic (`int4_rows`)
    rather than as a GEMM of dequantized tiles (`int4_prefill`): $SELFSPEC_INT4_ROWS (0: never),
    else INT4_ROWS where the 4-bit products run AVX512-VNNI (their many-row tiles), INT4_ROWS_AVX2
    on AVX2, and 0 on AMX CPUs, whose bfloat16 GEMM was not measured against it. On a 2-core AMD
    EPYC (AVX512-VNNI, AVX512-BF16), Qwen2.5-Coder 1.5B's layer shapes (random blocks, 2 threads)
    took 0.6-0.7x the tiles' time at 24-48 rows, 0.7-0.9x at 112-256 and 1.0x at 512; the AVX2
    build 0.29-0.55x the float32 GEMM such CPUs run at 17-64 rows."""
    value = os.environ.get("SELFSPEC_INT4_ROWS", "").strip()
    if value:
        if not value.isdigit():
            raise ValueError(f"SELFSPEC_INT4_ROWS must be a whole number of rows (0: none), got {value!r}")
        return int(value)
    path = kernel_path()
    return 0 if path == "amx" else INT4_ROWS if int4_vnni(path) else INT4_ROWS_AVX2


def int4_rows(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] bfloat16, any M, · Wᵀ (+ bias) for W as 4-bit blocks, through `int4_linear`'s kernel:
    each row's result is that row's one-row call, bit for bit, whatever M (a few rows stream the
    weights once for all of them; many rows go in register tiles of 4 outputs x 3 rows where the
    CPU has AVX512-VNNI, kernels/quant4.h's `many`)."""
    return _STATE["lib"].int4_rows.default(x.contiguous(), q, sz, None if bias is None else bias.contiguous())


PREFILL_TILE_BYTES = 4 << 20  # the dequantized tile a prefill's GEMM reads (int4_prefill): in cache, reused


def int4_prefill(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None = None,
                 tile_bytes: int = PREFILL_TILE_BYTES) -> torch.Tensor:
    """x [M, in] · Wᵀ (+ bias) for many rows (a prefill): W dequantized a tile of output rows at a
    time into one reused buffer of about tile_bytes, in x's dtype (bfloat16 or float32; bias the
    same), each tile multiplied by PyTorch's GEMM. The same weights and dot products as a GEMM of
    the whole dequantized matrix, without writing it to fresh memory each prefill (on a 2-core AMD
    EPYC that write, page faults included, was half of Qwen2.5-Coder 1.5B's 110-token prefill)."""
    return _STATE["lib"].int4_prefill.default(x.contiguous(), q, sz, None if bias is None else bias.contiguous(),
                                              tile_bytes)


@torch.library.custom_op("selfspec::int4_gemv", mutates_args=())
def int4_gemv_op(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`int4_linear` as a custom op, for compiled code (as gemv_op)."""
    return int4_linear(x, q, sz, bias)


@int4_gemv_op.register_fake
def _(x, q, sz, bias):
    return x.new_empty(x.shape[0], q.shape[0])
