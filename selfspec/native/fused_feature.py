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

import ctypes
import math
import os

import torch

from selfspec.native import gemv
from selfspec.native.fused_layer import Dims, Weights
from selfspec.native.fused_layer import norm_eps

ROWS = gemv.MAX_ROWS
DTYPES = {torch.bfloat16: 0, torch.float32: 2}


class FeatureDims(ctypes.Structure):
    _fields_ = [("block", Dims), ("vocab", ctypes.c_long), ("final_eps", ctypes.c_float),
                ("softcap", ctypes.c_float), ("final_gemma", ctypes.c_int)]


class FeatureWeights(ctypes.Structure):
    _fields_ = [("block", Weights)] + [(name, ctypes.c_void_p) for name in
                                       ("feature_norm", "token_norm", "fc", "final_norm", "head", "head_bias")]


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
    """The kernel's view of one feature head (and pruned draft head) on one model, built once:
    the pointers stay valid while the head and the PrunedHead hold their tensors."""

    def __init__(self, head, adapter, pruned):
        b = head.block
        self._call = gemv._STATE["lib"].selfspec_feature
        self.head, self.adapter, self.dtype = head, adapter, DTYPES[adapter.dtype]
        norm = adapter.norm
        final_eps = norm_eps(norm, 1e-6)
        block = Dims(head.hidden_size, b.heads, b.heads, b.head_dim, b.width, b.attn_norm.eps or 1e-6,
                     1.0 / math.sqrt(b.head_dim), 0, 0, 0, 0)
        self.vocab = 0 if pruned is None else len(pruned)
        self.dims = FeatureDims(block, self.vocab, final_eps, adapter.final_softcap or 0.0,
                                int(adapter.layout == "sandwich"))
        weights = Weights(b.qkv.weight.data_ptr(), None, b.o.weight.data_ptr(), b.up.weight.data_ptr(),
                          b.down.weight.data_ptr(), None, None, None, None, b.attn_norm.weight.data_ptr(), None,
                          b.mlp_norm.weight.data_ptr(), None, None, None)
        self.weights = FeatureWeights(weights, head.feature_norm.weight.data_ptr(), head.token_norm.weight.data_ptr(),
                                      head.fc.weight.data_ptr(), None if pruned is None else norm.weight.data_ptr(),
                                      None if pruned is None else pruned.weight.data_ptr(),
                                      None if pruned is None or pruned.bias is None else pruned.bias.data_ptr())
        self._logits = torch.empty(1, max(self.vocab, 1))

    def __call__(self, previous: torch.Tensor, embedded: torch.Tensor, start: int,
                 kv) -> tuple[torch.Tensor, torch.Tensor | None]:
        """previous, embedded [1, n, d] (n <= ROWS) of positions start .. start+n-1 -> the predicted
        final states [1, n, d] (their keys and values written into `kv`, the head's cache) and the
        draft head's float32 logits [1, N] of the last row (None without a pruned head). The
        logits tensor is reused by the next call."""
        n, d = previous.shape[1], previous.shape[2]
        previous, embedded = previous.contiguous(), embedded.contiguous()
        h = torch.empty(1, n, d, dtype=previous.dtype)
        cos, sin = self.head.block._rope(0, start + n, previous.dtype, previous.device)  # rows from position 0
        status = self._call(ctypes.byref(self.dims), ctypes.byref(self.weights), self.dtype, previous.data_ptr(),
                            embedded.data_ptr(), h.data_ptr(), n, start, cos.data_ptr(), sin.data_ptr(),
                            kv.keys.data_ptr(), kv.values.data_ptr(), kv.capacity,
                            self._logits.data_ptr() if self.vocab else None, torch.get_num_threads())
        if status:
            raise ValueError(f"the fused feature step refused {n} rows at position {start} (status {status})")
        return h, (self._logits if self.vocab else None)
