"""Drafters, one file per family, all behind the interface in `selfspec.core.draft`.

DRAFTERS maps a method name (as the CLI and the API take it) to a factory. Every factory receives
the same keyword options (exit_layer, draft_len, threshold, skip, skip_ratio, every, ngram,
exit_adapter, draft_vocab, profile (the model's profile, a dict), identity (the model's
ModelIdentity), ...), with None meaning "the drafter's own default", and picks the ones it uses;
adding a drafter never touches the engine or the CLI.
"""

from collections.abc import Callable

from selfspec.drafters.autoregressive import Autoregressive
from selfspec.core.draft import Draft, DraftContext, Drafter
from selfspec.drafters.layers.early_exit import EarlyExit


def _given(options: dict, *names: str) -> dict:
    """The named options that were actually given (not None)."""
    return {name: options[name] for name in names if options.get(name) is not None}


def _early_exit(context: bool = True, **o) -> Drafter:
    """exit_adapter: None uses the profile's context head, else its exit adapter, when its k is
    the one asked (or none is asked: then k is the head's or adapter's), a path uses that file
    (either kind), False or "none" uses neither. context=False: never a context head (saguaro).
    draft_vocab: N, draft with a head pruned to the N most frequent tokens of the profile's
    ranking from `selfspec calibrate`; None, the full head. threshold: stop a draft at a token
    whose top-1 probability is below it (default: 0.6 with a context head, else never)."""
    from selfspec.heads.draft_head import ranking_for
    from selfspec.heads.exit_adapter import exit_adapter_for

    k = o.get("exit_layer")
    adapter = exit_adapter_for(o.get("exit_adapter"), o.get("profile") or {}, o.get("identity"), k, context)
    if k is None and adapter is not None:
        k = adapter.exit_layer
    vocab = o.get("draft_vocab")
    if vocab is not None and vocab < 1:
        raise ValueError(f"draft_vocab must be >= 1, got {vocab}")
    ranking = None if vocab is None else ranking_for(o.get("profile") or {}, o.get("identity"))
    return EarlyExit(k, 4 if o.get("draft_len") is None else o["draft_len"], exit_adapter=adapter,
                     draft_vocab=vocab, ranking=ranking, threshold=o.get("threshold"))


def _layer_skip(**o) -> Drafter:
    from selfspec.drafters.layers.layer_skip import LayerSkip

    return LayerSkip(profile=o.get("profile"), **_given(o, "skip", "draft_len", "threshold"))


def _swift(**o) -> Drafter:
    from selfspec.drafters.layers.swift import Swift

    return Swift(**_given(o, "draft_len", "threshold", "skip_ratio", "every"))


def _clasp(**o) -> Drafter:
    from selfspec.drafters.layers.clasp import Clasp

    return Clasp(**_given(o, "draft_len", "threshold", "skip_ratio", "every"))


def _conflayers(**o) -> Drafter:
    from selfspec.drafters.layers.conflayers import ConfLayers

    return ConfLayers(**_given(o, "draft_len", "threshold", "skip_ratio", "every"))


def _lookup(**o) -> Drafter:
    from selfspec.drafters.lookup import PromptLookup

    return PromptLookup(**_given(o, "draft_len", "ngram"))


def _hybrid(**o) -> Drafter:
    """Prompt lookup, else a model draft: layer skip with a skip set (given or tuned); the feature
    head when the model has one (the profile's or the shipped one) and no k was asked; else early
    exit. With the feature head it drafts one token (γ applies to lookup), lookup drafts only from
    a suffix match of FEATURE_MIN_NGRAM or more tokens (a one-token match is right less often than
    the head), and no payoff gate runs: both drafts cost a few hundredths of a step, and the gates'
    noisy per-round rates switched rounds that paid to plain steps (0.99x AR with them on the
    bench prompts; without them 1.18-1.20x there and 1.37-1.39x on tune's prompts; README "The
    feature head")."""
    from selfspec.drafters.hybrid import Hybrid
    from selfspec.drafters.lookup import PromptLookup

    lookup = PromptLookup(**_given(o, "draft_len", "ngram"))
    fallback = hybrid_fallback(o)
    if fallback == "feature":
        lookup.min_ngram = min(FEATURE_MIN_NGRAM, lookup.ngram)
        return Hybrid(lookup, _feature(**{**o, "draft_len": 1, "siblings": default_siblings(o.get("siblings"))}),
                      gate=False)
    return Hybrid(lookup, _layer_skip(**o) if fallback == "layer-skip" else _early_exit(**o))


