"""Continuous batching: rows of different prompts decoded together, each exactly as alone."""

import math
import threading

import pytest

from lossless import PROMPT, REPETITIVE
from selfspec.core.batch import QueueFull, Scheduler

PROMPTS = [PROMPT, REPETITIVE, [7, 3, 9], PROMPT[:4] + REPETITIVE[:6], [11] * 12]


@pytest.fixture
def every_draft(monkeypatch):
    """Batches verify every draft (no row's draft dropped for a plain step), so the accept path runs."""
    monkeypatch.setattr(Scheduler, "_choose", lambda self, rows, drafts, confidences=None: (
        list(drafts), self._timer(rows)(list(drafts), parts=True)))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("options", [
    dict(method="ar"),
    dict(method="early-exit", exit_layer=3, draft_len=3),
    dict(method="lookup", draft_len=4),
    dict(method="saguaro", exit_layer=6, draft_len=2),  # pre-drafts while verifying: its rows verify alone
])
def test_batched_greedy_equals_each_prompt_alone(tiny, arch, options, every_draft):
    model = tiny(arch)
    alone = [model.generate(p, method="ar", max_new_tokens=24).tokens for p in PROMPTS]
    batched = model.generate_batch(PROMPTS, max_batch=3, max_new_tokens=24, **options)
    assert [g.tokens for g in batched] == alone
    if options["method"] != "ar":
        assert sum(g.stats.accepted for g in batched) > 0  # the accept path ran in the batch


def test_batched_sampling_equals_each_seeded_prompt_alone(tiny):
    """Each row samples with its own generator in the order it would alone, so a batch's seeded
    samples are the single-request samples (whose distribution the verifier tests check)."""
    model = tiny("llama")
    options = dict(method="early-exit", exit_layer=2, draft_len=3, temperature=1.3, top_k=8, max_new_tokens=16)
    alone = [model.generate(p, seed=i, **options).tokens for i, p in enumerate(PROMPTS)]
    runs = [model.prepare(p, fresh_drafter=True, seed=i, **options) for i, p in enumerate(PROMPTS)]
    got = _run_all(model, runs, max_batch=5)
    assert got == alone


def test_rows_with_different_methods_and_lengths_share_a_batch(tiny):
    """Short rows are padded to the longest draft in the batch, up to their very last token."""
    model = tiny("llama")
    runs = [model.prepare(REPETITIVE, fresh_drafter=True, method="lookup", draft_len=8, max_new_tokens=30),
            model.prepare(PROMPT, fresh_drafter=True, method="ar", max_new_tokens=3),
            model.prepare(PROMPT, fresh_drafter=True, method="early-exit", exit_layer=4, draft_len=2, max_new_tokens=9)]
    got = _run_all(model, runs, max_batch=3)
    assert got == [model.generate(REPETITIVE, method="ar", max_new_tokens=30).tokens,
                   *[model.generate(PROMPT, method="ar", max_new_tokens=n).tokens for n in (3, 9)]]


def test_rows_join_and_leave_between_steps(tiny):
    model = tiny("llama")
    lengths = [3, 20, 5, 12, 8]  # rows finish at different steps; waiting ones take their places
    runs = [model.prepare(PROMPT, fresh_drafter=True, method="early-exit", exit_layer=2, draft_len=2,
                          max_new_tokens=n) for n in lengths]
    scheduler = Scheduler(model.adapter, max_batch=2, max_queue=8)
    outs = _submit(scheduler, runs)
    sizes = []
    while scheduler.step():
        sizes.append(len(scheduler.active))
    assert max(sizes) == 2 and scheduler.totals.requests == 5
    alone = model.generate(PROMPT, method="ar", max_new_tokens=20).tokens
    assert [o["tokens"] for o in outs] == [alone[:n] for n in lengths]
    assert scheduler.totals.rows > scheduler.totals.steps  # some verifies really were batched


