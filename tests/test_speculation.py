"""One typed value says how to speculate (selfspec.core.speculation): every method builds from it,
a bad one is refused with a message that names what to change, and it survives JSON."""

import pytest
import torch

from selfspec import Speculation
from selfspec.core.speculation import OPTIONS, TAKES
from selfspec.drafters import METHODS, make_drafter
from selfspec.serve.openai_schema import request_speculation

# Per method: options it takes, as a user gives them (the tiny models have 6 layers).
GIVEN = {
    "ar": {},
    "early-exit": dict(exit_layer=3, draft_len=3, threshold=0.5),
    "layer-skip": dict(skip="attn:2 mlp:3-4", draft_len=4),
    "swift": dict(draft_len=6, skip_ratio=0.4, every=2),
    "clasp": dict(every=2, draft_len=4),
    "conflayers": dict(every=2, draft_len=4, skip_ratio=0.3),
    "lookup": dict(draft_len=4, ngram=2),
    "suffix": dict(draft_len=6),
    "hybrid": dict(exit_layer=3, draft_len=4, ngram=2),
    "expert-subset": dict(draft_len=4, experts=1),
    "saguaro": dict(exit_layer=3, draft_len=3),
    "feature": dict(draft_len=2, siblings=1),
}
ARCH = {"expert-subset": "mixtral"}


def test_every_method_has_its_row_of_options():
    assert set(GIVEN) == set(METHODS) == set(TAKES) - {"auto"}
    assert set(TAKES["auto"]) == set(OPTIONS)
    for method, given in GIVEN.items():
        assert set(given) <= set(TAKES[method])


@pytest.mark.parametrize("method", METHODS)
def test_every_method_builds_from_a_speculation(method, tiny, tmp_path):
    from selfspec.heads.feature_head import SECTION, FeatureHead, save_feature_head
    from selfspec.model.profiles import save_section

    model = tiny(ARCH.get(method, "llama"))
    spec = Speculation(method, **GIVEN[method])
    if method == "feature":
        head = FeatureHead(64, model.n_layers, heads=2, head_dim=16)
        save_section(model.identity, SECTION, {"path": str(save_feature_head(head, tmp_path / "f.safetensors",
                                                                              model.identity, torch.arange(90)))})
    try:
        resolved = model.resolve(spec)
        drafter = make_drafter(resolved)
        assert drafter.name == method
        if "draft_len" in GIVEN[method]:
            assert drafter.draft_len == GIVEN[method]["draft_len"]
        out = model.generate([5, 17, 33, 8, 61, 5, 17, 33], speculation=spec, max_new_tokens=6)
        assert out.stats.method == method and len(out.tokens) == 6
        # the keyword form builds the same value
        assert model.generate([5, 17, 33, 8], method=method, max_new_tokens=3, **GIVEN[method]).stats.method == method
    finally:
        if method == "feature":
            save_section(model.identity, SECTION, {})


@pytest.mark.parametrize("bad, message", [
    (dict(method="magic"), "unknown method 'magic'"),
    (dict(method="lookup", exit_layer=3), "exit_layer (--exit-layer/-k) is not an option of method lookup: it "
                                          "applies to early-exit, hybrid, expert-subset, saguaro"),
    (dict(method="early-exit", ngram=2), "ngram (--ngram) is not an option of method early-exit"),
    (dict(method="ar", draft_len=3), "is not an option of method ar"),
    (dict(method="early-exit", draft_len=0), "draft length (--draft-len/-g) must be >= 1, got 0"),
    (dict(method="swift", skip_ratio=1.0), "must be in [0, 1)"),
    (dict(method="feature", siblings=16), "1 (a chain) .. 15"),
    (dict(method="early-exit", exit_layer="deep"), "must be an integer"),
    (dict(method="hybrid", threshold=1.5), "threshold (--threshold) must be in 0.0..1.0"),
])
def test_a_bad_speculation_is_refused_when_built(bad, message):
    with pytest.raises(ValueError) as error:
        Speculation(**bad)
    assert message in str(error.value)