FEATURE_MIN_NGRAM = 2  # hybrid with the feature head: lookup's shortest suffix match
DEFAULT_SIBLINGS = 2  # hybrid's feature fallback on CPUs with AMX: its two likeliest tokens as siblings


def default_siblings(asked: int | None = None) -> int:
    """Alternatives hybrid's feature fallback drafts (Draft.siblings): `asked` if given, else DEFAULT_SIBLINGS where the
    products run on AMX, whose 3-row verify costs ~1.07 steps (2-core Intel Xeon: the hybrid
    1.24x -> 1.28x AR on the benchmark prompts, 1.53x -> 1.57x on tune's; README "Siblings"), else
    1 (a chain: the pair products' 3-row verify costs 1.17-1.27 steps, unmeasured with siblings)."""
    from selfspec.native import gemv

    if asked:
        return asked
    return DEFAULT_SIBLINGS if gemv.kernel_path() == "amx" and gemv.available() else 1


def hybrid_fallback(o: dict) -> str:
    """Which model draft `hybrid` falls back to with these options: "layer-skip" (a skip set given
    or tuned), "feature" (the model has a feature head and no k was asked) or "early-exit"."""
    if o.get("skip") or (o.get("profile") or {}).get("layer-skip"):
        return "layer-skip"
    if o.get("asked_exit_layer") is None and has_feature_head(o):
        return "feature"
    return "early-exit"


def has_feature_head(o: dict) -> bool:
    """Whether the model (options profile and identity) has a feature head: its profile's or a shipped one."""
    from selfspec.heads.feature_head import SECTION, shipped_path

    identity = o.get("identity")
    return identity is not None and bool((o.get("profile") or {}).get(SECTION) or shipped_path(identity).is_file())


def _expert_subset(**o) -> Drafter:
    """exit_layer: only a k the caller asked (`asked_exit_layer`, before the API fills in early
    exit's default); without one the draft runs every layer, each MoE layer on `experts` experts."""
    from selfspec.drafters.layers.expert_subset import ExpertSubset

    k = o["asked_exit_layer"] if "asked_exit_layer" in o else o.get("exit_layer")
    return ExpertSubset(exit_layer=k, **_given(o, "experts", "draft_len"))


def _saguaro(**o) -> Drafter:
    """Early exit (the same options) that pre-drafts the next round during each verify."""
    from selfspec.drafters.layers.saguaro import Saguaro

    return Saguaro(_early_exit(context=False, **o))  # its pre-drafts run ahead of any head's KV


def _feature(**o) -> Drafter:
    """The feature head the profile names (`selfspec calibrate --head feature`), else the one
    shipped for this model; draft_vocab N: only the first N of its draft-head tokens."""
    from selfspec.drafters.feature import FeatureDraft
    from selfspec.heads.feature_head import feature_head_for

    head, draft_ids, _ = feature_head_for(o.get("profile") or {}, o.get("identity"))
    vocab = o.get("draft_vocab")
    if vocab is not None:
        if not 1 <= vocab <= draft_ids.numel():
            raise ValueError(f"draft_vocab must be in 1..{draft_ids.numel()} (the tokens this feature head was "
                             f"trained with), got {vocab}")
        draft_ids = draft_ids[:vocab]
    return FeatureDraft(head, 3 if o.get("draft_len") is None else o["draft_len"], draft_ids=draft_ids,
                        threshold=o.get("threshold"), siblings=o.get("siblings") or 1)


DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "ar": lambda **options: Autoregressive(),
    "early-exit": _early_exit,
    "layer-skip": _layer_skip,
    "swift": _swift,
    "clasp": _clasp,
    "conflayers": _conflayers,
    "lookup": _lookup,
    "hybrid": _hybrid,
    "expert-subset": _expert_subset,
    "saguaro": _saguaro,
    "feature": _feature,
}
METHODS = tuple(DRAFTERS)


def make_drafter(method: str, **options) -> Drafter:
    if method not in DRAFTERS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    return DRAFTERS[method](**options)


__all__ = ["DRAFTERS", "METHODS", "Autoregressive", "Draft", "DraftContext", "Drafter", "EarlyExit", "make_drafter"]