def test_cancel_frees_the_row_for_a_waiting_request(tiny):
    model = tiny("llama")
    runs = [model.prepare(PROMPT, fresh_drafter=True, method="ar", max_new_tokens=40) for _ in range(2)]
    scheduler = Scheduler(model.adapter, max_batch=1, max_queue=1)
    outs = _submit(scheduler, runs)
    scheduler.step()
    scheduler.step()
    assert len(scheduler.active) == 1 and scheduler.queue_depth == 1
    outs[0]["request"].cancel()
    scheduler.step()  # the cancelled row leaves at once; the waiting one is admitted and prefilled
    assert outs[0]["done"] and outs[0]["error"] is None
    assert scheduler.totals.cancelled == 1 and len(outs[0]["tokens"]) < 40
    assert len(scheduler.active) == 1 and outs[1]["tokens"]
    while scheduler.step():
        pass
    assert len(outs[1]["tokens"]) == 40


def test_queue_limit_refuses_past_it(tiny):
    model = tiny("llama")
    scheduler = Scheduler(model.adapter, max_batch=1, max_queue=2)
    runs = [model.prepare(PROMPT, fresh_drafter=True, method="ar", max_new_tokens=4) for _ in range(4)]
    _submit(scheduler, runs[:3])  # one for the free row, two waiting
    with pytest.raises(QueueFull):
        _submit(scheduler, runs[3:])


def test_one_failing_row_does_not_stop_the_others(tiny):
    model = tiny("llama")
    good = model.prepare(PROMPT, fresh_drafter=True, method="early-exit", exit_layer=2, max_new_tokens=12)
    bad = model.prepare(PROMPT, fresh_drafter=True, method="early-exit", exit_layer=2, max_new_tokens=12)

    def broken(*args):
        raise RuntimeError("drafter broke")

    bad.drafter.propose = broken
    scheduler = Scheduler(model.adapter, max_batch=2)
    outs = _submit(scheduler, [good, bad])
    while scheduler.step():
        pass
    assert isinstance(outs[1]["error"], RuntimeError) and outs[0]["error"] is None
    assert outs[0]["tokens"] == model.generate(PROMPT, method="ar", max_new_tokens=12).tokens
    assert scheduler.totals.failed == 1


def test_a_stop_from_the_consumer_ends_the_row(tiny):
    model = tiny("llama")
    run = model.prepare(PROMPT, fresh_drafter=True, method="ar", max_new_tokens=30)
    got = []
    scheduler = Scheduler(model.adapter)
    scheduler.submit(run.request(on_tokens=lambda t: got.extend(t) or len(got) < 5, on_done=lambda e: None))
    while scheduler.step():
        pass
    assert len(got) == 5


def test_run_thread_serves_submissions(tiny):
    model = tiny("llama")
    scheduler = Scheduler(model.adapter, max_batch=4)
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,), daemon=True)
    thread.start()
    runs = [model.prepare(p, fresh_drafter=True, method="lookup", max_new_tokens=10) for p in PROMPTS[:3]]
    outs = _submit(scheduler, runs)
    for o in outs:
        assert o["event"].wait(30)
    stop.set()
    thread.join(5)
    assert [o["tokens"] for o in outs] == [model.generate(p, method="ar", max_new_tokens=10).tokens for p in PROMPTS[:3]]


def _submit(scheduler, runs):
    outs = []
    for run in runs:
        out = {"tokens": [], "done": False, "error": None, "event": threading.Event()}

        def on_done(error, out=out):
            out.update(done=True, error=error)
            out["event"].set()

        out["request"] = run.request(on_tokens=out["tokens"].extend, on_done=on_done)
        scheduler.submit(out["request"])
        outs.append(out)
    return outs


def _run_all(model, runs, max_batch):
    scheduler = Scheduler(model.adapter, max_batch=max_batch)
    outs = _submit(scheduler, runs)
    while scheduler.step():
        pass
    assert all(o["error"] is None for o in outs)
    return [o["tokens"] for o in outs]


def test_partition_groups_rows_by_the_least_estimated_time():
    from selfspec.core.batch import partition

    def linear(members, n):  # a step, plus a quarter step a row
        return 1 + 0.25 * (len(members) * n - 1)

    groups = partition([1, 17, 1, 1], linear)  # three plain steps share; a long draft goes alone
    assert sorted(map(sorted, groups)) == [[0, 2, 3], [1]]
    groups = partition([4, 3, 4, 4], linear)  # near lengths share, padded to 4
    assert sorted(map(sorted, groups)) == [[0, 1, 2, 3]]
    assert partition([2, 2, 2], lambda m, n: math.inf if len(m) > 1 else 1.0) == [[0], [1], [2]]
    unknown = partition([3, 1, 3, 1, 5], lambda m, n: None)  # nothing timed: equal lengths share
    assert sorted(map(sorted, unknown)) == [[0, 2], [1, 3], [4]]
    assert partition([], linear) == []


