"""Weight-only quantization. int8: each decoder layer's linear weights and the LM head as int8 with
one scale per output channel, multiplied by selfspec's product kernel (selfspec.native.gemv) where it runs,
else by PyTorch's own int8 weight-only kernel (`_weight_int8pack_mm`).

Activations stay in the model's float dtype (bfloat16); a matrix product reads a quarter of the
float32 bytes, which is what a memory-bound decode step costs. (On CPUs with AVX512-VNNI and no
AVX512-BF16 the kernel multiplies each activation row as int16, exactly; see kernels/product.h.)
The head is int8 too, a copy where it is tied to the embedding (as in the bundled models);
embeddings and norms keep their float weights. Draft and verify run the same quantized model, so
self-speculative output stays identical to this int8 model's own AR output; it is not float32's
output.
"""

from __future__ import annotations

import functools
import os

import torch

from selfspec.model import wide_product
from selfspec.native import gemv

# The activation dtype int8 weights run with: the kernel takes bfloat16 or float32 inputs, and
# bfloat16 keeps the activations' bytes small too.
ACTIVATION_DTYPE = torch.bfloat16


class Int8Linear(torch.nn.Module):
    """y = x · (w_int8 · scale)ᵀ + bias, w_int8 [out, in] int8, scale [out] in x's dtype."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, dtype: torch.dtype) -> "Int8Linear":
        q, scale = int8_rows(linear.weight, dtype)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls(q, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.scale, self.bias)


PREFILL_ROWS = 32  # from this many rows, int8 products dequantize and run a bfloat16 GEMM


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.shape[0] >= PREFILL_ROWS and x.dtype == torch.bfloat16:
        # A prefill: PyTorch's int8 kernel takes 24 ms for 1,000 rows of SmolLM2's gate/up where
        # dequantizing and a bfloat16 GEMM take 10 (scripts/kernel_timings.py, 2-core AMD EPYC).
        # AR and speculation prefill alike.
        # Where bfloat16 is emulated (AVX2 only) the GEMM runs in float32 (selfspec.model.wide_product).
        y = wide_product.linear(rows, weight) * scale
    else:
        y = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), weight, scale)
    y = y.view(*shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def quantize_int8(hf_model: torch.nn.Module) -> int:
    """Replace every nn.Linear inside the decoder layers, and the LM head, by an Int8Linear, in
    place (the model must already be in ACTIVATION_DTYPE). Returns how many decoder-layer
    projections were replaced. The head is a fifth of SmolLM2-135M's weights and a third of its
    int8 bytes with a bfloat16 head; int8 halves its stream, as int4 models' head already is. A
    tied embedding holds the int8 head's values, an untied one its own int8 rows
    (`quantize_embedding`)."""
    if hf_model.dtype != ACTIVATION_DTYPE:
        raise ValueError(f"load the model in {ACTIVATION_DTYPE} before quantizing it to int8, not {hf_model.dtype}")
    tied = _tied(hf_model)
    count = 0
    for layer in hf_model.model.layers:
        for name, module in list(layer.named_modules()):
            if isinstance(module, torch.nn.Linear):
                parent_name, _, child = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                setattr(parent, child, Int8Linear.from_linear(module, ACTIVATION_DTYPE))
                count += 1
    int8_head(hf_model, tied)
    hf_model.train(hf_model.training)  # the new modules in the model's mode (eval, as loaded)
    return count


def int8_head(hf_model: torch.nn.Module, tied: bool) -> None:
    """The LM head as an Int8Linear, the embedding's int8 rows (`quantize_embedding`), and the
    head's screen (selfspec.model.head_screen: greedy steps then read a 4-bit copy of it and the
    few int8 rows that could win) where selfspec's 4-bit kernel builds and the head has no bias."""
    from selfspec.model.head_screen import HeadScreen

    head = hf_model.lm_head = Int8Linear.from_linear(hf_model.lm_head, ACTIVATION_DTYPE)
    quantize_embedding(hf_model, tied)
    if (gemv.available() and head.weight.device.type == "cpu" and head.bias is None
            and head.in_features % 32 == 0 and head.out_features % 16 == 0):
        head.screen = HeadScreen.of(head.weight, head.scale)


def _tied(hf_model: torch.nn.Module) -> bool:
    """Whether the LM head is the input embedding's table (the bundled models' heads are)."""
    head, embedding = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    return (isinstance(head, torch.nn.Linear) and embedding is not None
            and head.weight.data_ptr() == embedding.weight.data_ptr())


