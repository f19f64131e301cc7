"""Drafters, one file per family, all behind the interface in `selfspec.core.draft`.

DRAFTERS maps a method name (as the CLI and the API take it) to a factory. Every factory receives
one `Resolved` (selfspec.core.speculation): the typed Speculation made concrete for the model
(its profile read, hybrid's fallback chosen, defaults that depend on the machine filled in by
selfspec.api), and builds its drafter from those fields; None means "the drafter's own default".
Adding a drafter never touches the engine or the CLI: it adds a factory here and its row of options
in `selfspec.core.speculation.TAKES`.
"""

import os
from collections.abc import Callable

from selfspec.drafters.autoregressive import Autoregressive
from selfspec.core.draft import Draft, DraftContext, Drafter
from selfspec.core.speculation import Resolved, Speculation, TAKES
from selfspec.drafters.layers.early_exit import EarlyExit


def _given(s: Speculation, *names: str) -> dict:
    """The named options that were actually given (not None)."""
    return {name: getattr(s, name) for name in names if getattr(s, name) is not None}


def _early_exit(r: Resolved, context: bool = True) -> Drafter:
    """exit_adapter: None uses the profile's context head, else its exit adapter, when its k is
    the one asked (or none is asked: then k is the head's or adapter's), a path uses that file
    (either kind), "none" uses neither. context=False: never a context head (saguaro).
    draft_vocab: N, draft with a head pruned to the N most frequent tokens of the profile's
    ranking from `selfspec calibrate`; None, the full head. threshold: stop a draft at a token
    whose top-1 probability is below it (default: 0.6 with a context head, else never)."""
    from selfspec.heads.draft_head import ranking_for
    from selfspec.heads.exit_adapter import exit_adapter_for

    s = r.speculation
    k = s.exit_layer
    adapter = exit_adapter_for(s.exit_adapter, r.profile, r.identity, k, context)
    if k is None and adapter is not None:
        k = adapter.exit_layer
    ranking = None if s.draft_vocab is None else ranking_for(r.profile, r.identity)
    return EarlyExit(k, 4 if s.draft_len is None else s.draft_len, exit_adapter=adapter,
                     draft_vocab=s.draft_vocab, ranking=ranking, threshold=s.threshold)


def _layer_skip(r: Resolved) -> Drafter:
    from selfspec.drafters.layers.layer_skip import LayerSkip

    return LayerSkip(profile=r.profile, **_given(r.speculation, "skip", "draft_len", "threshold"))


def _swift(r: Resolved) -> Drafter:
    from selfspec.drafters.layers.swift import Swift

    return Swift(**_given(r.speculation, "draft_len", "threshold", "skip_ratio", "every"))


def _clasp(r: Resolved) -> Drafter:
    from selfspec.drafters.layers.clasp import Clasp

    return Clasp(**_given(r.speculation, "draft_len", "threshold", "skip_ratio", "every"))


def _conflayers(r: Resolved) -> Drafter:
    from selfspec.drafters.layers.conflayers import ConfLayers

    return ConfLayers(**_given(r.speculation, "draft_len", "threshold", "skip_ratio", "every"))


def _lookup(r: Resolved) -> Drafter:
    from selfspec.drafters.lookup import PromptLookup

    return PromptLookup(**_given(r.speculation, "draft_len", "ngram"))


def _hybrid(r: Resolved) -> Drafter:
    """Prompt lookup, else the model draft `r.fallback` names (the API chooses it: layer skip with
    a skip set given or tuned; the feature head when the model has one and no k was asked; else
    early exit). With the feature head it drafts one token (γ applies to lookup), lookup drafts
    only from a suffix match of FEATURE_MIN_NGRAM or more tokens (a one-token match is right less
    often than the head), and no payoff gate runs: both drafts cost a few hundredths of a step, and
    the gates' noisy per-round rates switched rounds that paid to plain steps (0.99x AR with them on
    the bench prompts; without them 1.18-1.20x there and 1.37-1.39x on tune's prompts; README "The
    feature head")."""
    from selfspec.drafters.hybrid import Hybrid
    from selfspec.drafters.lookup import PromptLookup

    s = r.speculation
    lookup = PromptLookup(**_given(s, "draft_len", "ngram"))
    if r.fallback == "feature":
        lookup.min_ngram = min(FEATURE_MIN_NGRAM, lookup.ngram)
        head = Speculation.relevant("feature", **{**s.options(), "draft_len": 1})
        return Hybrid(lookup, _feature(Resolved(head, r.identity, profile=r.profile)), gate=False)
    if r.fallback == "layer-skip":
        return Hybrid(lookup, _layer_skip(r))
    return Hybrid(lookup, _early_exit(r))


