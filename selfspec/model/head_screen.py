"""The int8 LM head's argmax at nearly a 4-bit head's cost, exactly.

A greedy step needs only the head's largest logit, and most of the vocabulary is nowhere near it.
So a screen holds a 4-bit copy of the int8 head (the int4 kernel's blocks: 0.57x the int8 head's
bytes, which are a quarter of Qwen2.5-Coder 1.5B's int4 step) and, per vocabulary row j, what
bounds the gap between the two heads' logits for any hidden row x:

    |E_j - A_j| <= B_j(x)

E_j the int8 head's logit as its kernel computes it, A_j the 4-bit copy's. Then L = max_j (A_j -
B_j) is at most the largest E, so every token whose E could be the largest has A_j + B_j >= L:
those candidates (a median of ~130 of Qwen2.5-Coder's 151,936 tokens a decode step of code) get the
int8 head's own logits, from its own kernel on their gathered rows (each output of that kernel is
its row's fixed-order sum, so its bits do not depend on which rows are computed beside it), and
every other token -inf. The argmax, ties to the first index included, is the full head's.

B_j(x) is Cauchy-Schwarz on what differs plus float rounding, each term an upper bound:
- the weights: ||w8_j - w4_j|| ||x|| (the residual's norm per row, stored);
- the int4 kernel's x, int8 in blocks of 32 within 0.51 of a block step (max|x_b| / 127) of x:
  ||w4_j|| times that error's norm; the int8 kernel's x as int16 (step max|x| / 16383) likewise;
- float sums: (K + 64) 2^-23 times what they add (||w8_j|| ||x|| for the int8 head; for the 4-bit
  one, its scales and minimums times ||x||_1: (15 max scale_j + max |minimum_j|) ||x||_1);
- both results are bfloat16: 2^-8 of their size.
The bound is loose (its residual term is ~40x the typical gap), which costs candidates, never
exactness; tests/test_head_screen.py checks the argmax and the candidates' bits against the full
head on adversarial rows (duplicates, near-ties), every kernel path.

Only greedy picks use it (`ModelAdapter.head(..., top1=True)`); sampling needs every logit. It
runs while its candidates stay few (`HeadScreen.pays`): on Qwen2.5-Coder 1.5B a decode round took
0.96-0.98x its time with the full head (idle 2-core AMD EPYC), while SmolLM2's and Gemma 3's bounds keep a fifth
or more of their vocabularies, so there it steps aside after its first call. Its cost is memory:
the 4-bit copy (0.13 GB for the 1.5B) beside the int8 head, which is also the embedding's table.
"""

from __future__ import annotations

import torch

from selfspec.native import gemv
from selfspec.model.quantize import Int4Linear, block_scales, dequantize_blocks

SHARE = 0.1  # the screen runs while its candidates average at most this share of the vocabulary
WEIGHT = 0.1  # of the latest call in that average
PROBE_EVERY = 64  # calls: a screen that stopped paying tries again after this many (its text may have moved on) ...
MAX_WAIT = 4096  # ... and twice as many after each probe that did not pay, up to this
GATHER = 0.125  # of the vocabulary: more candidates than this in a call, and the full head runs instead
OUTPUTS = 16  # the product kernels' outputs a task: candidates are gathered in whole tasks


