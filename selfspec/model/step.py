"""The lean step: one decoder-layer function over fused weights and the static, position-indexed
cache, run eagerly or compiled once per row bucket and shared by every layer, every drafter's
layer subset and the verify.

Why: the adapter's general path calls the HF modules one projection at a time and runs attention
one query row at a time; on a CPU that sits well above the memory floor (the weights streamed
once). Here a layer is three matrix products over fused weights (QKV, O, gate/up + down), one
fused norm each, and one attention call over the whole cache with a position mask, so the shapes
a layer sees depend only on the number of rows, never on the layer, the skip set or the context
length: `torch.compile` compiles it once per row bucket and reuses the code everywhere.

Weights are not copied: the fused QKV and gate/up tensors are the only storage, and the HF
modules' own `weight` parameters are re-pointed at views of them, so the HF model, the adapter's
general path and this step all read the same memory.

Rows are padded to a bucket (1, 2, 4, 8, 16, ...). Padding rows repeat the last real row and write
their keys and values to the cache's last slot, which no real row ever attends to.

Exactness: a matrix product over n rows need not round a row as the one-row product does (it
differs on some CPUs), so by default a verify's rows may differ from the AR steps' in the last
bits. With `exact_rows=E` every forward (AR step, draft, verify) runs the same E-row bucket, so
every row goes through the same kernels with the same shapes and reduction order whatever the
CPU or GPU, and greedy self-speculative output is bit-identical to AR by construction.

Where selfspec.native.fused_layer runs (eager, on CPUs with the kernel), decode forwards of up to
fused_layer.ROWS rows take it instead of `layer_forward`: one kernel call per layer, each row's
arithmetic its own, so every mode is exact by construction there and nothing is padded.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from selfspec.model import cuda_graphs, wide_product

from selfspec.native import fused_layer, gemv
from selfspec.native.fused_layer import norm_eps
from selfspec.model.quantize import Int4Linear, Int4Slice, Int8Linear, int4_linear, int8_linear

# A prompt of up to this many tokens prefills through the fused layer, 16 rows a call as a verify
# does, where PyTorch's bfloat16 GEMM is emulated (no AVX512-BF16 or AMX): there selfspec's kernel
# is faster for few rows (SmolLM2's whole prefill, Ice Lake Xeon, 2 threads: 0.54-0.70x at 36
# tokens, 0.91-1.34x at 64; scripts/prefill_chunks.py, results/intel_avx512/prefill_chunks.out).
# SELFSPEC_PREFILL_CHUNKS=N sets it, 0 turns it off.
PREFILL_CHUNKS = int(os.environ.get("SELFSPEC_PREFILL_CHUNKS", "40"))


def _chunks_pay(h: torch.Tensor, n: int, chunk: int) -> bool:
    """Whether n rows of h (more than one fused call takes) run faster as fused calls of `chunk`
    rows than PyTorch's path: always where 4-bit weights' products run many rows in tiles (chunk >
    fused_layer.ROWS: 0.83-0.97x the time of PyTorch's path with those tiles on the Qwen2.5-Coder
    models' bench prompts of 40-918 tokens, 2-core AMD EPYC; and each row gets a decode step's
    bits), else up to PREFILL_CHUNKS bfloat16 rows where the CPU emulates bfloat16 GEMMs."""
    if gemv.needs_grad(h):
        return False
    return chunk > fused_layer.ROWS or (n <= PREFILL_CHUNKS and h.dtype == torch.bfloat16
                                        and not gemv.native_bfloat16())


BUCKETS = (1, 2, 4, 8, 16)
DECODE_ROWS = BUCKETS[-1]
SPAN = 64  # attention spans are multiples of this many cache slots  # the most rows a draft or verify forward runs compiled
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def pad_rows(x: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    """x with copies of its last row (along `dim`) appended up to `rows`: finite padding that
    rounds like a real row and whose results are dropped."""
    n = x.shape[dim]
    if rows <= n:
        return x
    last = x.narrow(dim, n - 1, 1)
    return torch.cat([x, last.expand(*[rows - n if d == dim else -1 for d in range(x.dim())])], dim=dim)


def bucket(n: int) -> int:
    """The padded row count for n <= DECODE_ROWS rows: the smallest bucket that holds them."""
    return next(b for b in BUCKETS if n <= b)


@dataclass(frozen=True)
class Shape:
    """What the layer function specialises on: the same for every layer of a model."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    sandwich: bool  # Gemma 3: norms after attention and MLP too, and (1 + w) norm weights
    qk_norm: bool  # Qwen3, Gemma 3: per-head RMSNorm on q and k before rotary
    eps: float
    act: str
    transposed: bool  # float weights stored [in, out] (see transposed_layout)
    gemv: bool = False  # bfloat16, int8 and float32 products of <= gemv.MAX_ROWS rows through selfspec.native.gemv's kernel
    compiled: bool = False  # called from compiled code: the kernel as a custom op, all rows of the bucket
    # Attention takes the query heads that share a KV head as rows of one head: the same numbers as
    # grouped-query attention, but CPU flash attention runs a single bfloat16 query row slowly
    # (SmolLM2, one row: 45 against 93 µs a layer at 128 keys, 162 against 579 at 1024; equal from
    # 2 rows; float32 is fast either way; README, "The lean step"). The mask comes folded too.
    fold: bool = False