def test_a_batch_keeps_the_draft_tokens_that_pay_and_cuts_the_rest(monkeypatch):
    """Per draft token: beside two rows whose drafts are rarely accepted, the row whose drafts
    usually are keeps a draft, the others step plain; with every row's drafts accepted as rarely,
    none is kept; a draft whose drafter gave its tokens' chances keeps its likely head and loses
    its doubtful tail; before anything was timed, every draft stays whole."""
    from types import SimpleNamespace

    def row(accepted, drafted):
        return (None, SimpleNamespace(stats=SimpleNamespace(accepted=accepted, drafted=drafted)), None)

    def unpadded(per_row):  # one shared forward: a step, plus per_row of a step a row
        def timer(lengths, parts=False):
            return [list(range(len(lengths)))] if parts else 1 + per_row * (sum(n + 1 for n in lengths) - 1)
        return timer

    scheduler = Scheduler(adapter=None)
    monkeypatch.setattr(Scheduler, "_timer", lambda self, rows: unpadded(0.1))
    keep, parts = scheduler._choose([row(1, 20), row(90, 100), row(1, 20)], [8, 8, 8])
    assert keep[0] == keep[2] == 0 and keep[1] > 2 and parts == [[0, 1, 2]]
    keep, _ = scheduler._choose([row(1, 20), row(2, 20), row(1, 20)], [8, 8, 8])
    assert keep == [0, 0, 0]
    confident = [1.0, 1.0, 0.95, 0.9, 0.1, 0.9, 0.9, 0.9]  # a sure head, then a doubtful token
    keep, _ = scheduler._choose([row(1, 20), row(1, 20), row(1, 20)], [8, 8, 8], [None, confident, None])
    assert keep == [0, 4, 0]
    monkeypatch.setattr(Scheduler, "_timer", lambda self, rows: unpadded(1.2))  # a row costs more than a step
    keep, _ = scheduler._choose([row(1, 20), row(1, 20)], [8, 8], [None, confident])
    assert keep == [0, 0]
    monkeypatch.setattr(Scheduler, "_timer", lambda self, rows: lambda lengths, parts=False: (
        [list(range(len(lengths)))] if parts else None))
    keep, _ = scheduler._choose([row(1, 20), row(90, 100), row(1, 20)], [8, 0, 8])
    assert keep == [8, 0, 8]