def test_a_speculation_is_checked_against_the_model(tiny):
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"exit layer must be in 1\.\.6 for this model, got 7"):
        model.resolve(Speculation("early-exit", exit_layer=7))
    with pytest.raises(ValueError, match=r"skip set names layers \[9\]"):
        model.generate([1, 2, 3], method="layer-skip", skip="9")
    with pytest.raises(FileNotFoundError, match="no exit adapter at /nowhere"):
        model.resolve(Speculation("early-exit", exit_adapter="/nowhere.safetensors"))
    with pytest.raises(FileNotFoundError, match="no profile at"):
        model.resolve(Speculation("early-exit", profile="/nowhere.json"))
    with pytest.raises(TypeError, match="not both"):
        model.generate([1, 2, 3], speculation=Speculation("lookup"), draft_len=3)
    with pytest.raises(TypeError, match="unknown speculation option"):
        model.generate([1, 2, 3], method="lookup", gamma=3)


def test_exact_mode_limits_the_draft_length(tiny):
    import selfspec
    from tiny_models import tiny_model

    model = selfspec.SelfSpecModel(tiny_model("llama", 0), name="tiny-llama", exact=True)
    if model.exact_limit() is None:  # the fused layer runs: any length
        assert model.resolve(Speculation("lookup", draft_len=40)).speculation.draft_len == 40
    else:  # every forward in the padded bucket
        limit = model.exact_limit() - 1
        with pytest.raises(ValueError, match=f"draft length must be at most {limit}"):
            model.resolve(Speculation("lookup", draft_len=limit + 1))
        assert model.resolve(Speculation("lookup", draft_len=limit)).speculation.draft_len == limit
    assert model.resolve(Speculation("lookup")).speculation.draft_len == 3  # the most its bucket holds
    assert model.resolve(Speculation("ar")).speculation.draft_len is None  # AR drafts nothing


def test_auto_keeps_the_options_its_method_takes(tiny):
    model = tiny("llama")
    resolved = model.resolve(Speculation(exit_layer=3, draft_len=2, ngram=4))  # untuned: k or γ asks for early exit
    assert resolved.speculation == Speculation("early-exit", exit_layer=3, draft_len=2)
    assert model.resolve(Speculation(ngram=4)).speculation == Speculation("ar")  # no tune, nothing shipped


def test_json_round_trip_and_old_profile_sections():
    spec = Speculation("layer-skip", skip="attn:1,3 mlp:2-4", draft_len=5, threshold=0.5)
    assert Speculation.from_dict(spec.to_dict()) == spec
    assert spec.to_dict() == {"method": "layer-skip", "draft_len": 5, "threshold": 0.5, "skip": "attn:1,3 mlp:2,3,4"}
    # what `selfspec tune` wrote before: the three keys, nulls included
    assert Speculation.from_dict({"method": "lookup", "exit_layer": None, "draft_len": 3}) == \
        Speculation("lookup", draft_len=3)
    with pytest.raises(TypeError, match="unknown speculation option"):
        Speculation.from_dict({"method": "lookup", "gamma": 3})


def test_the_servers_defaults_under_a_requests_choice():
    defaults = Speculation("lookup", draft_len=3, ngram=1)
    assert defaults.override(None) == defaults
    assert defaults.override({"draft_len": 2}) == Speculation("lookup", draft_len=2, ngram=1)
    # another method keeps only the defaults it takes
    assert defaults.override({"method": "early-exit", "exit_layer": 2}) == \
        Speculation("early-exit", exit_layer=2, draft_len=3)
    with pytest.raises(ValueError, match="exit_layer .* is not an option of method lookup"):
        defaults.override({"exit_layer": 2})
    assert request_speculation({"method": "hybrid", "ngram": 2}) == {"method": "hybrid", "ngram": 2}
    for bad, message in (({"profile": "/etc/passwd"}, "unrecognized speculation option"),
                         ({"draft_len": 17}, "at most 16"), ({"method": "magic"}, "unknown method"),
                         ({"exit_layer": 0}, ">= 1")):
        with pytest.raises(ValueError, match=message):
            request_speculation(bad)


def test_the_cli_builds_one_speculation():
    from selfspec.cli import build_parser
    from selfspec.cli.options import speculation

    args = build_parser().parse_args(["generate", "hi", "--method", "hybrid", "-g", "3", "--siblings", "2"])
    assert speculation(args) == Speculation("hybrid", draft_len=3, siblings=2)
    args = build_parser().parse_args(["generate", "hi", "--method", "lookup", "-k", "3"])
    with pytest.raises(ValueError, match="not an option of method lookup"):
        speculation(args)
