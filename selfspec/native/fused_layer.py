"""A whole decoder layer in one call to the kernel library (`kernels/layer.cpp`), for decode
forwards of up to ROWS rows on a CPU.

Why: with the products at the kernel's speed (selfspec.native.gemv), what kept the eager lean step at
twice the memory floor was ~35 small PyTorch ops per layer (norms, casts, rotary, the cache write,
attention, activation, residuals), about 5 µs each: over 1,000 a SmolLM2 step, ~5 of its 16 ms.
Here they are a few loops of C++ between the products, and a layer is one call of the op
`fused_layer` (kernels/ops.cpp, which checks every tensor before the kernel sees it).

Exactness by construction: each row's arithmetic is its own, in one fixed order, whatever the
number of rows in the call or the thread count (products four rows at a time as selfspec.native.gemv,
attention one row and head at a time over that row's own keys). So every decode forward (AR step,
draft, verify of up to ROWS rows) gives a row the same bits, with no padding to a row bucket; the
prefill (more rows) runs PyTorch's path, the same for AR and speculation, except with 4-bit weights
whose products run many rows in tiles (AVX512-VNNI): those prefill here too, INT4_ROWS rows a call,
each row a decode step's bits.

Where it runs: pre-norm (Llama, Qwen2, Qwen3) and sandwich (Gemma 3) layers with SiLU or tanh-GELU,
rotary over the whole head, bfloat16, int8, float32 or int4 weights (selfspec's 4-bit blocks,
kernels/quant4.h), eager (compiled code keeps `layer_forward`). int4 in PyTorch's int4pack layout,
partial rotary and other layouts keep `layer_forward`.
SELFSPEC_FUSED=0 turns it off (the tests compare both).
"""

from __future__ import annotations

import os

import torch

from selfspec.native import gemv

ROWS = gemv.MAX_ROWS  # the most rows a fused call takes; more (a prefill) run PyTorch's path
INT4_ROWS = 256  # with 4-bit weights (entry.h's INT4_LAYER_ROWS): a prefill's chunk, through the 4-bit many-row tiles
DTYPES = {torch.bfloat16: 0, torch.int8: 1, torch.float32: 2, torch.uint8: 3}  # weight dtype -> the kernel's code (uint8: 4-bit blocks)
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}


def unsupported_reason(step) -> str | None:
    """Why `step` (a LeanStep) cannot run fused (None: it can)."""
    shape, adapter = step.shape, step.adapter
    if os.environ.get("SELFSPEC_FUSED", "1") == "0":
        return "SELFSPEC_FUSED=0"
    if step.compile or not shape.gemv or shape.transposed:
        return "compiled, or no product kernel on this machine"
    if shape.act not in ACTS:
        return f"activation {shape.act}"
    w = step.weights[0]
    blocks = w.wqkv.dtype == torch.uint8 and w.wqkv.dim() == 3 and adapter.dtype == torch.bfloat16
    if w.wqkv.dtype == torch.uint8 and not blocks:
        return "int4 weights in PyTorch's int4pack layout (the fused layer takes selfspec's 4-bit blocks)"
    if not blocks and (w.wqkv.dtype not in DTYPES or w.wqkv.dtype not in gemv.WEIGHTS.get(adapter.dtype, ())):
        return f"{w.wqkv.dtype} weights with {adapter.dtype} activations"
    if any(cos.shape[-1] != shape.head_dim or cos.dtype != adapter.dtype or not cos.is_contiguous()
           for cos, _ in adapter.rope_tables().values()) or shape.head_dim % 16:
        return "partial rotary or a head size that is not a multiple of 16"
    if w.wo.shape[0] % 8 or (w.wd.shape[1] * 32 if blocks else w.wd.shape[1]) % 8:
        return "a hidden or MLP size that is not a multiple of 8"
    if any(t is not None and not t.is_contiguous() for lw in step.weights
           for t in (lw.wqkv, lw.wo, lw.wgu, lw.wd, lw.bqkv, *lw.scales, *lw.norms, *lw.qk_norms)):
        return "non-contiguous weights"
    return None


