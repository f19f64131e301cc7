"""The feature head's drafting step in one call to the kernel library (`kernels/feature.cpp`).

Why: the head is small (1.9M parameters and an 8,192-row draft head on SmolLM2, ~13 MB in
bfloat16, ~0.3 ms of reading at this machine's memory rate), but run as PyTorch modules it is ~40
small ops per draft token (norms, concatenation, rotary, the cache write, attention, MLP, final
norm, head) at several µs each, plus their Python: ~1.3 ms, c ≈ 0.15 of a SmolLM2 step. Here one
call runs the input norms and fc, the head's block (the fused decoder layer's code with an ungated
MLP, over the head's own KV cache) and, for the last row, the model's final norm and the pruned
draft head's logits.

Only the draft changes: the verify checks every drafted token, so the kernel's rounding (within
rounding of the PyTorch modules) never reaches the output. Where it does not run (no kernel
library, CUDA, int8 activations, more than ROWS rows such as a round's first call over a long
prompt, shapes it does not take, SELFSPEC_FUSED=0, or SELFSPEC_FUSED_FEATURE=0 for this step
alone) the PyTorch modules do.
"""

from __future__ import annotations

import math
import os

import torch

from selfspec.native import gemv
from selfspec.native.fused_layer import norm_eps

ROWS = gemv.MAX_ROWS
DTYPES = {torch.bfloat16: 0, torch.float32: 2}


def unsupported_reason(head, adapter, pruned) -> str | None:
    """Why the step of feature head `head` (with PrunedHead `pruned`, or None: the model's full
    head, computed outside the kernel) cannot run fused on `adapter` (None: it can)."""
    for name in ("SELFSPEC_FUSED", "SELFSPEC_FUSED_FEATURE"):  # the second: this step alone (for timings)
        if os.environ.get(name, "1") == "0":
            return f"{name}=0"
    if adapter.device.type != "cpu" or not gemv.available():
        return "no kernel library on this device"
    dtype = adapter.dtype
    if dtype not in DTYPES:
        return f"{dtype} activations"
    b = head.block
    tensors = list(head.parameters()) + ([] if pruned is None else [pruned.weight, adapter.norm.weight])
    if any(t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        return "weights in another dtype, device or layout than the activations"
    if pruned is not None and pruned.bias is not None and (pruned.bias.dtype != dtype or not pruned.bias.is_contiguous()):
        return "a head bias in another dtype or layout"
    if head.hidden_size % 8 or b.width % 8 or b.head_dim % 16 or b.head_dim > 512:
        return "a hidden size or width that is not a multiple of 8, or a head size not a multiple of 16"
    if adapter.layout not in ("pre-norm", "sandwich"):
        return f"final norm of layout {adapter.layout}"
    return None


class FusedFeature:
    """The kernel's view of one feature head (and pruned draft head) on one model, built once: the
    op `feature_step` (kernels/ops.cpp) checks the tensors on every call."""

    def __init__(self, head, adapter, pruned):
        b = head.block
        self._op = gemv._STATE["lib"].feature_step.default
        self.head, self.adapter = head, adapter
        norm = adapter.norm
        self.final_eps = norm_eps(norm, 1e-6)
        self.heads, self.eps, self.scale = b.heads, b.attn_norm.eps or 1e-6, 1.0 / math.sqrt(b.head_dim)
        self.softcap, self.final_gemma = adapter.final_softcap or 0.0, adapter.layout == "sandwich"
        self.vocab = 0 if pruned is None else len(pruned)
        self.weights = [b.qkv.weight, b.o.weight, b.up.weight, b.down.weight, b.attn_norm.weight, b.mlp_norm.weight,
                        head.feature_norm.weight, head.token_norm.weight, head.fc.weight,
                        None if pruned is None else norm.weight, None if pruned is None else pruned.weight,
                        None if pruned is None else pruned.bias]
        self._logits = torch.empty(1, max(self.vocab, 1))

    def __call__(self, previous: torch.Tensor, embedded: torch.Tensor, start: int,
                 kv) -> tuple[torch.Tensor, torch.Tensor | None]:
        """previous, embedded [1, n, d] (n <= ROWS) of positions start .. start+n-1 -> the predicted
        final states [1, n, d] (their keys and values written into `kv`, the head's cache) and the
        draft head's float32 logits [1, N] of the last row (None without a pruned head). The
        logits tensor is reused by the next call."""
        n = previous.shape[1]
        cos, sin = self.head.block._rope(0, start + n, previous.dtype, previous.device)  # rows from position 0
        h = self._op(previous.contiguous(), embedded.contiguous(), self.weights, cos, sin, kv.keys, kv.values,
                     self._logits if self.vocab else None, self.heads, self.eps, self.scale, self.final_eps,
                     self.softcap, self.final_gemma, start)
        return h, (self._logits if self.vocab else None)
