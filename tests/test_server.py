"""The OpenAI-compatible server, exercised with the real `openai` client over loopback."""

import json
import socket
import threading
import time

try:
    import httpx2 as httpx  # the HTTP library recent openai releases ship with
except ImportError:
    import httpx
import openai
import pytest
import uvicorn

from selfspec.server import create_app

pytestmark = pytest.mark.real
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Say hello in Spanish."]


class Running:
    """A server on a free loopback port, in a thread, for the duration of a test module."""

    def __init__(self, model, **options):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = create_app(model, **options)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = self.app.state.server.name

    def client(self, key="unused"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served(smollm2):
    running = Running(smollm2, max_batch=4, max_queue=8, options={"method": "lookup", "draft_len": 3})
    yield running
    running.close()


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


def test_stop_strings_cut_the_text(served, smollm2):
    full = smollm2.generate(QUESTIONS[0], method="ar", max_new_tokens=12).text
    stop = full.split()[2]  # a word the answer is known to contain
    reply = served.client().chat.completions.create(
        model=served.name, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=12, temperature=0,
        stop=[stop])
    assert reply.choices[0].message.content == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


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
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/completions", json={"model": served.name, "prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(served.url + "/v1/completions", json={"model": served.name, "prompt": "x", "frobnicate": 1})
    assert r.status_code == 400 and "frobnicate" in r.json()["error"]["message"]
    ok = client.completions.create(model=served.name, prompt="Hello", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_models_health_and_metrics(served):
    assert [m.id for m in served.client().models.list().data] == [served.name]
    assert httpx.get(served.url + "/health").json()["status"] == "ok"
    text = httpx.get(served.url + "/metrics").text
    for name in ("selfspec_requests_total", "selfspec_generated_tokens_total", "selfspec_acceptance_rate",
                 "selfspec_mean_accepted_length", "selfspec_draft_seconds_total", "selfspec_verify_seconds_total",
                 "selfspec_queue_depth"):
        assert name in text


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


def test_queue_limit_returns_503_with_retry_after(smollm2):
    running = Running(smollm2, max_batch=1, max_queue=0, options={"method": "ar"})
    try:
        body = {"model": running.name, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=60) as r:
            next(line for line in r.iter_lines() if line.startswith("data: {"))  # it holds the only row
            second = httpx.post(running.url + "/v1/completions", json={**body, "stream": False})
            assert second.status_code == 503 and second.headers["retry-after"]
            assert second.json()["error"]["code"] == "queue_full"
    finally:
        running.close()


def test_api_key_is_required_when_set(smollm2):
    running = Running(smollm2, api_key="sesame", options={"method": "ar"})
    try:
        with pytest.raises(openai.AuthenticationError):
            running.client("wrong").models.list()
        assert [m.id for m in running.client("sesame").models.list().data] == [running.name]
        assert httpx.get(running.url + "/health").status_code == 200
    finally:
        running.close()
