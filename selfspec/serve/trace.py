"""The stream's trace (request `"stream_options": {"selfspec_trace": true}`): each chunk's text cut
into tokens, each with where it came from, and the verify round the chunk delivers. Sources:

  lookup, suffix, head, layers   accepted from a draft, by drafter family ("head": the feature
                                 head; "layers": early exit and every other drafter that runs the
                                 model's own layers)
  bonus                          the verify's token after a fully accepted draft
  correction                     the verify's token where the draft was rejected (recovered)
  ar                             a full forward with no draft: the prefill's token, a plain step
"""

from __future__ import annotations

from selfspec.core.engine import Round

SOURCES = ("lookup", "suffix", "head", "layers", "bonus", "correction", "ar")
_FAMILY = {"lookup": "lookup", "suffix": "suffix", "feature": "head"}  # every other drafter: "layers"


def family(drafter: str) -> str:
    """A drafter's name (core.draft.Drafter.name) as a trace source."""
    return _FAMILY.get(drafter, "layers")


def sources(round_: Round) -> list[str]:
    """Where each of a round's emitted tokens came from."""
    verify = "ar" if not round_.drafted else "bonus" if round_.accepted == round_.drafted else "correction"
    return [family(round_.drafter) if i < round_.accepted else verify for i in range(len(round_))]


class Trace:
    """One response's tokens by where their text ends. Token boundaries come from decoding each
    prefix (approximate where a tokenizer merges across tokens); the pieces `cut` returns are
    always exactly the text it is given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.ends: list[int] = []  # per token: the character offset where its text ends
        self.sources: list[str] = []
        self.rounds = 0  # rounds described so far; the first is the prefill's
        self.cut_at = 0  # characters already cut into pieces
        self.first = 0  # the first token whose text may not all have been cut yet

    def add(self, round_: Round) -> dict:
        """Record a round's tokens; returns the round as the stream describes it."""
        for token, source in zip(round_, sources(round_)):
            self.tokens.append(token)
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True).rstrip("\ufffd")
            self.ends.append(max(len(text), self.ends[-1] if self.ends else 0))
            self.sources.append(source)
        described = {"index": self.rounds, "drafter": round_.drafter, "drafted": round_.drafted,
                     "accepted": round_.accepted, "emitted": len(round_)}
        self.rounds += 1
        return described

    def cut(self, text: str) -> list[dict]:
        """The next `text` of the response as [{"text", "source"}] per token, in order; what lies
        past the last known token's end goes to the last token."""
        pieces, at, stop = [], self.cut_at, self.cut_at + len(text)
        i = self.first
        while at < stop and i < len(self.ends):
            end = stop if i == len(self.ends) - 1 else min(self.ends[i], stop)
            if end > at:
                pieces.append({"text": text[at - self.cut_at : end - self.cut_at], "source": self.sources[i]})
                at = end
            if at >= self.ends[i] and i < len(self.ends) - 1:
                i += 1
            elif end >= stop:
                break
        if at < stop:  # no token to give it to (none recorded): unattributed
            pieces.append({"text": text[at - self.cut_at :], "source": "ar"})
        self.first, self.cut_at = i, stop
        return pieces