class HeadScreen(torch.nn.Module):
    """A 4-bit copy of an int8 head and each vocabulary row's bound constants [4, out]: the
    residual's norm ||w8 - w4||, ||w4||, ||w8|| and the 4-bit row's largest 15 scale + |minimum|."""

    def __init__(self, approx: Int4Linear, bounds: torch.Tensor):
        super().__init__()
        self.approx = approx
        self.bounds = torch.nn.Parameter(bounds, requires_grad=False)  # [4, out] float32
        self.share: float | None = None  # moving average of the candidates' share of the vocabulary (its first call's to start)
        self.skipped = 0  # calls since the screen last ran, while it does not pay
        self.wait = PROBE_EVERY  # calls between probes, while it does not pay

    def pays(self) -> bool:
        """Whether to screen this call: while its candidates stay few (SmolLM2's and Gemma 3's
        bounds keep a quarter or more of their vocabularies, and gathering those costs more than
        the full head), else once after `wait` calls, each such probe that does not pay doubling
        the wait (up to MAX_WAIT)."""
        if self.share is None or self.share <= SHARE:
            return True
        self.skipped += 1
        if self.skipped < self.wait:
            return False
        self.skipped, self.wait = 0, min(2 * self.wait, MAX_WAIT)
        return True

    def note(self, candidates: float) -> None:
        """Feed back one screened call's candidates a row."""
        share = candidates / self.bounds.shape[1]
        self.share = share if self.share is None else self.share + WEIGHT * (share - self.share)
        if self.share <= SHARE:
            self.wait = PROBE_EVERY

    @classmethod
    def of(cls, weight: torch.Tensor, scale: torch.Tensor, chunk: int = 8192) -> "HeadScreen":
        """The screen of an int8 head (weight [out, in] int8, scale [out]), its 4-bit copy
        quantized from the int8 values (in chunks of rows: the 1.5B's head is 0.9 GB as float32)."""
        packed, sz, bounds = [], [], []
        for start in range(0, weight.shape[0], chunk):
            w8 = weight[start:start + chunk].float() * scale[start:start + chunk].float()[:, None]
            part = Int4Linear.quantize(w8, torch.bfloat16, layout="blocks")
            w4 = dequantize_blocks(part.packed, part.scales_zeros)  # float32, as the kernel has it
            scales, minimums = block_scales(part.scales_zeros, w8.shape[1] // 32)
            magnitude = 15 * scales.abs().amax(1) + minimums.abs().amax(1)
            bounds.append(torch.stack([(w8 - w4).norm(dim=1), w4.norm(dim=1), w8.norm(dim=1), magnitude]))
            packed.append(part.packed)
            sz.append(part.scales_zeros)
        approx = Int4Linear(torch.cat(packed), torch.cat(sz), None)
        return cls(approx, torch.cat(bounds, 1).contiguous())

    def candidates(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [n, in] bfloat16 (the head's normed input): the ascending indices of every token that
        could hold some row's largest int8 logit (their union over rows), or None where x is not
        finite (the caller then runs the full head)."""
        parts = [gemv.int4_linear(x[i:i + gemv.MAX_ROWS], self.approx.packed, self.approx.scales_zeros)
                 for i in range(0, x.shape[0], gemv.MAX_ROWS)]  # the kernel's arithmetic, whatever the rows
        approx = parts[0] if len(parts) == 1 else torch.cat(parts)  # [n, out]
        return gemv.head_screen(x, approx, self.bounds)  # the bound below, in one op


def top1_logits(x: torch.Tensor, screen: HeadScreen, exact) -> torch.Tensor | None:
    """Logits [n, out] float32 for x [n, in] whose every row's argmax is the full head's: the
    candidates' exact logits, -inf elsewhere. exact(x, rows) computes the full head's logits
    [n, len(rows)] of the given vocabulary rows with its own kernel. None where the screen cannot
    tell (x not finite), does not pay (HeadScreen.pays) or kept more than GATHER of the vocabulary
    this call (a flat distribution: a wrong draft token's next row): the caller runs the full head."""
    if not screen.pays():
        return None
    rows = screen.candidates(x)
    if rows is None:
        return None
    screen.note(rows.numel() / x.shape[0])
    if rows.numel() > GATHER * screen.bounds.shape[1]:  # gathering them would cost more than the full head
        return None
    if rows.numel() % OUTPUTS:  # whole tasks of the kernel's outputs, the padding a repeat of the last row
        rows = torch.cat([rows, rows[-1:].expand(OUTPUTS - rows.numel() % OUTPUTS)])
    logits = torch.full((x.shape[0], screen.bounds.shape[1]), float("-inf"))
    logits[:, rows] = exact(x, rows).float()
    return logits