EMBEDDING_INT8 = "_selfspec_embedding_int8"  # on a quantized model: its embedding table as (int8 rows, scales)


def int8_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A table's rows as int8 with one scale each (in `dtype`), symmetric: the largest |w| of each
    row maps to 127 (Int8Linear's weights and the quantized modes' embedding)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.to(dtype)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: int = 8192) -> torch.Tensor:
    """int8 rows times their scales as `dtype`, each value rounded once (the product is exact in
    float32), a block of rows at a time (a float32 copy of a 151,936-token table is 0.9 GB)."""
    out = torch.empty(q.shape, dtype=dtype)
    for start in range(0, q.shape[0], rows):
        block = slice(start, start + rows)
        out[block] = (q[block].float() * scale[block].float()[:, None]).to(dtype)
    return out


def quantize_embedding(hf_model: torch.nn.Module, tied: bool) -> None:
    """The quantized modes' embedding: its table rounded to int8 rows (the int8 head's own where
    the head was tied to it), held as bfloat16 for the lookups and kept as (int8, scales) on the
    model, which is what selfspec.model.quantized_cache stores: Qwen2.5-Coder 1.5B's int4 file
    drops from 1.52 to 1.29 GB. Each value moves by at most about one int8 step of its row (1/127
    of its largest |value|)."""
    embedding = hf_model.get_input_embeddings()
    head = hf_model.lm_head
    q, scale = (head.weight, head.scale) if tied else int8_rows(embedding.weight, embedding.weight.dtype)
    with torch.no_grad():
        embedding.weight.copy_(dequantize_rows(q, scale, embedding.weight.dtype))
    setattr(hf_model, EMBEDDING_INT8, (q, scale))