@dataclass
class LayerWeights:
    """One layer's tensors, all views of (or the same as) the HF modules' own parameters."""

    wqkv: torch.Tensor  # [q + 2·kv, hidden]
    bqkv: torch.Tensor | None  # [q + 2·kv] (Qwen2) or None
    wo: torch.Tensor  # [hidden, q]
    wgu: torch.Tensor  # [2·intermediate, hidden]: gate rows, then up rows
    wd: torch.Tensor  # [hidden, intermediate]
    norms: tuple[torch.Tensor, ...]  # input, post-attention (pre-norm) | input, post-attn, pre-ff, post-ff (sandwich)
    qk_norms: tuple[torch.Tensor, ...]  # (q_norm, k_norm) weights, or ()
    # Quantized weights (selfspec.model.quantize), for wqkv, wo, wgu, wd: int8's per-output-channel
    # scales, or int4's group scales and zeros (the w* are then packed uint8); else ().
    scales: tuple[torch.Tensor, ...] = ()


def unsupported_reason(adapter) -> str | None:
    """Why the lean step cannot run this model (None: it can). Such models keep the general path."""
    if adapter.layout not in ("pre-norm", "sandwich"):
        return f"layout {adapter.layout}"
    act = getattr(adapter.config, "hidden_activation", None) or getattr(adapter.config, "hidden_act", None)
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    for layer in adapter.layers:
        mlp = layer.mlp
        if not (hasattr(mlp, "down_proj") and (hasattr(mlp, "gate_up_proj") or hasattr(mlp, "gate_proj"))):
            return "a mixture-of-experts or non-gated MLP"
        if getattr(mlp.down_proj, "bias", None) is not None or getattr(layer.self_attn.o_proj, "bias", None) is not None:
            return "biases on the output projections"
    return None


def _share(modules_weights: list[tuple[torch.nn.Module, str]], transpose: bool = False) -> torch.Tensor:
    """Concatenate the named parameters of `modules` along dim 0 into one tensor and re-point each
    module's parameter at its view of it: one storage, no copy left behind. transpose: store the
    result as [in, out] (returned so), each module's [out, in] weight a transposed view of it."""
    parts = [getattr(m, name) for m, name in modules_weights]
    if any(p is None for p in parts):
        return None
    if len(parts) == 1 and not transpose:
        return parts[0].detach()
    fused = torch.cat([p.detach() for p in parts], dim=0)
    if transpose:
        fused = fused.t().contiguous()
    offset = 0
    for (m, name), p in zip(modules_weights, parts):
        size = p.shape[0]
        part = fused[:, offset : offset + size].t() if transpose else fused[offset : offset + size]
        getattr(m, name).data = part
        offset += size
    return fused


