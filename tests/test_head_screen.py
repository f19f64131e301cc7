"""Tests for selfspec.model.head_screen: a greedy pick through the screen is the full int8 head's
argmax, ties to the first index included, and the candidates' logits are the full head's bits."""

import pytest
import torch
from tiny_models import tiny_model

from selfspec.api import SelfSpecModel
from selfspec.model import head_screen
from selfspec.model.head_screen import HeadScreen, top1_logits
from selfspec.model.quantize import int8_rows, quantize_int4, quantize_int8
from selfspec.native import gemv

pytestmark = pytest.mark.skipif(not gemv.available(), reason="the screen runs selfspec's kernels")


def _full(x, weight, scale):
    return torch.cat([gemv.linear(x[i:i + gemv.MAX_ROWS], weight, None, scale)
                      for i in range(0, x.shape[0], gemv.MAX_ROWS)]).float()


@pytest.fixture(autouse=True)
def gather_all(request, monkeypatch):
    """The screen gathers however many candidates it keeps (its cost cap, GATHER, has its own test)."""
    if "probes" not in request.node.name:
        monkeypatch.setattr(head_screen, "GATHER", 1.0)


def _top1(x, screen, weight, scale):
    """top1_logits with the screen's pay gate open (the gate has its own test)."""
    screen.share = None
    return top1_logits(x, screen, _exact(weight, scale))


def _exact(weight, scale):
    def exact(x, vocab):
        return _full(x, weight.index_select(0, vocab), scale.index_select(0, vocab))
    return exact


def _head(out=1024, inp=192, seed=0):
    """An int8 head whose rows make the int4 copy's ranking wrong: exact duplicates (ties, the
    first index must win), rows one int8 step from a strong row, and a few strong rows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    strong = torch.randint(0, out, (8,), generator=g)
    w[strong] *= 4
    weight, scale = int8_rows(w.to(torch.bfloat16), torch.bfloat16)
    for s in strong.tolist()[:4]:
        twin = (s * 7 + 3) % out
        weight[twin] = weight[s]  # a tie in every logit the two rows give
        scale[twin] = scale[s]
        near = (s * 11 + 5) % out
        weight[near] = weight[s]
        scale[near] = scale[s]
        weight[near, s % inp] = (weight[s, s % inp].int() + 1).clamp(-127, 127).to(torch.int8)  # one step apart
    return weight.contiguous(), scale.contiguous(), strong


def _rows(inp, strong_rows, n=48, seed=1):
    """Hidden rows: random, with outlier features (as final-norm outputs have), and rows aimed at
    the strong rows (large, close logits)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inp, generator=g)
    x[:, :3] *= 20
    x[n // 2:] += 3 * strong_rows[torch.arange(n - n // 2) % strong_rows.shape[0]]
    return x.to(torch.bfloat16)


def test_the_screened_argmax_is_the_full_heads_and_its_candidates_its_bits(path):
    weight, scale, strong = _head()
    screen = HeadScreen.of(weight, scale)
    x = _rows(weight.shape[1], (weight[strong].float() * scale[strong].float()[:, None]) * 8)
    full = _full(x, weight, scale)
    for n in (1, 3, 16, 48):
        got = _top1(x[:n], screen, weight, scale)
        assert torch.equal(got.argmax(-1), full[:n].argmax(-1))
        kept = torch.isfinite(got)
        assert torch.equal(got[kept], full[:n][kept])
        assert kept.sum(1).min() >= 1 and kept.sum(1).float().mean() < weight.shape[0]  # it screens out rows
    # ties: a duplicated strong row loses to the first index, as torch's argmax of the full head
    dup = full.argmax(-1)
    assert (full.eq(full.max(-1, keepdim=True).values).sum(1) > 1).any(), "the rows make ties"
    assert torch.equal(_top1(x, screen, weight, scale).argmax(-1), dup)


def test_a_screen_without_its_bound_would_miss_the_argmax(path):
    """The bound is what makes it exact: the same rows through a screen that trusts the 4-bit copy
    (bounds zeroed) pick another token somewhere."""
    weight, scale, _ = _head()
    screen = HeadScreen.of(weight, scale)
    x = torch.randn(200, weight.shape[1], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    full = _full(x, weight, scale).argmax(-1)
    picks = {}
    for bounded in (True, False):
        if not bounded:
            screen.bounds.data.zero_()
        picks[bounded] = torch.cat([_top1(x[i:i + 1], screen, weight, scale).argmax(-1)
                                    for i in range(x.shape[0])])
    assert torch.equal(picks[True], full) and not torch.equal(picks[False], full)


def test_a_row_that_is_not_finite_is_left_to_the_full_head():
    weight, scale, _ = _head(out=256, inp=64)
    screen = HeadScreen.of(weight, scale)
    x = torch.randn(2, 64).to(torch.bfloat16)
    x[1, 5] = float("nan")
    assert screen.candidates(x) is None and top1_logits(x, screen, _exact(weight, scale)) is None


def test_a_screen_that_keeps_most_of_the_vocabulary_stops_and_probes_ever_less_often():
    """Many candidates (every logit alike) leave the call to the full head (more than GATHER of
    the vocabulary) and make the screen step aside; it probes again after PROBE_EVERY calls, then
    after twice as many; few candidates make it run every call."""
    weight, scale, _ = _head(out=512, inp=64)
    screen = HeadScreen.of(weight, scale)
    calls, ran = [0], []
    original = screen.candidates
    screen.candidates = lambda x: ran.append(calls[0]) or original(x)
    zeros = torch.zeros(1, 64, dtype=torch.bfloat16)  # every logit 0: every token a candidate
    for calls[0] in range(4 * head_screen.PROBE_EVERY):
        assert top1_logits(zeros, screen, _exact(weight, scale)) is None
    assert ran == [0, head_screen.PROBE_EVERY, 3 * head_screen.PROBE_EVERY]
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 0] = 50.0
    weight[7], scale[7] = 127, scale.max() * 10  # one row far above the rest: few candidates
    screen = HeadScreen.of(weight, scale)
    assert all(top1_logits(x, screen, _exact(weight, scale)) is not None for _ in range(20))
    assert screen.share <= head_screen.SHARE


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_decoding_through_the_screen_equals_the_full_head(mode, arch):
    """Every method's greedy tokens with the screen equal plain decoding without it, and the
    screen ran (its candidates were asked for)."""
    hf = tiny_model(arch, dtype=torch.bfloat16)
    {"int4": quantize_int4, "int8": quantize_int8}[mode](hf)
    model = SelfSpecModel(hf, dtype_name=mode)
    screen = model.adapter.lm_head.screen
    asked = []
    original = screen.candidates
    screen.candidates = lambda x: asked.append(x.shape[0]) or original(x)
    prompt = [5, 17, 42, 8, 63, 21, 5, 17, 42]
    outputs = {}
    for method in ("ar", "lookup", "early-exit", "swift"):
        outputs[method] = model.generate(prompt, method=method, max_new_tokens=24).tokens
    assert asked
    del model.adapter.lm_head.screen
    plain = model.generate(prompt, method="ar", max_new_tokens=24).tokens
    assert all(tokens == plain for tokens in outputs.values()), outputs
