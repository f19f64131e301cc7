"""The verifier: draft tokens and probabilities in, target logits or probabilities in, tokens out.

Pure functions with no model inside; every drafter uses the same ones.

    γ             draft length: the drafter proposed tokens d_0 .. d_{γ-1}
    draft_probs   q, [γ, V]: the distribution each d_i was sampled from
    target_probs  p, [γ+1, V]: the target's distribution at each draft position plus one more
    accepted      the longest prefix of the draft that the target keeps
    recovered     the token drawn at the first rejection, from normalise(max(0, p_i - q_i))
    bonus         the token drawn from p_γ when all γ draft tokens are accepted

Every round therefore emits n_accepted + 1 tokens. Speculative sampling (Leviathan et al. 2023;
Chen et al. 2023) makes their distribution exactly that of sampling from p token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from selfspec.core.sampling import sample


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # the accepted draft tokens, then the recovered or bonus token
    sibling: int = 0  # a sibling verdict that accepted one: its index among the alternatives

    @property
    def n_accepted(self) -> int:
        """How many of the γ draft tokens were accepted (0..γ)."""
        return len(self.tokens) - 1

    @property
    def accepted(self) -> list[int]:
        return self.tokens[:-1]

    @property
    def next_token(self) -> int:
        """The recovered token (after a rejection) or the bonus token (all accepted)."""
        return self.tokens[-1]


def verify_greedy(draft_tokens: Tensor, target_logits: Tensor) -> Verdict:
    """draft_tokens [γ] long, target_logits [γ+1, V]: keep the draft while it is the argmax."""
    gamma = draft_tokens.shape[0]
    _check_shapes(gamma, target_logits, "target_logits")
    target_tokens = target_logits.argmax(-1)  # [γ+1]
    matches = draft_tokens.to(target_tokens) == target_tokens[:gamma]
    n_accepted = matches.long().cumprod(0).sum()
    # On the accepted prefix the draft equals the target's argmax, so the round emits
    # target_tokens[:n+1]. One host sync for the whole round.
    host = torch.cat([n_accepted.view(1), target_tokens]).tolist()
    n = host[0]
    return Verdict(tokens=host[1 : n + 2])


def verify_sampling(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative sampling for one sequence; see `rejection_sample` for shapes and the rule.

    With γ = 0 this is plain sampling from p_0, which is how autoregressive decoding runs.
    """
    n_accepted, next_token = rejection_sample(draft_tokens, draft_probs, target_probs, generator)
    host = torch.cat([n_accepted.view(1), next_token.view(1), draft_tokens.long()]).tolist()
    n, nxt, draft = host[0], host[1], host[2:]
    return Verdict(tokens=draft[:n] + [nxt])


def verify_siblings(
    alternatives: Tensor,
    target: Tensor,
    generator: torch.Generator | None = None,
    greedy: bool = True,
) -> Verdict:
    """A sibling draft (m alternative tokens for the one position after the pending token):
    alternatives [m] long; target [m+1, V]: the target's logits (greedy) or probabilities
    (sampling) after the pending token (row 0) and after each alternative (rows 1..m).

    The round's first token y is the target's own at row 0: its argmax, or a draw from p_0. If y
    is alternative i, its row holds the target after y, and the bonus token comes from row 1+i
    (argmax, or a draw). So y is drawn from p_0 and the bonus from p given y, exactly as two
    steps of plain decoding would; the alternatives decide only whether the bonus exists.
    """
    _check_shapes(alternatives.shape[0], target, "target")
    picks = target.argmax(-1).tolist() if greedy else None  # greedy: every row's token in one host sync

    def token(row: int) -> int:
        return picks[row] if greedy else int(sample(target[row:row + 1], generator))

    y, options = token(0), alternatives.tolist()
    if y not in options:
        return Verdict(tokens=[y])
    i = options.index(y)
    return Verdict(tokens=[y, token(1 + i)], sibling=i)


def rejection_sample(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """The speculative sampling rule, batched over any leading dims and free of host syncs.

    draft_tokens [..., γ] long, draft_probs q [..., γ, V], target_probs p [..., γ+1, V]
    -> (n_accepted [...] long, next_token [...] long).

    d_i is accepted if u_i < min(1, p_i(d_i) / q_i(d_i)), in order; the first rejection at i draws
    the recovered token from normalise(max(0, p_i - q_i)); if all are accepted the bonus token is
    drawn from p_γ. q may be zero on part of the vocabulary (a pruned draft head): max(0, p - q)
    then carries p's mass there, which keeps the result exact.
    """
    gamma = draft_tokens.shape[-1]
    _check_shapes(gamma, target_probs, "target_probs")
    if draft_probs.shape != target_probs[..., :gamma, :].shape:
        raise ValueError(
            f"draft_probs must be [..., γ, V] = {tuple(target_probs[..., :gamma, :].shape)}, "
            f"got {tuple(draft_probs.shape)}"
        )
    p = target_probs.float()
    q = draft_probs.float()

    d = draft_tokens.long().unsqueeze(-1)  # [..., γ, 1]
    p_d = p[..., :gamma, :].gather(-1, d).squeeze(-1)  # [..., γ]
    q_d = q.gather(-1, d).squeeze(-1)  # [..., γ]
    u = torch.rand(p_d.shape, generator=generator, device=p.device)
    # u < p/q written without the division; q_d == 0 cannot happen for a token drawn from q,
    # but if it does the token is rejected rather than dividing by zero.
    accepted = (q_d > 0) & (u * q_d < p_d)
    n_accepted = accepted.long().cumprod(-1).sum(-1)  # [...] length of the accepted prefix

    # Taking q_γ = 0 makes the bonus draw the same expression: max(0, p_γ - 0) = p_γ.
    p_n = _row(p, n_accepted)  # [..., V]
    if gamma:
        q_n = _row(q, n_accepted.clamp_max(gamma - 1)) * (n_accepted < gamma).unsqueeze(-1)
    else:
        q_n = torch.zeros_like(p_n)
    next_token = sample(_residual(p_n, q_n), generator)
    return n_accepted, next_token


def _row(x: Tensor, i: Tensor) -> Tensor:
    """x [..., rows, V], i [...] -> x[..., i, :] as [..., V], without a host sync."""
    return x.gather(-2, i[..., None, None].expand(*i.shape, 1, x.shape[-1])).squeeze(-2)


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """normalise(max(0, p - q)) over the last dim; p itself where that is all zero (p == q)."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def acceptance_probability(p: Tensor, q: Tensor) -> Tensor:
    """Expected acceptance rate α of one position: sum_x min(p(x), q(x)), over the last dim."""
    return torch.minimum(p.float(), q.float()).sum(-1)


def _check_shapes(gamma: int, target: Tensor, name: str) -> None:
    if target.dim() < 2 or target.shape[-2] != gamma + 1:
        raise ValueError(
            f"{name} must be [..., γ+1, V] with γ = {gamma}, got {tuple(target.shape)}"
        )