def weight_bytes(hf_model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the decoder layers' weights and of the LM head: what one full step must read (an
    int8 head's screen, selfspec.model.head_screen, not counted: a greedy step reads its 4-bit copy
    instead of the head while it pays)."""
    layers = sum(p.numel() * p.element_size() for p in hf_model.model.layers.parameters())
    screen = getattr(hf_model.lm_head, "screen", None)
    own = {id(p) for p in screen.parameters()} if screen is not None else set()
    head = sum(p.numel() * p.element_size() for p in hf_model.lm_head.parameters() if id(p) not in own)
    return {"layers": layers, "head": head}


# -- int4 ---------------------------------------------------------------------------------------
#
# int4 weight-only: each decoder-layer weight as 4-bit integers in groups of INT4_GROUP inputs,
# multiplied by selfspec's 4-bit kernel (selfspec.native.gemv.int4_linear and the fused layer, the
# "blocks" layout, the default where selfspec's kernels build: integer dot products with x as int8 in
# blocks of 32, a row's result the same whatever the rows beside it, so exact mode verifies up to 16
# rows unpadded) or by PyTorch's own CPU kernel (`_weight_int4pack_mm_for_cpu`, the "int4pack"
# layout, elsewhere, or with $SELFSPEC_INT4_LAYOUT=int4pack). The blocks layout keeps llama.cpp's
# Q4_K idea: a block of 32 is w = q · scale - minimum, its scale and minimum 8-bit codes on
# bfloat16 steps shared by the 16 blocks of a group (pack_scales), 4.59 bits a weight (GGUF Q4_1's
# grid, a bfloat16 scale and zero a block, is 5; Q4_K's is 4.5). The LM head goes int8 (one scale per row;
# the GGUF keeps it at 6 bits) unless asked for in 4 bits, and so do the embedding's rows (looked up
# in bfloat16).
#
# PyTorch's packing is not separable by output rows, so projections that read the same input
# (q, k, v; gate, up) are quantized as one fused matrix. The HF modules become slices of it: the
# first slice called with an input computes the fused product, its siblings reuse it.

INT4_GROUP = 32


def default_int4_layout() -> str:
    """The layout Int4Linear.quantize picks: $SELFSPEC_INT4_LAYOUT if set ("int4pack" keeps
    PyTorch's kernel, for A/B), else "blocks" where selfspec's kernels build (the fused layer runs
    them: Qwen2.5-Coder-1.5B's step took 88 ms of one thread's time against int4pack's 159 on an
    AMD EPYC, docs/performance.md), else "int4pack"."""
    layout = os.environ.get("SELFSPEC_INT4_LAYOUT") or "blocks"
    return layout if layout != "blocks" or gemv.available() else "int4pack"


class Int4Linear(torch.nn.Module):
    """y = x · Wᵀ (+ bias), W [out, in] as 4-bit groups of 32, in one of two layouts (`layout`):

    "blocks": packed [out, in / 32, 16] uint8 (a row's blocks interleaved in groups of 16:
    to_groups) and scales_zeros [out, groups, RECORD] uint8, each group's scale and minimum codes
    and steps (pack_scales), selfspec's 4-bit product kernel's (selfspec.native.gemv.int4_linear),
    where that kernel runs; decode forwards of up to gemv.MAX_ROWS rows stream them once, prefills
    dequantize them for a GEMM.
    "int4pack": packed [out, in / 2] uint8 and scales_zeros [in / 32, out, 2] bfloat16 (a scale and
    zero a block), PyTorch's `_weight_int4pack_mm_for_cpu`'s, elsewhere. The two round a block's
    scale differently, so they hold near but not equal weights."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.packed = torch.nn.Parameter(packed, requires_grad=False)
        self.scales_zeros = torch.nn.Parameter(scales_zeros, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.out_features = packed.shape[0]
        self.in_features = packed.shape[1] * (32 if packed.dim() == 3 else 2)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, output) for Int4Slice

    @property
    def layout(self) -> str:
        return "blocks" if self.packed.dim() == 3 else "int4pack"

    @classmethod
    def quantize(cls, w: torch.Tensor, dtype: torch.dtype, bias=None, group: int = INT4_GROUP,
                 layout: str | None = None) -> "Int4Linear":
        """layout: "blocks" or "int4pack" (see the class); None: default_int4_layout() for groups
        of 32 ("blocks" needs selfspec's kernel and groups of 32), else "int4pack"."""
        out, inp = w.shape
        if out % 16 or inp % group:
            raise ValueError(f"int4 needs output sizes divisible by 16 and input sizes by {group}; this model has a "
                             f"{out}x{inp} projection (use --dtype int8)")
        if layout is None:
            layout = default_int4_layout() if group == 32 else "int4pack"
        g = w.detach().float().view(out, inp // group, group)
        bias = None if bias is None else bias.detach().to(dtype)
        if layout == "blocks":
            if group != 32:
                raise ValueError(f"the blocks layout takes groups of 32, not {group}")
            q, sz = quantize_blocks(g)
            # byte i of a block: element i in the low nibble, element i + 16 in the high one (GGUF's
            # order), then a row's blocks interleaved in groups for the kernel (to_groups)
            return cls(to_groups(q[..., :16] | (q[..., 16:] << 4)), sz, bias)
        if layout != "int4pack":
            raise ValueError(f"layout must be 'blocks' or 'int4pack', got {layout!r}")
        low, high = g.amin(-1), g.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-8).to(dtype)
        zero = (low + 8 * scale.float()).to(dtype)  # (0 - 8)·scale + zero = the group's minimum
        q = torch.round((g - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(out, inp).to(torch.int32).contiguous(), 1)
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [in / group, out, 2]
        return cls(packed, scales_zeros, bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] (a new tensor: for pruned heads and checks, not decoding)."""
        if self.layout == "blocks":
            return dequantize_blocks(self.packed, self.scales_zeros).to(ACTIVATION_DTYPE)  # the blocks run bfloat16 activations
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype, device=self.packed.device)
        return int4_linear(eye, self.packed, self.scales_zeros).t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, self.packed, self.scales_zeros, self.bias)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x), computed once for consecutive calls with the same input tensor."""
        if self._last is None or self._last[0] is not x:
            self._last = (x, self.forward(x))
        return self._last[1]


class Int4Slice(torch.nn.Module):
    """Output features [start, stop) of a fused Int4Linear, plus this projection's own bias."""

    def __init__(self, fused: Int4Linear, start: int, stop: int, bias: torch.Tensor | None):
        super().__init__()
        self.fused, self.start, self.stop = fused, start, stop
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = fused.in_features, stop - start

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.weight[self.start:self.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fused.shared(x)[..., self.start:self.stop]
        return y if self.bias is None else y + self.bias


GROUP = 16  # blocks a group of the blocks layout (kernels/quant4.h)
RECORD = 2 * GROUP + 6  # bytes of a group's scales: 16 scale codes, 16 minimum codes, three bfloat16s


def pack_scales(scale_codes: torch.Tensor, min_codes: torch.Tensor, scale_step: torch.Tensor,
                min_step: torch.Tensor, min_base: torch.Tensor) -> torch.Tensor:
    """The blocks layout's scales [out, groups, RECORD] uint8 (kernels/quant4.h): per group of GROUP
    blocks, each block's scale code, then each one's minimum code (uint8 [out, blocks]; a part-filled
    last group's codes padded with zeros), then the group's scale step, minimum step and minimum base
    (bfloat16 [out, groups]): a block's scale is its code times the scale step, its minimum its code
    times the minimum step plus the base."""
    out, blocks = scale_codes.shape
    groups = -(-blocks // GROUP)
    pad = groups * GROUP - blocks

    def codes(c):
        return torch.nn.functional.pad(c.to(torch.uint8), (0, pad)).view(out, groups, GROUP)

    steps = torch.stack([scale_step, min_step, min_base], -1).to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([codes(scale_codes), codes(min_codes), steps.view(out, groups, 6)], -1).contiguous()


def block_scales(sz: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's (scale, minimum), float32 [out, blocks], from pack_scales' records: the scale
    exact (an 8-bit code times a bfloat16 has at most 16 significant bits), the minimum that exact
    product plus the base, rounded once (as the kernels' one FMA)."""
    out = sz.shape[0]
    steps = sz[..., 2 * GROUP:].contiguous().view(torch.bfloat16)  # [out, groups, 3]

    def codes(first):
        return sz[..., first:first + GROUP].reshape(out, -1)[:, :blocks].float()

    scale = codes(0) * _per_block(steps[..., 0], blocks)
    return scale, codes(GROUP) * _per_block(steps[..., 1], blocks) + _per_block(steps[..., 2], blocks)


def _per_block(per_group: torch.Tensor, blocks: int) -> torch.Tensor:
    """A value per group [out, groups] as float32 per block [out, blocks]."""
    return per_group.float().repeat_interleave(GROUP, 1)[:, :blocks]


def _bfloat16_up(v: torch.Tensor) -> torch.Tensor:
    """v (float32) rounded up to a bfloat16 (toward +inf)."""
    b = v.to(torch.bfloat16)
    return torch.where(b.float() < v, (v + v.abs() / 256).to(torch.bfloat16), b)


def _bfloat16_down(v: torch.Tensor) -> torch.Tensor:
    """v (float32) rounded down to a bfloat16 (toward -inf)."""
    return -_bfloat16_up(-v)


def quantize_blocks(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [out, blocks, 32] (float32) to 4-bit codes q [out, blocks, 32] uint8 and pack_scales'
    records: a block's grid runs from its minimum to its maximum in 15 steps; its scale becomes an
    8-bit code of its group's largest scale over 255 (1..255), its minimum an 8-bit code over the
    group's span of minimums (steps rounded up and the base down to bfloat16, so codes stay in
    range), and q is rounded against the coded scale and minimum."""
    out, blocks, _ = g.shape
    groups = -(-blocks // GROUP)
    low = g.amin(-1)
    scale, minimum = (g.amax(-1) - low) / 15, -low

    def per_group(v, pad, reduce):  # [out, blocks] -> [out, groups], a part-filled group padded
        return reduce(torch.nn.functional.pad(v, (0, groups * GROUP - blocks), value=pad).view(out, groups, GROUP), -1)

    scale_step = _bfloat16_up(per_group(scale, 0.0, torch.amax) / 255).clamp(min=1e-30)
    min_base = _bfloat16_down(per_group(minimum, float("inf"), torch.amin))
    min_step = _bfloat16_up((per_group(minimum, float("-inf"), torch.amax) - min_base.float()) / 255)
    sc = torch.round(scale / _per_block(scale_step, blocks)).clamp(1, 255)
    spread = _per_block(min_step, blocks)
    mn = torch.where(spread > 0, torch.round((minimum - _per_block(min_base, blocks)) / torch.where(spread > 0, spread, 1)), 0)
    sz = pack_scales(sc, mn.clamp(0, 255), scale_step, min_step, min_base)
    s, m = block_scales(sz, blocks)
    q = torch.round((g + m[..., None]) / s[..., None]).clamp(0, 15).to(torch.uint8)
    return q, sz


@functools.cache
def _group_order(blocks: int) -> torch.Tensor:
    """Byte i of a row in the blocks layout is byte _group_order(blocks)[i] of the row's blocks in
    order: per group of up to GROUP blocks, four slices, slice k holding bytes 4k..4k+3 of each
    block in turn (so each block has its own 32-bit lane in the kernel's vectors)."""
    order = []
    for first in range(0, blocks, GROUP):
        g = min(GROUP, blocks - first)
        order.append((torch.arange(g * 16).view(g, 4, 4) + first * 16).permute(1, 0, 2).reshape(-1))
    return torch.cat(order)


def to_groups(blocks: torch.Tensor) -> torch.Tensor:
    """[out, in / 32, 16] uint8 blocks, each block's 16 bytes in order, into the blocks layout."""
    out, count, _ = blocks.shape
    return blocks.reshape(out, -1)[:, _group_order(count)].view(out, count, 16).contiguous()


@functools.cache
def _group_inverse(blocks: int) -> torch.Tensor:
    return torch.argsort(_group_order(blocks))


def from_groups(packed: torch.Tensor) -> torch.Tensor:
    """The blocks layout's bytes back to each block's 16 bytes in order (to_groups undone)."""
    out, count, _ = packed.shape
    return packed.reshape(out, -1)[:, _group_inverse(count)].view(out, count, 16)


def dequantize_blocks(packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The reference for the blocks layout: W [out, in] float32, w = q · scale - minimum (q · scale
    is exact in float32, so this rounds once, as the kernels' one FMA)."""
    packed = from_groups(packed)
    q = torch.cat([packed & 15, packed >> 4], dim=-1).float()  # [out, in / 32, 32]
    scale, minimum = block_scales(scales_zeros, packed.shape[1])
    return (q * scale[..., None] - minimum[..., None]).flatten(1)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, bias=None,
                live: int | None = None) -> torch.Tensor:
    """x [..., in] · Wᵀ (+ bias) for W in either Int4Linear layout. Blocks: forwards of up to
    gemv.MAX_ROWS rows through selfspec's kernel (only the first `live` rows computed, the rest
    copies of the last live one: exact mode's padding); short prefills (up to
    gemv.int4_rows_limit() rows) through the same kernel's arithmetic, so their rows are the decode
    step's; longer ones as a GEMM of the dequantized weight."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if packed.dim() == 3:
        kernel = x.dtype == torch.bfloat16 and not gemv.needs_grad(x)
        if rows.shape[0] <= gemv.MAX_ROWS and kernel:
            live = rows.shape[0] if live is None else live
            y = gemv.int4_linear(rows[:live], packed, scales_zeros, bias, rows_out=rows.shape[0])
        elif kernel and gemv.available() and rows.shape[0] <= gemv.int4_rows_limit():
            y = gemv.int4_rows(rows, packed, scales_zeros, bias)
        else:
            # A long prefill (or float32 rows): the weights dequantized for a GEMM, in bfloat16 where
            # the CPU computes it natively (AVX512-BF16, AMX), else in float32. The decode rows' x as
            # int8 is not this: such a prefill's numbers are its own, the same for AR and every drafter.
            native = x.dtype == torch.bfloat16 and gemv.native_bfloat16() and gemv.available()
            dtype = x.dtype if native else torch.float32
            b = None if bias is None else bias.to(dtype)
            if gemv.available() and not gemv.needs_grad(x):  # tile by tile (the op keeps no gradient)
                y = gemv.int4_prefill(rows.to(dtype), packed, scales_zeros, b)
            else:
                w = gemv.int4_dequantize(packed, scales_zeros, dtype) if gemv.available() else \
                    dequantize_blocks(packed, scales_zeros).to(dtype)
                y = torch.nn.functional.linear(rows.to(dtype), w, b)
            y = y.to(x.dtype)
        return y.view(*shape[:-1], packed.shape[0])
    group = packed.shape[1] * 2 // scales_zeros.shape[0]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), packed, group, scales_zeros)
    y = y.view(*shape[:-1], packed.shape[0])
    return y if bias is None else y + bias


def _fuse_groups(layer) -> list[tuple[torch.nn.Module, list[str]]]:
    """(parent module, names of its projections that read the same input) for one decoder layer."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = ["qkv_proj"] if hasattr(attn, "qkv_proj") else ["q_proj", "k_proj", "v_proj"]
    gate_up = ["gate_up_proj"] if hasattr(mlp, "gate_up_proj") else ["gate_proj", "up_proj"]
    return [(attn, qkv), (attn, ["o_proj"]), (mlp, gate_up), (mlp, ["down_proj"])]


HEADS = ("int8", "int4")  # what an int4 model's LM head may be stored as (quantize_int4's head)


def quantize_int4(hf_model: torch.nn.Module, group: int = INT4_GROUP, layout: str | None = None,
                  head: str = "int8") -> int:
    """Decoder-layer projections to int4 groups (fusing q/k/v and gate/up), the LM head to int8
    (head="int4": to 4-bit groups as the layers, a sixth of a Qwen2.5-Coder step's bytes less, at
    a cost in fidelity that llama.cpp's Q4_K_M, which keeps its output matrix at 6 bits, does not
    take) and the embedding's rows to int8 (`quantize_embedding`), in place (the model must already
    be in ACTIVATION_DTYPE, on the CPU). layout: Int4Linear's (None: default_int4_layout()).
    Returns how many layer projections were replaced."""
    if head not in HEADS:
        raise ValueError(f"an int4 model's head is one of {', '.join(HEADS)}, not {head!r}")
    if hf_model.dtype != ACTIVATION_DTYPE:
        raise ValueError(f"load the model in {ACTIVATION_DTYPE} before quantizing it to int4, not {hf_model.dtype}")
    if hf_model.device.type != "cpu":
        raise ValueError("int4 runs PyTorch's CPU int4 kernel: use --dtype int8 or bfloat16 on CUDA")
    tied = _tied(hf_model)
    count = 0
    for layer in hf_model.model.layers:
        if not all(hasattr(parent, names[0]) for parent, names in _fuse_groups(layer)):
            raise ValueError("int4 supports dense decoder layers (q/k/v, o, gate/up, down projections), not this model's; "
                             "use --dtype int8")
        for parent, names in _fuse_groups(layer):
            linears = [getattr(parent, name) for name in names]
            fused = Int4Linear.quantize(torch.cat([m.weight for m in linears]), ACTIVATION_DTYPE, group=group,
                                        bias=linears[0].bias if len(linears) == 1 else None, layout=layout)
            if len(linears) == 1:
                setattr(parent, names[0], fused)
            else:
                start = 0
                for name, m in zip(names, linears):
                    setattr(parent, name, Int4Slice(fused, start, start + m.out_features,
                                                    None if m.bias is None else m.bias.detach().to(ACTIVATION_DTYPE)))
                    start += m.out_features
            count += len(linears)
    if head == "int4":
        linear = hf_model.lm_head
        hf_model.lm_head = Int4Linear.quantize(linear.weight, ACTIVATION_DTYPE, bias=linear.bias, group=group,
                                               layout=layout)
        quantize_embedding(hf_model, tied=False)  # int8 rows of its own: the head's 4-bit rows are not them
    else:
        int8_head(hf_model, tied)
    hf_model.train(hf_model.training)  # the new modules in the model's mode (eval, as loaded)
    return count


def float_weight(linear: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of a linear layer's weight [out, in], in its activation dtype, whatever the
    weight is stored as (a new tensor)."""
    # index_select, not w[rows]: advanced indexing of bfloat16 rows is far slower on CPU, and a
    # feature drafter's first begin pays it before the prefill (scripts/first_generate.py's setup).
    if isinstance(linear, Int8Linear):
        weight, scale = linear.weight.index_select(0, rows), linear.scale.index_select(0, rows)
        return (weight.float() * scale.float()[:, None]).to(linear.scale.dtype)
    if isinstance(linear, Int4Linear) and linear.layout == "blocks":
        packed, sz = linear.packed.index_select(0, rows), linear.scales_zeros.index_select(0, rows)
        return dequantize_blocks(packed, sz).to(ACTIVATION_DTYPE)
    if isinstance(linear, Int4Linear):
        return linear.weight.index_select(0, rows)
    return linear.weight.detach().index_select(0, rows)


def stored_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The tensor a linear layer keeps its weight in (an Int4Linear's packed blocks: its `weight`
    is a fresh dequantized copy), to tell by identity whether something was made from it."""
    return linear.packed if isinstance(linear, Int4Linear) else linear.weight
