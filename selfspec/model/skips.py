"""Which sublayers a draft skips: the one description every layer-skipping drafter produces.

A skip set names attention and MLP sublayers, each independently (Draft & Verify skips them
separately; SWIFT, CLaSp and early exit skip whole layers, i.e. both). The draft runs every other
sublayer of the model, in order, with the model's own weights.

The *boundary* is the first layer with a skipped sublayer. Layers before it see exactly the full
model's inputs, so the KV the draft writes there is the full model's and the verify reuses it;
from the boundary on, the verify recomputes every draft position (see engine.verify_forward).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SkipSet:
    attn: frozenset[int] = frozenset()  # layers whose attention sublayer the draft skips
    mlp: frozenset[int] = frozenset()  # layers whose MLP sublayer the draft skips

    @classmethod
    def layers(cls, indices: Iterable[int]) -> SkipSet:
        """Skip whole layers (both sublayers)."""
        indices = frozenset(int(i) for i in indices)
        return cls(indices, indices)

    @classmethod
    def early_exit(cls, k: int, n_layers: int) -> SkipSet:
        """LayerSkip's draft: layers 0 .. k-1, then the head."""
        return cls.layers(range(k, n_layers))

    def boundary(self, n_layers: int) -> int:
        """First layer with a skipped sublayer (n_layers when nothing is skipped)."""
        return min(self.attn | self.mlp, default=n_layers)

    def skipped_layers(self) -> frozenset[int]:
        """Layers skipped whole."""
        return self.attn & self.mlp

    def __len__(self) -> int:
        """Number of skipped sublayers."""
        return len(self.attn) + len(self.mlp)

    def fraction(self, n_layers: int) -> float:
        """Skipped share of the model's 2·L sublayers."""
        return len(self) / (2 * n_layers)

    def check(self, n_layers: int) -> SkipSet:
        bad = sorted(i for i in self.attn | self.mlp if not 0 <= i < n_layers)
        if bad:
            raise ValueError(f"skip set names layers {bad}, outside 0..{n_layers - 1} of this model")
        return self

    def to_json(self) -> dict:
        return {"attn": sorted(self.attn), "mlp": sorted(self.mlp)}

    @classmethod
    def from_json(cls, data: dict) -> SkipSet:
        return cls(frozenset(int(i) for i in data.get("attn", ())), frozenset(int(i) for i in data.get("mlp", ())))

    @classmethod
    def parse(cls, text: str) -> SkipSet:
        """From the CLI: 'attn:3,5,7 mlp:4-9' or '10-19' (whole layers); ranges are inclusive."""
        attn: set[int] = set()
        mlp: set[int] = set()
        for part in text.replace(";", " ").split():
            kind, _, numbers = part.rpartition(":")
            if kind not in ("", "attn", "mlp", "layer"):
                raise ValueError(f"bad skip set part {part!r}: use attn:LIST, mlp:LIST or a LIST of whole layers")
            indices = _parse_list(numbers)
            if kind in ("", "layer", "attn"):
                attn |= indices
            if kind in ("", "layer", "mlp"):
                mlp |= indices
        return cls(frozenset(attn), frozenset(mlp))

    def describe(self) -> str:
        whole = self.skipped_layers()
        parts = []
        if whole:
            parts.append("layers " + _format_list(whole))
        if self.attn - whole:
            parts.append("attn " + _format_list(self.attn - whole))
        if self.mlp - whole:
            parts.append("mlp " + _format_list(self.mlp - whole))
        return "; ".join(parts) or "nothing"


def _parse_list(text: str) -> set[int]:
    out: set[int] = set()
    for item in filter(None, text.split(",")):
        try:
            if "-" in item:
                lo, hi = item.split("-")
                out |= set(range(int(lo), int(hi) + 1))
            else:
                out.add(int(item))
        except ValueError:
            raise ValueError(f"bad layer list {text!r}: use numbers and ranges, e.g. 3,5,10-14") from None
    return out


def _format_list(indices: Iterable[int]) -> str:
    """[3, 4, 5, 9] -> '3-5,9'."""
    items = sorted(indices)
    runs, start = [], None
    for i, x in enumerate(items):
        if start is None:
            start = x
        if i + 1 == len(items) or items[i + 1] != x + 1:
            runs.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(runs)
