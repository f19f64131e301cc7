"""The distillation loss. A [positions, vocab] teacher table would be 49k floats per position for
SmolLM2, so the teacher is kept as its top TOP token ids and log-probabilities
(selfspec.tools.calibrate.data), and the KL is taken between p and q coarsened to those tokens plus
one outcome "everything else":
    KL = Σ_top p_i·log(p_i / q_i) + p_rest·log(p_rest / q_rest).
It is exact where agreement is decided (the teacher's likely tokens), never exceeds the full
KL, and still charges q for mass it spreads outside the teacher's top tokens (q_rest). The
student's logits span the full vocabulary: the head's forward and backward are the main cost of
a step.

Terms: p (teacher) the full model's next-token distribution; q (student) the draft's.
"""

from __future__ import annotations

import torch


def distill_loss(logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Per-row KL(p || q) on the teacher's top tokens plus "everything else" (see the module
    docstring); logits [n, vocab], teacher [n, top] -> [n]."""
    return _DistillKL.apply(logits, teacher_ids, teacher_logp)


class _DistillKL(torch.autograd.Function):
    """The coarsened KL with its closed-form gradient, built during the forward in one [n, vocab]
    buffer: d KL / d logit_j is q_j - p_j on the teacher's top tokens and q_j·(1 - p_rest/q_rest)
    elsewhere. Autograd's graph through logsumexp, scatter and gather takes about twice the time
    (several [n, vocab] temporaries per step), which the full-vocabulary head makes the bulk."""

    @staticmethod
    def forward(ctx, logits, teacher_ids, teacher_logp):
        logz = logits.logsumexp(-1, keepdim=True)  # [n, 1]
        logq_top = logits.gather(-1, teacher_ids) - logz  # [n, top]
        q = (logits - logz).exp_().scatter_(-1, teacher_ids, 0.0)  # q outside the top tokens
        q_rest = q.sum(-1).clamp_min(1e-30)  # summed, not 1 - Σ q_top: exact when it is tiny
        p_top = teacher_logp.exp()
        p_rest = (1 - p_top.sum(-1)).clamp_min(0)
        kl = (p_top * (teacher_logp - logq_top)).sum(-1) + torch.xlogy(p_rest, p_rest) - p_rest * q_rest.log()
        if ctx.needs_input_grad[0]:
            grad = q.mul_((1 - p_rest / q_rest)[:, None]).scatter_(-1, teacher_ids, logq_top.exp() - p_top)
            ctx.save_for_backward(grad)
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        (grad,) = ctx.saved_tensors
        return grad * grad_kl[:, None], None, None