def transposed_layout(dtype: torch.dtype) -> bool:
    """Store float32 weights [in, out] when PyTorch's products run them: this CPU's float32
    one-row product x·W runs about twice as fast as x·Wᵀ over [out, in] (scripts/layout_bench.py;
    19.3 against 36.3 ms for SmolLM2's layers on a 2-core AMD EPYC). selfspec.native.gemv's kernel, where
    it runs, reads [out, in] rows; bfloat16 is as fast either way, and int8's kernel wants [out, in]."""
    return dtype == torch.float32 and not gemv.available()


def _int4_parts(module) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed weight and scales/zeros an int4 projection reads (a slice's: its fused matrix's)."""
    fused = module.fused if isinstance(module, Int4Slice) else module
    return fused.packed, fused.scales_zeros


def _fuse_int4(layer) -> tuple:
    """wqkv, bqkv, wo, wgu, wd and their scales for a layer quantized by quantize_int4, which
    already fused q/k/v and gate/up: nothing to concatenate, only to point at."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = mlp.gate_up_proj if hasattr(mlp, "gate_up_proj") else mlp.gate_proj
    bqkv = _share([(m, "bias") for m in qkv])  # None without biases
    parts = [_int4_parts(m) for m in (qkv[0], attn.o_proj, gate_up, mlp.down_proj)]
    (wqkv, _), (wo, _), (wgu, _), (wd, _) = parts
    return wqkv, bqkv, wo, wgu, wd, tuple(sz for _, sz in parts)


def fuse_layer(layer, sandwich: bool) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(attn.o_proj, Int4Linear):
        wqkv, bqkv, wo, wgu, wd, scales = _fuse_int4(layer)
        return LayerWeights(wqkv, bqkv, wo, wgu, wd, _norms(layer, sandwich), _qk_norms(attn), scales)
    quantized = isinstance(attn.o_proj, Int8Linear)
    t = transposed_layout(attn.o_proj.weight.dtype)
    scales = ()
    if hasattr(attn, "qkv_proj"):  # Phi-3: already fused
        wqkv, bqkv = _share([(attn.qkv_proj, "weight")], t), attn.qkv_proj.bias
        sqkv = getattr(attn.qkv_proj, "scale", None)
    else:
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        wqkv = _share([(p, "weight") for p in projections], t)
        bqkv = _share([(p, "bias") for p in projections]) if attn.q_proj.bias is not None else None
        sqkv = _share([(p, "scale") for p in projections]) if quantized else None
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: already fused, gate rows first
        wgu = _share([(mlp.gate_up_proj, "weight")], t)
        sgu = getattr(mlp.gate_up_proj, "scale", None)
    else:
        wgu = _share([(mlp.gate_proj, "weight"), (mlp.up_proj, "weight")], t)
        sgu = _share([(mlp.gate_proj, "scale"), (mlp.up_proj, "scale")]) if quantized else None
    wo, wd = _share([(attn.o_proj, "weight")], t), _share([(mlp.down_proj, "weight")], t)
    if quantized:
        scales = (sqkv, attn.o_proj.scale, sgu, mlp.down_proj.scale)
    return LayerWeights(wqkv, bqkv, wo, wgu, wd, _norms(layer, sandwich), _qk_norms(attn), scales)


def _norms(layer, sandwich: bool) -> tuple[torch.Tensor, ...]:
    if sandwich:
        return (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight)
    return layer.input_layernorm.weight, layer.post_attention_layernorm.weight


def _qk_norms(attn) -> tuple[torch.Tensor, ...]:
    return (attn.q_norm.weight, attn.k_norm.weight) if hasattr(attn, "q_norm") else ()


# -- the layer function: pure tensors in, tensors out (and the cache written in place) ---------

