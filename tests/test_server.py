"""The OpenAI-compatible server, exercised with the real `openai` client over loopback: answers on
SmolLM2, then what happens to requests that are abandoned, too long or interrupted on a tiny model."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

try:
    import httpx2 as httpx  # the HTTP library recent openai releases ship with
except ImportError:
    import httpx
import openai
import pytest

from selfspec import Speculation

from serving import Running, free_port, save_tiny, slow_steps, tiny_served, wait_until

real = pytest.mark.real
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Say hello in Spanish."]


@pytest.fixture(scope="module")
def served(smollm2):
    running = Running(smollm2, max_batch=4, max_queue=8, speculation=Speculation('lookup', draft_len=3))
    yield running
    running.close()


@real
def test_chat_completion_with_usage_and_speculation_stats(served, smollm2):
    client = served.client()
    reply = client.chat.completions.create(model=served.name, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                           max_tokens=12, temperature=0)
    alone = smollm2.generate(QUESTIONS[0], method="ar", max_new_tokens=12)
    assert reply.choices[0].message.content == alone.text
    assert reply.choices[0].finish_reason in ("length", "stop")
    usage = reply.usage
    assert usage.completion_tokens == len(alone.tokens) and usage.prompt_tokens == alone.stats.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["selfspec"]
    assert spec["method"] == "lookup" and spec["rounds"] >= 1


@real
def test_streamed_chat_and_completion(served, smollm2):
    client = served.client()
    chunks = list(client.chat.completions.create(
        model=served.name, messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == smollm2.generate(QUESTIONS[1], method="ar", max_new_tokens=12).text
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-2].choices[0].finish_reason is not None
    pieces = list(client.completions.create(model=served.name, prompt="The capital of France is", max_tokens=8,
                                            temperature=0, stream=True))
    plain = client.completions.create(model=served.name, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text
    assert plain.choices[0].text == smollm2.generate("The capital of France is", chat=False, method="ar",
                                                     max_new_tokens=8).text


@real
def test_stop_strings_cut_the_text(served, smollm2):
    full = smollm2.generate(QUESTIONS[0], method="ar", max_new_tokens=12).text
    stop = full.split()[2]  # a word the answer is known to contain
    reply = served.client().chat.completions.create(
        model=served.name, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=12, temperature=0,
        stop=[stop])
    assert reply.choices[0].message.content == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


@real
def test_concurrent_requests_are_batched_and_each_equals_ar(served, smollm2):
    client = served.client()
    results = [None] * len(QUESTIONS)

    def ask(i):
        r = client.chat.completions.create(model=served.name, messages=[{"role": "user", "content": QUESTIONS[i]}],
                                           max_tokens=20, temperature=0)  # the server's lookup drafts
        results[i] = r.choices[0].message.content

    before = served.app.state.server.scheduler.totals.rows - served.app.state.server.scheduler.totals.steps
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [smollm2.generate(q, method="ar", max_new_tokens=20).text for q in QUESTIONS]
    totals = served.app.state.server.scheduler.totals
    assert totals.rows - totals.steps > before  # some verify forwards carried more than one request


@real
def test_errors_are_openai_shaped_and_the_server_keeps_serving(served):
    client = served.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert served.name in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=served.name, messages=[{"role": "user", "content": "hi"}], max_tokens=-5)
    assert "max_tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=served.name, prompt="hi", max_tokens=10**9)
    assert "context" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=served.name, messages=[{"role": "user", "content": "hi"}], n=3)
    assert "n must be 1" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=served.name, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"selfspec": {"exit_layer": "deep"}})
    r = httpx.post(served.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"] and r.json()["error"]["param"] is None
    r = httpx.post(served.url + "/v1/completions", json={"model": served.name, "prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(served.url + "/v1/completions", json={"model": served.name, "prompt": "x", "frobnicate": 1})
    assert r.status_code == 400 and "frobnicate" in r.json()["error"]["message"]
    ok = client.completions.create(model=served.name, prompt="Hello", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


@real
def test_models_health_and_metrics(served):
    assert [m.id for m in served.client().models.list().data] == [served.name]
    assert httpx.get(served.url + "/health").json()["status"] == "ok"
    text = httpx.get(served.url + "/metrics").text
    for name in ("selfspec_requests_total", "selfspec_generated_tokens_total", "selfspec_acceptance_rate",
                 "selfspec_mean_accepted_length", "selfspec_draft_seconds_total", "selfspec_verify_seconds_total",
                 "selfspec_queue_depth"):
        assert name in text


@real
def test_disconnect_frees_the_row(served):
    scheduler = served.app.state.server.scheduler
    cancelled = scheduler.totals.cancelled
    body = {"model": served.name, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert json.loads(line[6:])["object"] == "text_completion"
                break
    deadline = time.time() + 20
    while scheduler.totals.cancelled == cancelled or scheduler.active:
        assert time.time() < deadline, "the row was not freed after the client left"
        time.sleep(0.05)
    assert scheduler.totals.new_tokens < 10**6 and not scheduler.active


@real
def test_queue_limit_returns_503_with_retry_after(smollm2):
    running = Running(smollm2, max_batch=1, max_queue=0, speculation=Speculation('ar'))
    try:
        body = {"model": running.name, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=60) as r:
            # Keep the line iterator referenced: a discarded one is closed, which closes the stream,
            # and the server then frees the row (cancelled) before the second request arrives.
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # it holds the only row
            second = httpx.post(running.url + "/v1/completions", json={**body, "stream": False})
            assert second.status_code == 503 and second.headers["retry-after"]
            assert second.json()["error"]["code"] == "queue_full"
    finally:
        running.close()


@real
def test_the_feature_head_is_read_from_disk_once_for_20_hybrid_requests(smollm2, monkeypatch):
    from selfspec.heads import feature_head, tagged_file

    reads = []
    load_file = feature_head.load_file
    monkeypatch.setattr(feature_head, "load_file", lambda path: reads.append(path) or load_file(path))
    tagged_file._shared.clear()  # as in a new process
    running = Running(smollm2, max_batch=4, speculation=Speculation('hybrid'))
    try:
        client, answers = running.client(), []
        threads = [threading.Thread(target=lambda i=i: answers.append(client.completions.create(
            model=running.name, prompt=f"Count from {i}:", max_tokens=4, temperature=0))) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(answers) == 20 and all(a.usage.completion_tokens == 4 for a in answers)
        assert len(reads) == 1, reads
    finally:
        running.close()


@real
def test_api_key_is_required_when_set(smollm2):
    running = Running(smollm2, api_key="sesame", speculation=Speculation('ar'))
    try:
        with pytest.raises(openai.AuthenticationError):
            running.client("wrong").models.list()
        assert [m.id for m in running.client("sesame").models.list().data] == [running.name]
        assert httpx.get(running.url + "/health").status_code == 200
    finally:
        running.close()


# -- accountability, on a tiny model whose steps are slowed to last long enough --------------------

STEP_S = 0.02  # each scheduler step at least this long: 200 tokens take >= 4 s


@pytest.fixture(scope="module")
def tiny_server():
    running = Running(tiny_served(), max_batch=2, speculation=Speculation('ar'), max_request_seconds=1.5)
    slow_steps(running.scheduler, STEP_S)
    yield running
    running.close()


def test_a_non_streaming_client_that_leaves_frees_its_row(tiny_server, caplog):
    caplog.set_level(logging.INFO, logger="selfspec.access")
    scheduler, cancelled = tiny_server.scheduler, tiny_server.scheduler.totals.cancelled
    body = {"model": tiny_server.name, "prompt": "w5 w6 w7", "max_tokens": 200, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=0.5)
    wait_until(lambda: scheduler.totals.cancelled > cancelled and not scheduler.active, 1.0,
               "the row of a client that left was not freed")
    wait_until(lambda: "finish=cancelled" in caplog.text, 2, "no access-log line for the cancelled request")
    assert "/v1/completions prompt=3 completion=" in caplog.text


def test_a_request_past_the_time_limit_ends_with_length_and_an_access_log_line(tiny_server, caplog):
    caplog.set_level(logging.INFO, logger="selfspec.access")
    timed_out = tiny_server.scheduler.totals.timed_out
    t0 = time.time()
    reply = tiny_server.client().chat.completions.create(
        model=tiny_server.name, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=200, temperature=0)
    assert reply.choices[0].finish_reason == "length" and 0 < reply.usage.completion_tokens < 200
    assert time.time() - t0 < 1.5 + 2  # the limit, and a step or two to end the row
    assert tiny_server.scheduler.totals.timed_out == timed_out + 1
    wait_until(lambda: reply.id in caplog.text, 2, "no access-log line")
    line = next(x for x in caplog.text.splitlines() if reply.id in x)
    assert (f"{reply.id} /v1/chat/completions prompt={reply.usage.prompt_tokens} "
            f"completion={reply.usage.completion_tokens} method=ar alpha=- seconds=") in line
    assert line.endswith("finish=length")


def test_metrics_show_the_oldest_active_row_and_time_outs(tiny_server):
    body = {"model": tiny_server.name, "prompt": "w5", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # one iterator: closing an iterator of the response closes the response
        next(line for line in lines if line.startswith("data: {"))
        time.sleep(0.5)
        age = _metric(httpx.get(tiny_server.url + "/metrics").text, "selfspec_oldest_active_seconds")
        assert 0.5 <= age < 1.5 + 2
        last = [line for line in lines if line.startswith("data: {")][-1]
    assert json.loads(last[6:])["choices"][0]["finish_reason"] == "length"  # the stream ended at the limit too
    text = httpx.get(tiny_server.url + "/metrics").text
    assert _metric(text, "selfspec_oldest_active_seconds") == 0 and _metric(text, "selfspec_requests_timed_out_total") >= 1


def test_malformed_json_names_no_parameter(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/completions", content=b'{"model": "tiny-llama", "prompt": "w5", oops}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None and "JSON" in r.json()["error"]["message"]


def test_sigterm_cancels_active_requests_and_the_server_exits(tmp_path):
    """`selfspec serve` decoding two long requests (one streamed) exits within --drain-seconds and a
    little more of SIGTERM, each request logged as cancelled."""
    checkpoint = save_tiny(tmp_path / "tiny")
    port = free_port()
    # Steps slowed as in the tests above: the requests would take >= 8 s.
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import serving\n"
            f"from selfspec.core.batch import Scheduler; step = Scheduler.step\n"
            f"Scheduler.step = lambda self: serving.time.sleep({STEP_S * 2}) or step(self)\n"
            f"from selfspec.cli import main; sys.exit(main(sys.argv[1:]))")
    server = subprocess.Popen(
        [sys.executable, "-c", code, "serve", "--model", str(checkpoint), "--port", str(port), "--method", "ar",
         "--drain-seconds", "1"], stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _up(url), 90, "the server did not start")
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": "w5 w6", "max_tokens": 200, "temperature": 0}
        outcomes = []

        def ask(stream):
            try:
                r = httpx.post(url + "/v1/completions", json={**body, "stream": stream}, timeout=30)
                outcomes.append(r.text)
            except httpx.HTTPError as error:
                outcomes.append(error)

        clients = [threading.Thread(target=ask, args=(stream,)) for stream in (False, True)]
        for c in clients:
            c.start()
        wait_until(lambda: "selfspec_active_rows 2.0" in httpx.get(url + "/metrics").text, 10, "rows not active")
        t0 = time.time()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=1 + 10)
        assert time.time() - t0 < 1 + 5
        assert server.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
        for c in clients:
            c.join(10)
        assert len(outcomes) == 2
        assert server.stderr.read().count("finish=cancelled") == 2
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_metrics_by_method_and_source_equal_the_responses_own_stats():
    """After requests with different methods, /metrics' drafting counters labelled by method and
    by source add up to what each response's usage said; replicas' figures add up too."""
    from prometheus_client.parser import text_string_to_metric_families

    from selfspec.serve import metrics

    running = Running(tiny_served(), max_batch=2, speculation=Speculation("ar"))
    try:
        prompt = "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"  # repeats: lookup and suffix find matches
        usages = []
        for method in ("ar", "lookup", "suffix", "suffix", "hybrid"):
            body = {"model": running.name, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                    "selfspec": {"method": method}}
            usages.append(httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()["usage"]["selfspec"])
        samples = {}
        for family in text_string_to_metric_families(httpx.get(running.url + "/metrics").text):
            for s in family.samples:
                samples[s.name, tuple(sorted(s.labels.items()))] = s.value
        expected = {}  # (method, source) -> counts
        for usage in usages:
            assert sum(c["rounds"] for c in usage["sources"].values()) == usage["rounds"]
            for source, counts in usage["sources"].items():
                mine = expected.setdefault((usage["method"], source), {"rounds": 0, "drafted": 0, "accepted": 0})
                for key in mine:
                    mine[key] += counts[key]
        assert {m for m, _ in expected} == {"ar", "lookup", "suffix", "hybrid"}
        assert ("suffix", "suffix") in expected and ("ar", "ar") in expected
        names = {"rounds": "verify_rounds_total", "drafted": "draft_tokens_total", "accepted": "accepted_tokens_total"}
        for key, name in names.items():
            assert samples["selfspec_" + name, ()] == sum(c[key] for c in expected.values())
            for (method, source), counts in expected.items():
                assert samples[f"selfspec_source_{name}", (("method", method), ("source", source))] == counts[key]
            for method in {m for m, _ in expected}:
                total = sum(c[key] for (m, _), c in expected.items() if m == method)
                assert samples["selfspec_" + name, (("method", method),)] == total
        drafted = sum(c["drafted"] for (m, s), c in expected.items() if m == "suffix")
        draft_rounds = sum(c["rounds"] for (m, s), c in expected.items() if m == "suffix" and s != "ar")
        assert samples["selfspec_mean_draft_length", (("method", "suffix"),)] == pytest.approx(drafted / draft_rounds)
        assert samples["selfspec_mean_draft_length", (("method", "ar"),)] == 0

        own = metrics.snapshot(running.app.state.server)  # two replicas with these figures: twice them in all
        text = metrics.render({"a": own, "b": own}).decode()
        assert f'selfspec_draft_tokens_total{{method="suffix"}} {2.0 * drafted}' in text
        assert f'selfspec_draft_tokens_total{{method="suffix",replica="a"}} {float(drafted)}' in text
    finally:
        running.close()