class FusedLayers:
    """The kernel's view of a LeanStep's fused weights: one list of tensors per layer (entry.h's
    Weights, None where a layer has none), built once; the op checks them on every call."""

    def __init__(self, step):
        shape, adapter = step.shape, step.adapter
        self._op = gemv._STATE["lib"].fused_layer.default
        self._rows_op = gemv._STATE["lib"].fused_rows.default
        self.adapter = adapter
        self.shape = shape
        self.act = ACTS[shape.act]
        self.weights = []
        for lw in step.weights:
            scales = list(lw.scales) or [None] * 4
            norms = list(lw.norms) if shape.sandwich else [lw.norms[0], None, lw.norms[1], None]
            q_norm, k_norm = lw.qk_norms or (None, None)
            self.weights.append([lw.wqkv, lw.bqkv, lw.wo, lw.wgu, lw.wd, *scales, *norms, q_norm, k_norm])
        # Rows a call of a longer forward (a prefill run row by row) takes: with 4-bit weights where
        # their products run many rows in register tiles (AVX512-VNNI), INT4_ROWS; else ROWS.
        blocks = step.weights[0].wqkv.dtype == torch.uint8
        self.chunk = INT4_ROWS if blocks and gemv.int4_vnni(gemv.kernel_path()) else ROWS

    def run(self, h: torch.Tensor, layers, start: int, cache, skip, siblings: bool = False) -> torch.Tensor:
        """h [1, n, hidden] (n <= ROWS) through `layers` at positions start .., as LeanStep.run.
        siblings: rows 1.. are alternatives for position start+1, written to slots start+1 ..
        start+n-1 and each attending to positions <= start and itself (kernels/layer.h)."""
        adapter, shape, op = self.adapter, self.shape, self._op
        x = h[0].clone(memory_format=torch.contiguous_format)  # [n, hidden], updated in place layer by layer
        keys, values = cache.keys, cache.values  # [layer, 1, kv_heads, capacity, head_dim]
        tables = adapter.rope_tables()
        for i in layers:
            spec = adapter.specs[i]
            do_attn, do_mlp = i not in skip.attn, i not in skip.mlp
            if do_attn or do_mlp:
                cos, sin = tables[spec.rope]
                op(x, self.weights[i], cos, sin, keys, values, i, shape.n_heads, self.act, shape.sandwich,
                   shape.qk_norm, shape.eps, shape.scale, start, spec.window or 0, do_attn, do_mlp, siblings)
            if cache.exit_layer == i + 1:  # h_k, beside layer k-1's keys (see KVCache)
                cache.write_exit_states(start, x)
        return x.unsqueeze(0)

    def run_ragged(self, x: torch.Tensor, layers, starts: list[int], counts: list[int], caches: list) -> torch.Tensor:
        """x [sum(counts), hidden]: counts[b] rows of sequence b in turn, at positions starts[b].. of
        its own cache caches[b] (a batched verify whose drafts differ in length, unpadded). Sequences
        share calls of up to ROWS rows (`calls`); one of more rows runs alone, chunked as `run_rows`
        chunks it. Each row is its sequence's one-sequence call's bit for bit (kernels/layer.h)."""
        hidden, out, offsets = x.shape[-1], [], [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        for group in calls(counts, ROWS):
            lo, hi = offsets[group[0]], offsets[group[-1] + 1]
            if len(group) == 1 and counts[group[0]] > ROWS:
                b = group[0]
                out.append(self.run_rows(x[None, lo:hi], layers, [starts[b]], [caches[b]])[0])
                continue
            part = x[lo:hi].clone(memory_format=torch.contiguous_format)
            self._layers_over(part, layers, [starts[b] for b in group], [counts[b] for b in group],
                              [caches[b] for b in group])
            out.append(part)
        return torch.cat(out) if len(out) > 1 else out[0]

    def _layers_over(self, x: torch.Tensor, layers, starts: list[int], counts: list[int], caches: list) -> None:
        """x [sum(counts), hidden] in place through `layers`: one call of the op a layer."""
        adapter, shape, op, tables = self.adapter, self.shape, self._rows_op, self.adapter.rope_tables()
        keys, values = [c.keys for c in caches], [c.values for c in caches]
        for layer in layers:
            spec = adapter.specs[layer]
            cos, sin = tables[spec.rope]
            op(x, self.weights[layer], cos, sin, keys, values, starts, counts, layer, shape.n_heads, self.act,
               shape.sandwich, shape.qk_norm, shape.eps, shape.scale, spec.window or 0, True, True)
            row = 0
            for start, n, cache in zip(starts, counts, caches):
                if cache.exit_layer == layer + 1:  # h_k, beside layer k-1's keys (see KVCache)
                    cache.write_exit_states(start, x[row:row + n])
                row += n

    def run_rows(self, h: torch.Tensor, layers, starts: list[int], caches: list) -> torch.Tensor:
        """h [B, n, hidden]: row b at positions starts[b].. of its own cache caches[b] (a batched
        verify), as many sequences a call as ROWS rows hold; more than ROWS rows a sequence in chunks
        of ROWS, each through every layer before the next, as LeanStep.run chunks one sequence.
        Each row is its sequence's one-sequence call's (`run`) bit for bit (kernels/layer.h,
        layer_spans)."""
        b, n, hidden = h.shape
        if n > ROWS:
            return torch.cat([self.run_rows(h[:, i:i + ROWS], layers, [s + i for s in starts], caches)
                              for i in range(0, n, ROWS)], dim=1)
        per_call = max(1, ROWS // n)
        out = []
        for g in range(0, b, per_call):
            group = range(g, min(b, g + per_call))
            x = h[g:g + len(group)].reshape(-1, hidden).clone(memory_format=torch.contiguous_format)
            self._layers_over(x, layers, [int(starts[i]) for i in group], [n] * len(group), [caches[i] for i in group])
            out.append(x.view(len(group), n, hidden))
        return torch.cat(out) if len(out) > 1 else out[0]


def calls(counts: list[int], limit: int) -> list[list[int]]:
    """Sequences (by index) with counts[b] rows each, in order, into the fused calls of a ragged
    batched verify (`FusedLayers.run_ragged`): consecutive sequences while their rows fit `limit`;
    a sequence of more rows than that alone (its own calls chunk it)."""
    groups, rows = [], limit + 1
    for b, n in enumerate(counts):
        if rows + n > limit or n > limit:
            groups.append([])
            rows = 0
        groups[-1].append(b)
        rows += n
    return groups


def norm_eps(norm, default: float) -> float:
    """An RMS norm module's epsilon (HF's `variance_epsilon`, or torch's and Gemma's `eps`), else default."""
    return getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or default
