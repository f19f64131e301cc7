"""The speculation a user asks for: a method and that method's options, as one frozen, typed value.

The CLI builds it from its flags (`Speculation.from_dict`), the Python API from `generate`'s
keywords (`Speculation.from_options`), the server from a request's `selfspec` field over its own
defaults (`Speculation.override`), bench and the tuner hold it, and tuned profiles store it
(`to_dict`). Checks that need no model run when it is built: the method is known, every value has
its type and range, and every option given is one the method takes (`TAKES`). `validate` checks it
against a model's depth; `selfspec.api.SelfSpecModel.resolve` then reads the model's files and this
machine into a `Resolved`, from which the registry (`selfspec.drafters.make_drafter`) builds the
drafter and decides nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from selfspec.model.profiles import ModelIdentity
from selfspec.model.skips import SkipSet

AUTO = "auto"  # what `selfspec tune` chose for this model, else the shipped choice, else plain decoding


@dataclass(frozen=True)
class Speculation:
    method: str = AUTO  # a drafter name (selfspec.drafters.METHODS) or "auto"
    # Each option: None = the method's own default (see `selfspec generate --help`).
    exit_layer: int | None = None  # k: the draft runs layers 0..k-1 (1..n_layers); early exit: the profile's head's k, else 3/4 of the depth; expert-subset: every layer
    draft_len: int | None = None  # γ: the most tokens drafted per round (adaptive drafters may stop sooner); exact mode: at most 3
    threshold: float | None = None  # in [0, 1]: end a draft after a token whose draft top-1 probability is below it
    skip: SkipSet | None = None  # layer-skip's skipped sublayers ('attn:1,3 mlp:2-5' parses); None: the profile's from `selfspec search`
    skip_ratio: float | None = None  # in [0, 1): share of (sub)layers SWIFT, CLaSp and ConfLayers skip
    every: int | None = None  # rounds between CLaSp/ConfLayers re-optimisations; SWIFT: iterations between Bayesian proposals
    ngram: int | None = None  # prompt lookup's longest n-gram to match (3)
    profile: str | None = None  # a profile JSON file to use instead of this model's saved one
    exit_adapter: str | None = None  # early exit's exit adapter or context head file, or "none"; None: the profile's when its k is the one asked (no k asked: its k)
    draft_vocab: int | None = None  # N: early exit's head pruned to the N most frequent tokens, or the feature head's first N; None: all
    experts: int | None = None  # expert-subset: routed experts per token in each MoE layer of the draft (1)
    siblings: int | None = None  # 1..15: the feature head's m likeliest first tokens verified as alternatives (feature 1; hybrid 2 on AMX, else 1)

    def __post_init__(self):
        if isinstance(self.skip, str):
            object.__setattr__(self, "skip", SkipSet.parse(self.skip))
        if self.exit_adapter is False:
            object.__setattr__(self, "exit_adapter", "none")
        for name in ("profile", "exit_adapter"):  # paths as text: JSON-ready, hashable
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        if self.method not in TAKES:
            raise ValueError(f"unknown method {self.method!r}; choose one of: {', '.join(TAKES)}")
        for name in OPTIONS:
            value = getattr(self, name)
            if value is not None:
                _check(name, value)
        given = self.options()
        if self.method != AUTO:
            for name in given:
                if name not in TAKES[self.method]:
                    takers = [m for m, takes in TAKES.items() if name in takes and m != AUTO]
                    raise ValueError(f"{name} ({FLAGS[name]}) is not an option of method {self.method}: it "
                                     f"applies to {', '.join(takers)}")

    def options(self) -> dict:
        """The options given (not None), by name."""
        return {name: getattr(self, name) for name in OPTIONS if getattr(self, name) is not None}

    @classmethod
    def from_options(cls, method: str | None = None, **options) -> Speculation:
        """From keyword options as `generate` takes them (None: not given; unknown names refused)."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"unknown speculation option(s) {', '.join(unknown)}; the options: {', '.join(OPTIONS)}")
        return cls(method or AUTO, **{k: v for k, v in options.items() if v is not None})

    @classmethod
    def from_dict(cls, data: Mapping) -> Speculation:
        """From JSON (a profile, a request field, bench output): `to_dict`'s form; unknown keys refused."""
        return cls.from_options(**dict(data))

    @classmethod
    def relevant(cls, method: str, **options) -> Speculation:
        """`method` with those of `options` it takes: one sweep's options over several methods (bench)."""
        takes = TAKES.get(method, ())
        return cls(method, **{k: v for k, v in options.items() if k in takes and v is not None})

    def to_dict(self) -> dict:
        """The method and the options given, as JSON (the skip set in its parsable text form)."""
        out = {"method": self.method, **self.options()}
        if self.skip is not None:
            out["skip"] = _skip_text(self.skip)
        return out

    def override(self, other: Speculation | Mapping | None) -> Speculation:
        """These defaults under `other`'s choices (the server: a request's field over its command line).
        Another method keeps only the defaults it takes; what `other` gives must be options of its method."""
        if other is None:
            return self
        if isinstance(other, Speculation):
            other = {"method": other.method, **other.options()}
        changes = {k: v for k, v in other.items() if v is not None}
        unknown = sorted(set(changes) - set(OPTIONS) - {"method"})
        if unknown:
            raise ValueError(f"unknown speculation option(s) {', '.join(unknown)}")
        method = changes.pop("method", self.method)
        cls = type(self)
        cls(method, **changes)  # what the request gives must suit its method, whatever the defaults
        return cls.relevant(method, **{**self.options(), **changes})

    def validate(self, n_layers: int) -> Speculation:
        """Check against a model with `n_layers` layers: k in 1..n_layers, the skip set's layers present."""
        if self.exit_layer is not None and not 1 <= self.exit_layer <= n_layers:
            raise ValueError(f"exit layer must be in 1..{n_layers} for this model, got {self.exit_layer}")
        if self.skip is not None:
            self.skip.check(n_layers)
        return self


