"""Products over many rows (a prefill) in bfloat16 on CPUs that do not compute bfloat16 natively.

There PyTorch's bfloat16 GEMM is emulated and slow: on a 2-core AMD EPYC with AVX2 only, 700
rows of SmolLM2's gate/up took 167 ms in bfloat16 against 26 ms as a float32 GEMM, the weights
widened on the way included (README, "A fourth CPU"). So on such CPUs a many-row bfloat16 product
widens both sides to float32 and rounds its result back to bfloat16, once. The numbers are a
float32-accumulated product rounded once, as the bfloat16 GEMM's are; the prefill takes this path
for AR and every drafter alike. Few-row products (steps, drafts, verifies) go through selfspec's
own kernel (selfspec/native/gemv.py) and never come here on the fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from selfspec.native import gemv

WIDE_ROWS = 32  # from this many rows a product widens: a prefill's, not a step's (widening copies W)


def widen(x: torch.Tensor) -> bool:
    """Whether a product with x as its input rows should run in float32 on this machine: bfloat16
    rows, at least WIDE_ROWS of them, on a CPU without native bfloat16."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() >= WIDE_ROWS * x.shape[-1]
            and not gemv.native_bfloat16())


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) with w in x's dtype (int8 weights widen exactly), through float32
    where bfloat16 products are emulated (see above)."""
    if not widen(x):
        return F.linear(x, w.to(x.dtype), bias)
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)