FEATURE_MIN_NGRAM = 2  # hybrid with the feature head: lookup's shortest suffix match


def _expert_subset(r: Resolved) -> Drafter:
    """exit_layer: the k asked; None, the draft runs every layer, each MoE layer on `experts` experts."""
    from selfspec.drafters.layers.expert_subset import ExpertSubset

    return ExpertSubset(exit_layer=r.speculation.exit_layer, **_given(r.speculation, "experts", "draft_len"))


def _saguaro(r: Resolved) -> Drafter:
    """Early exit (the same options) that pre-drafts the next round during each verify."""
    from selfspec.drafters.layers.saguaro import Saguaro

    return Saguaro(_early_exit(r, context=False))  # its pre-drafts run ahead of any head's KV


def _feature(r: Resolved) -> Drafter:
    """The feature head the profile names (`selfspec calibrate --head feature`), else the one
    shipped for this model; draft_vocab N: only the first N of its draft-head tokens."""
    from selfspec.drafters.feature import FeatureDraft
    from selfspec.heads.feature_head import feature_head_for

    s = r.speculation
    head, draft_ids, _ = feature_head_for(r.profile, r.identity)
    if s.draft_vocab is not None:
        if not 1 <= s.draft_vocab <= draft_ids.numel():
            raise ValueError(f"draft_vocab must be in 1..{draft_ids.numel()} (the tokens this feature head was "
                             f"trained with), got {s.draft_vocab}")
        draft_ids = draft_ids[:s.draft_vocab]
    return FeatureDraft(head, 3 if s.draft_len is None else s.draft_len, draft_ids=draft_ids,
                        threshold=s.threshold, siblings=s.siblings or 1)


def _suffix(r: Resolved) -> Drafter:
    """Suffix decoding: drafts from the store `r.store` (the model's, or its tenant's: selfspec.api);
    where the model has a feature head (`r.fallback`), one head token on rounds with no match, as
    hybrid does after lookup (SmolLM2 on the agent sessions: 1.53x plain decoding alone, 1.81x
    with the head; results/agent_bench)."""
    from selfspec.drafters.hybrid import Hybrid
    from selfspec.drafters.suffix import SuffixDraft, SuffixStore

    payoff = os.environ.get("SELFSPEC_SUFFIX_PAYOFF", "0") == "1"  # 1: drafts cut by measured payoff (an experiment)
    suffix = SuffixDraft(r.store if r.store is not None else SuffixStore(), payoff=payoff,
                         **_given(r.speculation, "draft_len"))
    if r.fallback != "feature":
        return suffix
    head = Speculation("feature", draft_len=1)
    drafter = Hybrid(suffix, _feature(Resolved(head, r.identity, profile=r.profile)), gate=False)
    drafter.name = "suffix"
    return drafter


DRAFTERS: dict[str, Callable[[Resolved], Drafter]] = {
    "ar": lambda r: Autoregressive(),
    "early-exit": _early_exit,
    "layer-skip": _layer_skip,
    "swift": _swift,
    "clasp": _clasp,
    "conflayers": _conflayers,
    "lookup": _lookup,
    "suffix": _suffix,
    "hybrid": _hybrid,
    "expert-subset": _expert_subset,
    "saguaro": _saguaro,
    "feature": _feature,
}
METHODS = tuple(DRAFTERS)
assert set(METHODS) == set(TAKES) - {"auto"}, "every method has its row of options in selfspec.core.speculation.TAKES"


def make_drafter(resolved: Resolved) -> Drafter:
    """The drafter a resolved speculation describes (see selfspec.api.SelfSpecModel.resolve)."""
    method = resolved.speculation.method
    if method not in DRAFTERS:
        raise ValueError(f"method {method!r} must be resolved to a drafter first (selfspec.api.SelfSpecModel.resolve)")
    return DRAFTERS[method](resolved)


__all__ = ["DRAFTERS", "METHODS", "Autoregressive", "Draft", "DraftContext", "Drafter", "EarlyExit", "make_drafter"]