OPTIONS = tuple(f.name for f in fields(Speculation) if f.name != "method")

# Which options each method takes; giving one that its method does not take is an error. auto takes
# every option: the method it runs keeps those it takes (which method that is depends on the profile).
_EARLY_EXIT = ("exit_layer", "draft_len", "threshold", "exit_adapter", "draft_vocab", "profile")
_SKIPPING = ("draft_len", "threshold", "skip_ratio", "every")
_LOOKUP = ("draft_len", "ngram")
_FEATURE = ("draft_len", "threshold", "draft_vocab", "siblings", "profile")
_LAYER_SKIP = ("draft_len", "threshold", "skip", "profile")
TAKES: dict[str, tuple[str, ...]] = {
    AUTO: OPTIONS,
    "ar": (),
    "early-exit": _EARLY_EXIT,
    "layer-skip": _LAYER_SKIP,
    "swift": _SKIPPING,
    "clasp": _SKIPPING,
    "conflayers": _SKIPPING,
    "lookup": _LOOKUP,
    # lookup, else a model draft: layer-skip, the feature head or early exit (see selfspec.drafters.hybrid)
    "hybrid": tuple(dict.fromkeys(_LOOKUP + _LAYER_SKIP + _FEATURE + _EARLY_EXIT)),
    "expert-subset": ("exit_layer", "draft_len", "experts"),
    "saguaro": _EARLY_EXIT,
    "feature": _FEATURE,
    "suffix": ("draft_len",),  # suffix decoding over every request's text (selfspec.drafters.suffix)
}

FLAGS = {name: "--" + name.replace("_", "-") for name in OPTIONS}  # as the CLI spells them
FLAGS.update(exit_layer="--exit-layer/-k", draft_len="--draft-len/-g")

# name -> (type, lowest, highest); highest None: unbounded
_RANGES = {
    "exit_layer": (int, 1, None), "draft_len": (int, 1, None), "threshold": (float, 0.0, 1.0),
    "skip_ratio": (float, 0.0, 1.0), "every": (int, 1, None), "ngram": (int, 1, None),
    "draft_vocab": (int, 1, None), "experts": (int, 1, None), "siblings": (int, 1, 15),
}
_WORDS = {"exit_layer": "exit layer", "draft_len": "draft length"}


def _check(name: str, value) -> None:
    if name == "skip":
        if not isinstance(value, SkipSet):
            raise ValueError(f"--skip must be a skip set such as 'attn:3,5 mlp:10-14', got {value!r}")
        return
    if name in ("profile", "exit_adapter"):
        if not isinstance(value, str):
            raise ValueError(f"{name} ({FLAGS[name]}) must be a file path{' or none' if name == 'exit_adapter' else ''}, "
                             f"got {value!r}")
        return
    kind, lo, hi = _RANGES[name]
    ok_type = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    what = f"{_WORDS.get(name, name)} ({FLAGS[name]})"
    if isinstance(value, bool) or not ok_type:
        raise ValueError(f"{what} must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    if name == "skip_ratio" and not lo <= value < hi:  # each family refuses what it cannot run (SWIFT: 0)
        raise ValueError(f"{what} must be in [0, 1), got {value}")
    if name == "siblings" and not lo <= value <= hi:
        raise ValueError(f"{what} must be 1 (a chain) .. 15 (a verify takes 16 rows), got {value}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{what} must be {f'in {lo}..{hi}' if hi is not None else f'>= {lo}'}, got {value}")


def _skip_text(skip: SkipSet) -> str:
    """A skip set in the form SkipSet.parse reads."""
    parts = [f"{kind}:{','.join(map(str, sorted(layers)))}" for kind, layers in (("attn", skip.attn), ("mlp", skip.mlp))
             if layers]
    return " ".join(parts)


@dataclass(frozen=True)
class Resolved:
    """A Speculation made concrete for one model on this machine (selfspec.api.SelfSpecModel.resolve
    reads the profile, the head files and the CPU for it): what the registry builds a drafter from."""

    speculation: Speculation  # never auto; k filled in where the draft exits at a layer; siblings where hybrid has a default
    identity: ModelIdentity | None = None  # the model's: head files are checked against it
    fallback: str | None = None  # hybrid's model draft: "layer-skip", "feature" or "early-exit"
    profile: dict = field(default_factory=dict, compare=False)  # the model's profile (or the file asked), read once
    store: object | None = None  # suffix: the SuffixStore this request drafts from and adds to (its model's, its tenant's)