def _norm(x: torch.Tensor, w: torch.Tensor, eps: float, sandwich: bool) -> torch.Tensor:
    """Llama RMSNorm (statistics in float32, weight applied in the input dtype), or Gemma's
    (1 + w) norm computed in float32 throughout; both as the HF modules compute them."""
    if sandwich:
        return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * (1.0 + w.float())).to(x.dtype)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first rotary_dim features; x [heads, n, head_dim], cos/sin [n, rot]."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([_rotate(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = rot // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _linear(x: torch.Tensor, w: torch.Tensor, scales: tuple, i: int, shape: Shape, bias=None,
            live: int | None = None) -> torch.Tensor:
    """x · wᵀ (+ bias) for w [out, in]: float weights, int8 weights with their per-channel
    scales[i], or packed int4 weights with their group scales and zeros scales[i]; x · w for float
    weights stored [in, out] (shape.transposed). live: the rows before exact mode's padding."""
    live = x.shape[0] if live is None else live
    if (shape.gemv and live <= gemv.MAX_ROWS and w.dtype in (torch.bfloat16, torch.int8, torch.float32)
            and not gemv.needs_grad(x)):
        scale = scales[i] if scales else None
        if shape.compiled:  # the custom op, over every row of the bucket
            return torch.ops.selfspec.gemv(x, w, bias, scale)
        # Only the live rows, the padding rows' outputs copied from the last live one: no live
        # row reads a padding row (they attend and write only to the scratch slot), and each
        # row's result is the same whatever the row count (selfspec.native.gemv), so an exact-mode step
        # costs a one-row product.
        return gemv.linear(x[:live], w, bias, scale, rows_out=x.shape[0])
    transposed = shape.transposed
    if w.dtype == torch.uint8:  # int4: selfspec's 4-bit kernel for decode rows where it runs (quantize.int4_linear)
        if shape.compiled and w.dim() == 3 and x.shape[0] <= gemv.MAX_ROWS and x.dtype == torch.bfloat16:
            return torch.ops.selfspec.int4_gemv(x, w, scales[i], bias)
        return int4_linear(x, w, scales[i], bias, live)
    if scales:
        return int8_linear(x, w, scales[i], bias)
    if transposed:
        return x @ w if bias is None else torch.addmm(bias, x, w)
    return wide_product.linear(x, w, bias)


def layer_forward(
    h: torch.Tensor,  # [n, hidden]
    pos: torch.Tensor,  # [n] long: each row's cache slot
    mask: torch.Tensor | None,  # [n, L] bool: True = may attend to the cache's first L slots; None: causal over slots 0..n-1
    cos: torch.Tensor,  # [n, rotary_dim]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [kv_heads, capacity, head_dim], written in place
    v_cache: torch.Tensor,
    wqkv, bqkv, wo, wgu, wd,
    norms: tuple[torch.Tensor, ...],
    qk_norms: tuple[torch.Tensor, ...],
    scales: tuple[torch.Tensor, ...],
    shape: Shape,
    do_attn: bool,
    do_mlp: bool,
    live: int | None = None,  # rows before the padding (None: all; compiled code gets the bucket)
) -> torch.Tensor:
    n = h.shape[0]
    nh, nkv, hd = shape.n_heads, shape.n_kv_heads, shape.head_dim
    if do_attn:
        x = _norm(h, norms[0], shape.eps, shape.sandwich)
        qkv = _linear(x, wqkv, scales, 0, shape, bqkv, live)
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        v = v.view(n, nkv, hd).transpose(0, 1)  # [kv_heads, n, head_dim]
        if shape.qk_norm:
            q = _norm(q.view(n, nh, hd).transpose(0, 1), qk_norms[0], shape.eps, shape.sandwich)
            k = _norm(k.view(n, nkv, hd).transpose(0, 1), qk_norms[1], shape.eps, shape.sandwich)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        else:  # q and k rotated in one pass: the same arithmetic per element, half the small ops
            qk = _rotate(qkv[:, : (nh + nkv) * hd].view(n, nh + nkv, hd), cos[:, None], sin[:, None])
            q, k = qk[:, :nh].transpose(0, 1), qk[:, nh:].transpose(0, 1)  # [heads, n, head_dim]
        k_cache.index_copy_(1, pos, k)
        v_cache.index_copy_(1, pos, v)
        span, group = (n if mask is None else mask.shape[1]), nh // nkv
        k_span, v_span = k_cache[:, :span].unsqueeze(0), v_cache[:, :span].unsqueeze(0)
        if mask is None:  # a prefill from position 0 without a window: causal over its own rows
            o = F.scaled_dot_product_attention(q.unsqueeze(0), k_span, v_span, is_causal=True, scale=shape.scale,
                                               enable_gqa=group > 1)
        elif shape.fold:  # mask: already [group·n, span] (see LeanStep.run)
            o = F.scaled_dot_product_attention(q.reshape(1, nkv, group * n, hd), k_span, v_span,
                                               attn_mask=mask, scale=shape.scale)
        else:
            o = F.scaled_dot_product_attention(q.unsqueeze(0), k_span, v_span, attn_mask=mask, scale=shape.scale,
                                               enable_gqa=group > 1)
        a = _linear(o.view(nh, n, hd).transpose(0, 1).reshape(n, nh * hd), wo, scales, 1, shape, live=live)
        if shape.sandwich:
            a = _norm(a, norms[1], shape.eps, True)
        h = h + a
    if do_mlp:
        x = _norm(h, norms[2] if shape.sandwich else norms[1], shape.eps, shape.sandwich)
        gate, up = _linear(x, wgu, scales, 2, shape, live=live).chunk(2, dim=-1)
        m = _linear(ACTIVATIONS[shape.act](gate) * up, wd, scales, 3, shape, live=live)
        if shape.sandwich:
            m = _norm(m, norms[3], shape.eps, True)
        h = h + m
    return h