def test_a_batch_drops_drafts_that_cost_more_than_they_are_expected_to_commit(tiny):
    """With a verify clock that makes each extra row cost a whole step, drafts cannot pay beside
    other rows: the batch runs plain steps (greedy output unchanged), after the first drafts
    without asking the drafters (but every PROBE_EVERY-th step), and a dropped draft teaches its
    drafter nothing (no observe); with rows free every draft is verified whole and observed."""
    from selfspec.core.batch import PROBE_EVERY
    from selfspec.core.verify_clock import clock_for, shared_clock_for

    model = tiny("llama")
    want = [model.generate(p, method="ar", max_new_tokens=20).tokens for p in PROMPTS[:3]]
    clocks = clock_for(model.adapter), shared_clock_for(model.adapter)
    for per_row, dropped in ((1.0, True), (0.0, False)):
        for clock in clocks:
            clock.seconds = {n: 1.0 + per_row * (n - 1) for n in range(1, 33)}
            clock.add = lambda rows, seconds: None  # the set times stay
        runs = [model.prepare(p, fresh_drafter=True, method="lookup", draft_len=4, max_new_tokens=20) for p in PROMPTS[:3]]
        calls = {"propose": 0, "observe": 0}
        for run in runs:
            for name in calls:
                def counted(*args, _f=getattr(run.drafter, name), _name=name):
                    calls[_name] += 1
                    return _f(*args)
                setattr(run.drafter, name, counted)
        scheduler = Scheduler(model.adapter, max_batch=3)
        outs = _submit(scheduler, runs)
        steps = 0
        while scheduler.step():
            steps += 1
        assert [o["tokens"] for o in outs] == want
        rounds = sum(run.stats.rounds for run in runs)
        assert (scheduler.totals.drafts_dropped > 0) == dropped
        assert (scheduler.totals.drafting_skipped > 0) == dropped
        if dropped:
            assert calls["propose"] <= 3 * (1 + steps // PROBE_EVERY) < rounds
            assert calls["observe"] < rounds
        else:
            assert calls["propose"] == calls["observe"] == rounds
        for clock in clocks:
            del clock.add


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_drafts_a_batch_cuts_keep_greedy_output_and_teach_only_what_was_verified(tiny, arch, monkeypatch):
    """Every batched draft cut to its first half (Decoding.cut; ModelAdapter.run_ragged verifies the
    rows unpadded where the fused layer runs): every request's greedy tokens are still its plain
    decoding's. The suffix drafter is told of each cut (`cut`) and learns from the tokens verified;
    lookup, which has no `cut`, is not told of a cut round (no observe)."""
    from selfspec.drafters.suffix import SuffixDraft, SuffixStore

    model = tiny(arch)
    want = [model.generate(p, method="ar", max_new_tokens=24).tokens for p in PROMPTS]
    monkeypatch.setattr(Scheduler, "_choose", lambda self, rows, drafts, confidences=None: (
        [n // 2 for n in drafts], self._timer(rows)([n // 2 for n in drafts], parts=True)))
    store = SuffixStore()
    for p, w in zip(PROMPTS, want):
        store.add(list(p) + w)  # so suffix drafts long
    suffix = [SuffixDraft(store, draft_len=8) for _ in PROMPTS]
    cuts, observed, proposed = [], [], []
    for d in suffix:
        d.cut = lambda m, _f=d.cut: cuts.append(m) or _f(m)
        d.propose = lambda *args, _f=d.propose: proposed.append(_f(*args)) or proposed[-1]
        d.observe = lambda n, _f=d.observe, _d=d: observed.append((len(_d._ratios), n)) or _f(n)
    runs = [model.prepare(p, fresh_drafter=True, drafter=d, max_new_tokens=24) for p, d in zip(PROMPTS, suffix)]
    scheduler = Scheduler(model.adapter, max_batch=len(PROMPTS))
    outs = _submit(scheduler, runs)
    while scheduler.step():
        pass
    assert [o["tokens"] for o in outs] == want
    assert scheduler.totals.drafts_cut > 0 and cuts and max(cuts) >= 2
    assert all(n <= verified for verified, n in observed)  # each round learnt from the verified tokens
    for d in proposed:  # each token's calibrated chance, for the batch to weigh it by
        assert d.confidence is not None and len(d.confidence) == len(d)
        assert all(0 < c <= 1 for c in d.confidence)
    lookups = [model.prepare(p, fresh_drafter=True, method="lookup", draft_len=6, max_new_tokens=24) for p in PROMPTS]
    told = []
    for run in lookups:
        run.drafter.observe = lambda n: told.append(n)
    assert _run_all(model, lookups, max_batch=len(PROMPTS)) == want
    proposed_rounds = sum(run.stats.rounds for run in lookups)
    assert len(told) < proposed_rounds


def test_shared_verifies_are_timed_on_their_own_clock(tiny):
    """A verify several sequences shared goes to the model's shared clock, not the lone one (each
    sequence adds its own attention); the scheduler's estimates read the shared clock once it has
    figures, the lone one before."""
    from selfspec.core.batch import _estimates
    from selfspec.core.verify_clock import clock_for, shared_clock_for

    model = tiny("llama")
    lone, shared = clock_for(model.adapter), shared_clock_for(model.adapter)
    lone.seconds, shared.seconds = {1: 1.0, 8: 2.0}, {}
    assert _estimates(model.adapter)(8) == 2.0
    shared.add(8, 5.0)
    assert _estimates(model.adapter)(8) == 5.0
    shared.seconds = {}
    runs = [model.prepare(p, fresh_drafter=True, method="lookup", draft_len=3, max_new_tokens=12) for p in PROMPTS[:3]]
    _run_all(model, runs, max_batch=3)
    assert shared.seconds  # the shared forwards were timed there
