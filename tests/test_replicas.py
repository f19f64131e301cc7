"""`selfspec serve --replicas 2`: two Ray Serve replicas of a tiny model behind one loopback endpoint,
started by the CLI as a user would, against the same model served by one process."""

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time

try:
    import httpx2 as httpx  # the HTTP library recent openai releases ship with
except ImportError:
    import httpx
import openai
import pytest

import selfspec
from selfspec import Speculation
from selfspec.cli import main
from serving import Running, free_port, save_tiny, wait_until

KEY = "sesame"
LIMIT_S = 2  # the replicas' --max-request-seconds
# A long context, so that one request can outlast a client (about 1 ms a token here, 4000 tokens).
LONG = 4000
PROMPTS = ["w5 w6 w7", "w9 w10", "w40 w41 w42 w43", "w77"]
NAME = "tiny"  # the served name: the checkpoint folder's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("replicas") / "tiny", positions=LONG + 96)


@pytest.fixture(scope="module")
def replicas(checkpoint, tmp_path_factory):
    """The CLI serving two replicas on a local Ray instance; SIGTERM at the end stops Ray too."""
    pytest.importorskip("ray.serve")
    port, log = free_port(), tmp_path_factory.mktemp("replicas-log") / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "selfspec.cli", "serve", "--model", str(checkpoint), "--port", str(port),
             "--replicas", "2", "--api-key", KEY, "--max-request-seconds", str(LIMIT_S), "--method", "early-exit",
             "--max-batch", "4"], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(url) or server.poll() is not None, 180, "the replicas did not start")
        assert server.poll() is None, log.read_text()[-3000:]
        yield url, log
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        finally:
            if server.poll() is None:
                server.kill()
    assert server.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def alone(checkpoint):
    running = Running(selfspec.load(str(checkpoint), progress=False), speculation=Speculation('early-exit'))
    yield running
    running.close()