# -- compile ---------------------------------------------------------------------------------

def compile_cache_dir() -> str:
    """Inductor's on-disk cache, under selfspec's cache so that later runs load instead of compile."""
    from selfspec.native.build import cache_root

    path = cache_root() / "inductor"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


_NOTICE = {"said": False}
FIRST_COMPILE_S = 15  # roughly, for SmolLM2's row buckets on a 2-core CPU (3-12 s measured: README)


def compiled_layer(device_type: str, backend=None, graphs: bool = False):
    """`layer_forward` compiled: one graph per row bucket (and per attention/MLP combination),
    shared by every layer. On CUDA the graphs are captured (mode="reduce-overhead"), unless the
    caller captures whole forwards itself (graphs: selfspec.model.cuda_graphs). backend: another
    torch.compile backend (tests count compiles with one)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", compile_cache_dir())
    # Dynamo keys compiled code by the function, so every model in the process shares these
    # entries: row buckets × attention/MLP combinations × cache capacities × models.
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 256)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 1024)
    mode = "reduce-overhead" if device_type == "cuda" and not graphs else None
    if backend is not None:
        return torch.compile(layer_forward, backend=backend, dynamic=None)
    return torch.compile(layer_forward, mode=mode, dynamic=None)


class LeanStep:
    """Runs layer subsets of a model through `layer_forward` on one sequence's static cache."""

    def __init__(self, adapter, *, compile: bool = False, exact_rows: int | None = None, backend=None,
                 graph_factory=None):
        reason = unsupported_reason(adapter)
        if reason is not None:
            raise ValueError(f"the lean step does not support this model ({reason})")
        config = adapter.config
        sandwich = adapter.layout == "sandwich"
        norm0 = adapter.layers[0].input_layernorm
        eps = norm_eps(norm0, config.rms_norm_eps)
        self.shape = Shape(
            n_heads=adapter.n_heads, n_kv_heads=adapter.n_kv_heads, head_dim=adapter.head_dim,
            scale=float(adapter.scale), sandwich=sandwich, qk_norm=hasattr(adapter.layers[0].self_attn, "q_norm"),
            eps=float(eps),
            act=getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None),
            transposed=transposed_layout(adapter.dtype),
            gemv=adapter.device.type == "cpu" and adapter.dtype in gemv.WEIGHTS and gemv.available(),
            compiled=compile,
            fold=adapter.n_heads > adapter.n_kv_heads and adapter.dtype != torch.float32,
        )
        self.adapter = adapter
        self.weights = [fuse_layer(layer, sandwich) for layer in adapter.layers]
        self.compile = compile
        self.exact_rows = exact_rows
        # Exact mode's decode forwards as CUDA graphs (on CUDA; graph_factory: a stand-in, tests).
        graphs = exact_rows is not None and (graph_factory is not None or cuda_graphs.enabled(adapter.device))
        self.graphs = cuda_graphs.StepGraphs(self, graph_factory or cuda_graphs.CudaGraph) if graphs else None
        # Captured by those graphs, the compiled code must not capture graphs of its own.
        self._fn = compiled_layer(adapter.device.type, backend, graphs=self.graphs is not None) if compile else layer_forward
        self._seen: set[tuple[int, bool, bool]] = set()
        # Decode forwards of up to fused_layer.ROWS rows as one kernel call per layer, where it runs.
        self.fused = fused_layer.FusedLayers(self) if fused_layer.unsupported_reason(self) is None else None
        # Every prefill through the fused layer, 16 rows a call, as verifies run: each position's
        # keys and values then depend on its token and the ones before it alone (a prefix store's
        # reuse is exact: selfspec.model.prefix_cache).
        self.rowwise_prefill = False

    def runs_rowwise(self, n: int) -> bool:
        """Whether a forward of n rows (without a gradient) runs through the fused layer, each row's
        bits its own: up to its ROWS in one call, and, while rowwise_prefill, more in calls of ROWS."""
        return self.fused is not None and (n <= fused_layer.ROWS or self.rowwise_prefill)

    def rows(self, n: int) -> int:
        """The row bucket n rows run in. More rows than any decode forward has (a prefill) run
        eagerly, unpadded: AR and speculation prefill alike, so that costs no exactness."""
        if self.exact_rows is not None:
            return self.exact_rows if n <= self.exact_rows else n
        return bucket(n) if self.compile and n <= DECODE_ROWS else n

    def run(self, h: torch.Tensor, layers, start: int, cache, skip, siblings: bool = False,
            verify: bool = False) -> torch.Tensor:
        """h [1, n, hidden] at positions start .. start+n-1 through `layers` (minus skipped
        sublayers), writing their KV into `cache` (see ModelAdapter.run_layers). verify: a verify
        (run_layers' rowwise): where the fused layer runs, more rows than a call takes run in calls
        of ROWS, each row a one-row step's bits, so exact mode verifies a draft of any length."""
        layers = list(layers)
        if not layers:  # early exit's draft runs no layer after its exit: nothing to pad or mask
            return h
        n = h.shape[1]
        slot = cache.capacity - 1  # the scratch slot padding rows write to
        if start + n > slot:
            raise IndexError(f"KV cache holds {slot} positions; a write up to {start + n} does not fit")
        if self.fused is not None and n <= fused_layer.ROWS and not gemv.needs_grad(h):  # no padding there
            return self.fused.run(h, layers, start, cache, skip, siblings)
        chunked = self.runs_rowwise(n) or (self.fused is not None and (verify or _chunks_pay(h, n, self.fused.chunk)))
        if chunked and not siblings and not gemv.needs_grad(h):  # in calls of ROWS (4-bit weights: more), as verifies
            # A verify's rows in calls of ROWS (the 4-bit tiles pay for a prefill's many rows, not for
            # a draft's: 20 rows of the 0.5B 9.1 one-row steps in one call, 5.8 in calls of 16).
            rows = fused_layer.ROWS if verify else self.fused.chunk
            return torch.cat([self.fused.run(h[:, i:i + rows], layers, start + i, cache, skip)
                              for i in range(0, n, rows)], dim=1)
        if siblings:
            raise ValueError("sibling rows run only in the fused layer (ModelAdapter.runs_siblings)")
        rows = self.rows(n)
        # Attend to the first `span` slots: all of them in exact mode (CPU attention kernels round
        # a row differently for different key lengths, even with the extra keys masked, so a row
        # must see one length in every forward: the cache's capacity, which exact mode makes the
        # same for every method), else the context rounded up, so that the attention reads what it
        # needs and compiled code sees few lengths (the length is a dynamic dimension).
        span = cache.capacity if self.exact_rows is not None else min(cache.capacity, -(-(start + n) // SPAN) * SPAN)
        if self.graphs is not None and rows == self.exact_rows:  # every decode forward of exact mode
            try:
                return self.graphs.run(h, layers, start, cache, skip, rows,
                                       lambda x, pos, c: self._forward(x, pos, layers, c, skip, span, False, rows))
            except cuda_graphs.CaptureFailed as err:
                # Eager forwards launch the kernels a replay would: the output stays AR's.
                warnings.warn(f"selfspec: a decode forward could not be captured as a CUDA graph ({err}); this model "
                              "decodes without graphs (slower on a GPU, same output)", stacklevel=2)
                self.graphs = None
        x = pad_rows(h[0], rows)
        pos = torch.arange(start, start + rows, device=x.device)
        pos[n:] = slot
        # A prefill from position 0 attends causally over its own rows: no mask (None) for layers
        # without a window, and PyTorch's flash kernel (~1.4x faster than a masked one over 997
        # rows: scripts/kernel_timings.py). AR and speculation prefill alike: no exactness lost.
        causal = start == 0 and rows == n
        return self._forward(x, pos, layers, cache, skip, span, causal, n if self.shape.gemv else rows)[:n].unsqueeze(0)

    def _forward(self, x: torch.Tensor, pos: torch.Tensor, layers: list[int], cache, skip, span: int, causal: bool,
                 live: int) -> torch.Tensor:
        """x [rows, hidden] at cache slots pos [rows] through `layers`, attending to the cache's
        first `span` slots (causal: a prefill from slot 0, unmasked where no window applies).
        Depends on nothing else that changes between calls: CUDA graphs replay it (cuda_graphs)."""
        rows = x.shape[0]
        kv_pos = torch.arange(span, device=x.device)
        # The row count is a bucket: never let dynamo turn it into a dynamic size (each tensor
        # that carries the rows is marked static once, the hidden state after every layer).
        compiled = self.compile and (rows in BUCKETS or rows == self.exact_rows)
        static = torch._dynamo.mark_static if compiled else (lambda t, dim: None)
        static(pos, 0)
        masks = {None: None} if causal and not compiled else {}
        ropes = {}
        for i in layers:
            spec = self.adapter.specs[i]
            if spec.window not in masks:
                allowed = kv_pos.view(1, -1) <= pos.view(-1, 1)
                if spec.window is not None:
                    allowed &= kv_pos.view(1, -1) > pos.view(-1, 1) - spec.window
                if self.shape.fold:  # one row per query head of a KV group (see Shape.fold)
                    allowed = allowed.repeat(self.shape.n_heads // self.shape.n_kv_heads, 1)
                static(allowed, 0)
                if compiled:
                    torch._dynamo.maybe_mark_dynamic(allowed, 1)  # exact mode: the span is the whole cache
                masks[spec.window] = allowed
            if spec.rope not in ropes:
                cos, sin = self.adapter.rope_tables()[spec.rope]
                ropes[spec.rope] = (cos[pos], sin[pos])
                static(ropes[spec.rope][0], 0)
                static(ropes[spec.rope][1], 0)
            do_attn, do_mlp = i not in skip.attn, i not in skip.mlp
            if not (do_attn or do_mlp):
                continue
            w = self.weights[i]
            if compiled:
                self._note_compile(rows, do_attn, do_mlp)
                static(x, 0)
            x = (self._fn if compiled else layer_forward)(
                x, pos, masks[spec.window], *ropes[spec.rope], cache.keys[i, 0], cache.values[i, 0],
                w.wqkv, w.bqkv, w.wo, w.wgu, w.wd, w.norms, w.qk_norms, w.scales, self.shape, do_attn, do_mlp, live,
            )
            if cache.exit_layer == i + 1:  # h_k, beside layer k-1's keys (see KVCache); padding to the scratch slot
                cache.write_exit_states(pos, x)
        return x

    def _note_compile(self, rows: int, do_attn: bool, do_mlp: bool) -> None:
        """Say once per process, before the first compile, what is happening and for how long."""
        key = (rows, do_attn, do_mlp)
        if key in self._seen:
            return
        self._seen.add(key)
        if not _NOTICE["said"]:
            _NOTICE["said"] = True
            print(f"selfspec: compiling the decode step for this machine, once (cached in {compile_cache_dir()}; "
                  f"up to ~{FIRST_COMPILE_S} s the first time on 2 cores, a few seconds later)",
                  file=sys.stderr, flush=True)
