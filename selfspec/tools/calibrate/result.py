"""What a calibration run produced, and where it is written: each exit layer's head and how it
did, the token counts for the pruned draft head, and the model's profile pointing at the best."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfspec.heads import context_head, draft_head
from selfspec.heads.context_head import ContextHead
from selfspec.heads.exit_adapter import SECTION, ExitAdapter, default_path, save_exit_adapter
from selfspec.model.profiles import save_section


@dataclass
class Trained:
    """One exit layer's adapter and how it did."""

    adapter: ExitAdapter
    alpha_before: float  # held-out α of plain early exit (the untrained adapter)
    alpha_after: float  # held-out α with the trained adapter
    kl_before: float  # held-out KL (nats per position)
    kl_after: float
    train_alpha_after: float  # α on (a sample of) the training positions: the gap shows overfitting
    steps: int
    seconds: float

    def summary(self) -> dict:
        return dict(alpha_before=round(self.alpha_before, 4), alpha_after=round(self.alpha_after, 4),
                    kl_before=round(self.kl_before, 4), kl_after=round(self.kl_after, 4),
                    train_alpha_after=round(self.train_alpha_after, 4), steps=self.steps,
                    seconds=round(self.seconds, 1))


@dataclass
class Calibration:
    trained: dict[int, Trained]  # by k
    train_positions: int
    train_outputs: int  # of which positions of output tokens (the rest: prompts and plain text)
    held_out_positions: int
    sequences: int
    model_params: int
    data_seconds: float  # generating and teacher-forcing the data
    paths: dict[int, Path] = field(default_factory=dict)  # by k, once saved
    profile: Path | None = None
    token_counts: torch.Tensor | None = None  # [vocab]: the prompts' and outputs' tokens, for the draft head
    draft_head_path: Path | None = None  # once saved

    @property
    def best(self) -> int:
        return max(self.trained, key=lambda k: self.trained[k].alpha_after)

    def table(self) -> str:
        rows = ["| k | α before | α after | α train | KL before | KL after | params | share | train s |",
                "|---|---|---|---|---|---|---|---|---|"]
        for k, t in sorted(self.trained.items()):
            n = t.adapter.n_params
            rows.append(f"| {k} | {t.alpha_before:.3f} | {t.alpha_after:.3f} | {t.train_alpha_after:.3f} | "
                        f"{t.kl_before:.3f} | {t.kl_after:.3f} | {n / 1e6:.2f}M | {n / self.model_params:.2%} | "
                        f"{t.seconds:.0f} |")
        return "\n".join(rows)

    def to_json(self) -> dict:
        return dict(
            train_positions=self.train_positions, train_outputs=self.train_outputs,
            held_out_positions=self.held_out_positions,
            sequences=self.sequences, model_params=self.model_params, data_seconds=round(self.data_seconds, 1),
            best_exit_layer=self.best, profile=str(self.profile) if self.profile else None,
            draft_head=str(self.draft_head_path) if self.draft_head_path else None,
            exit_layers={str(k): {**t.summary(), "params": t.adapter.n_params, "path": str(self.paths.get(k, ""))}
                         for k, t in sorted(self.trained.items())},
        )


def save(result: Calibration, identity, directory: str | Path | None = None, setup: dict | None = None) -> None:
    """Write every k's adapter or context head (named by default_path, in `directory` or beside the
    profiles) and point the model's profile at the one with the best held-out α after training;
    likewise the token ranking for the pruned draft head."""
    for k, t in result.trained.items():
        summary = {**t.summary(), "train_positions": result.train_positions,
                   "held_out_positions": result.held_out_positions, **(setup or {})}
        if isinstance(t.adapter, ContextHead):
            path = context_head.default_path(identity, k, directory)
            result.paths[k] = context_head.save_context_head(t.adapter, path, identity, summary)
        else:
            result.paths[k] = save_exit_adapter(t.adapter, default_path(identity, k, directory), identity, summary)
    best = result.trained[result.best]
    section = context_head.SECTION if isinstance(best.adapter, ContextHead) else SECTION
    result.profile = save_section(identity, section, {
        "path": str(result.paths[result.best].resolve()), "exit_layer": result.best,
        "alpha_before": round(best.alpha_before, 4), "alpha_after": round(best.alpha_after, 4),
        "params": best.adapter.n_params,
    })
    if result.token_counts is not None:
        path = draft_head.default_path(identity, directory)
        source = {"sequences": result.sequences, **(setup or {})}
        result.draft_head_path = draft_head.save_ranking(result.token_counts, path, identity, source)
        result.profile = save_section(identity, draft_head.SECTION, {
            "path": str(result.draft_head_path.resolve()), "tokens": int(result.token_counts.sum()),
            "coverage": {str(n): round(c, 4) for n, c in draft_head.coverage(result.token_counts).items()},
        })