def client(url, key=KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def ask(c, name, prompt, chat, stream):
    """One greedy request through the openai client; its text."""
    options = dict(model=name, max_tokens=12, temperature=0, stream=stream)
    if chat:
        out = c.chat.completions.create(messages=[{"role": "user", "content": prompt}], **options)
        return "".join(x.choices[0].delta.content or "" for x in out) if stream else out.choices[0].message.content
    out = c.completions.create(prompt=prompt, **options)
    return "".join(x.choices[0].text for x in out) if stream else out.choices[0].text


def test_concurrent_requests_equal_the_single_process_servers(replicas, alone):
    url, _ = replicas
    c = client(url)
    assert [m.id for m in c.models.list().data] == [NAME]
    cases = [(p, chat, stream) for p in PROMPTS for chat in (True, False) for stream in (True, False)]
    answers = {}

    def one(case):
        answers[case] = ask(c, NAME, *case)

    threads = [threading.Thread(target=one, args=(case,)) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    expected = {case: ask(alone.client(), alone.name, *case) for case in cases}
    assert answers == expected
    wait_until(lambda: _metric(url, "selfspec_requests_total") >= len(cases), 10, "the total missed requests")
    served = _per_replica(url, "selfspec_requests_total")
    assert len(served) == 2 and sum(served.values()) == _metric(url, "selfspec_requests_total")


def test_the_api_key_is_enforced_on_the_ray_route(replicas):
    url, _ = replicas
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").completions.create(model=NAME, prompt="w5", max_tokens=2)
    assert httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "w5"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # health checks need no key, as on one process


def test_clients_that_leave_free_their_rows(replicas):
    url, log = replicas
    before = _metric(url, "selfspec_requests_cancelled_total")
    body = {"model": NAME, "prompt": "w5 w6", "max_tokens": LONG, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, headers=_auth(), timeout=0.5)
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=_auth(), timeout=30) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
    # Both clients have gone, well before their requests' time limit.
    wait_until(lambda: _metric(url, "selfspec_requests_cancelled_total") >= before + 2
               and _metric(url, "selfspec_active_rows") == 0, 10, "the rows of clients that left were not freed")
    # Ray forwards the replicas' log lines to the CLI's output a moment later.
    wait_until(lambda: log.read_text().count("finish=cancelled") >= 2, 10, "no access-log line for them")


def test_an_over_long_request_ends_at_the_limit_with_length(replicas):
    url, _ = replicas
    timed_out, t0 = _metric(url, "selfspec_requests_timed_out_total"), time.time()
    reply = client(url).completions.create(model=NAME, prompt="w5 w6", max_tokens=LONG, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens < LONG
    assert time.time() - t0 < LIMIT_S + 5
    wait_until(lambda: _metric(url, "selfspec_requests_timed_out_total") == timed_out + 1, 5, "not counted")


def test_without_ray_the_cli_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # an import of ray now fails as if it were not installed
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_DEDUP_LOGS"):  # what start_ray sets, undone after
        monkeypatch.delenv(name, raising=False)
    assert main(["serve", "--replicas", "2"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and 'pip install "selfspec[ray]"' in errors[0]


def test_scale_and_address_flags():
    from selfspec.serve import replicas

    # A cluster on loopback is one machine: Ray then keeps to 127.0.0.1 (see start_ray).
    assert [replicas._loopback(a) for a in ("127.0.0.1:6379", "localhost:6379", "[::1]:6379", "10.0.0.5:6379",
                                            "head.example:6379")] == [True, True, True, False, False]
    assert replicas.Scale.parse(None, None).options() == {"num_replicas": 1}
    assert replicas.Scale.parse(3, None).options() == {"num_replicas": 3}
    auto = replicas.Scale.parse(None, "0:4").options()["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["initial_replicas"]) == (0, 4, 1)
    assert replicas.Scale.parse(9, "1:4").options()["autoscaling_config"]["initial_replicas"] == 4
    for bad in ((0, None), (None, "4:1"), (None, "1-4"), (None, "0:0")):
        with pytest.raises(ValueError):
            replicas.Scale.parse(*bad)


def test_a_taken_port_is_refused_before_ray_starts(monkeypatch, capsys):
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_DEDUP_LOGS"):  # what start_ray sets, undone after
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "ray", None)  # were Ray started (imported), this would fail otherwise
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert main(["serve", "--replicas", "2", "--port", str(port)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and f"port {port} on 127.0.0.1 is in use" in errors[0] and "--port" in errors[0]


def test_the_held_port_is_kept_from_other_binds_and_freed_after():
    """What keeps a starting Ray's own ports (picked among free ones) off the serving port."""
    from selfspec.serve import replicas

    port = free_port()
    for host in ("127.0.0.1", "0.0.0.0"):
        with replicas.holding(host, port):
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
        with socket.socket() as other:
            other.bind(("127.0.0.1", port))  # free again


def test_only_a_selfspec_server_counts_as_up(alone):
    """A foreign server on the port (Ray's metrics exporter once took it) is not the replicas."""
    from selfspec.serve import replicas

    assert replicas.answers_as_selfspec(alone.url)

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"# HELP ray_dashboard_api_requests_duration_seconds\n")

        def log_message(self, *_):
            pass

    foreign = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    try:
        assert not replicas.answers_as_selfspec(f"http://127.0.0.1:{foreign.server_port}")
    finally:
        foreign.shutdown()
    assert not replicas.answers_as_selfspec(f"http://127.0.0.1:{free_port()}")  # nothing there


def _up(url: str) -> bool:
    from selfspec.serve import replicas

    return replicas.answers_as_selfspec(url)


def _auth() -> dict:
    return {"authorization": f"Bearer {KEY}"}


def _scrape(url: str) -> list[str]:
    return httpx.get(url + "/metrics", headers=_auth()).text.splitlines()


def _metric(url: str, name: str) -> float:
    """The total over the replicas (the unlabelled sample)."""
    return float(next(line.split()[-1] for line in _scrape(url) if line.startswith(name + " ")))


def _per_replica(url: str, name: str) -> dict[str, float]:
    return {line.split('"')[1]: float(line.split()[-1]) for line in _scrape(url) if line.startswith(name + "{replica=")}
