"""Fault injection: many concurrent clients doing everything wrong at once against one server on a
tiny model, then checks that nothing was lost and the server still serves.

The mix (seeded): valid requests (chat and completion, streamed and not, greedy and sampled),
invalid bodies, over-long prompts, clients that hang up at random points (queued, mid-prefill,
mid-stream), requests whose wall-time limit expires while they wait, and requests whose drafter
is made to fail (the only 5xx allowed besides 503 "queue_full"). Runs with a fixed seed and with
random ones (printed on failure)."""

import logging
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

try:
    import httpx2 as httpx  # the HTTP library recent openai releases ship with
except ImportError:
    import httpx
import pytest

from selfspec import Speculation

from serving import Running, free_port, save_tiny, slow_steps, tiny_served, wait_until
from tiny_models import COMMON

CLIENTS = 12  # concurrent clients: beyond max_batch + max_queue, so the queue fills
REQUESTS = 48
MAX_BATCH, MAX_QUEUE = 3, 6
LIMIT_S = 2.0  # the server's --max-request-seconds: some queued requests run out of it
STEP_S = 0.01
SEEDS = [int(x) for x in os.environ.get("STORM_SEEDS", "6").split(",")]  # 6 killed the scheduler before the fix; two random seeds join it
FAIL = "w13 w13 w13"  # a prompt starting with this gets a drafter that raises (the injected fault)


@pytest.fixture(scope="module")
def model():
    return tiny_served()


def _server(model):
    running = Running(model, max_batch=MAX_BATCH, max_queue=MAX_QUEUE, max_request_seconds=LIMIT_S,
                      speculation=Speculation('lookup', draft_len=3, ngram=1))
    slow_steps(running.scheduler, STEP_S)
    server = running.app.state.server
    submit, submitted = server.scheduler.submit, []

    def injecting_submit(request):
        if request.prompt_ids[:3].tolist() == [13, 13, 13]:
            def fail(*_):
                raise RuntimeError("injected drafter failure")
            request.drafter.propose = fail
        submit(request)
        submitted.append(request)

    server.scheduler.submit = injecting_submit
    running.submitted = submitted
    return running


def _soak():
    """scripts/soak.py as a module: the request mix and its checks (a script, not part of the package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


soak = _soak()


@pytest.mark.parametrize("seed", SEEDS + [random.randrange(10**6) for _ in range(2)])
def test_the_server_survives_a_storm_of_faults(model, seed, caplog):
    caplog.set_level(logging.INFO, logger="selfspec.access")
    running = _server(model)
    try:
        words = [f"w{i}" for i in range(4, 90)]
        plans = soak.plan_requests(random.Random(seed), running.name, REQUESTS, COMMON["max_position_embeddings"],
                                   words, {**soak.KINDS, "leave": 8, "fail": 1}, fail_prefix=FAIL)
        outcomes = soak.storm(running.url, plans, CLIENTS, timeout=30)
        assert not soak.problems(plans, outcomes), f"seed {seed}: {soak.problems(plans, outcomes)[:3]}"

        scheduler = running.scheduler
        wait_until(lambda: not scheduler.active and not scheduler.waiting, 10, f"seed {seed}: rows or queue left")
        wait_until(lambda: caplog.text.count(" finish=") >= len(running.submitted), 5,
                   f"seed {seed}: an access-log line is missing")
        for plan, outcome in zip(plans, outcomes):
            where = f"seed {seed}, request {plan['i']} ({plan['kind']}): {outcome}"
            if outcome["status"] == 503:
                continue  # queue_full, checked by soak.problems
            if plan["kind"] == "fail":  # 500, or its time ran out while it waited, before its drafter ran
                assert outcome["status"] == 500 or soak.answer(plan, outcome) in (("", "error"), ("", "length")), where
            elif plan["kind"] == "valid" and plan["greedy"]:
                text, finish = soak.answer(plan, outcome)
                alone = model.generate(plan["text"], method="ar", max_new_tokens=plan["body"]["max_tokens"],
                                       chat=plan["chat"]).text
                # A request that ran out of wall time ends early with "length": a prefix of its answer.
                assert text == alone or (finish == "length" and alone.startswith(text)), where
        assert scheduler.totals.requests == len(running.submitted), f"seed {seed}"
        lines = [x for x in caplog.text.splitlines() if " finish=" in x]
        assert len(lines) == len(running.submitted), f"seed {seed}: one access-log line per request"
        assert len({x.split()[-8] for x in lines}) == len(lines), f"seed {seed}: a request logged twice"
        assert httpx.get(running.url + "/health").json()["status"] == "ok"
        r = httpx.post(running.url + "/v1/completions", json={"model": running.name, "prompt": "w5 w6",
                                                             "max_tokens": 5, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        running.close()


def test_a_failing_step_fails_its_rows_and_the_loop_goes_on(model):
    running = Running(model, max_batch=2, speculation=Speculation('ar'))
    try:
        scheduler = running.scheduler
        step, broken = scheduler.step, threading.Event()

        def failing_step():
            if scheduler.active and not broken.is_set():
                broken.set()
                raise RuntimeError("injected step failure")
            return step()

        scheduler.step = failing_step
        body = {"model": running.name, "prompt": "w5 w6", "max_tokens": 20, "temperature": 0}
        first = httpx.post(running.url + "/v1/completions", json=body, timeout=30)
        assert first.status_code == 500 and "injected step failure" in first.json()["error"]["message"]
        second = httpx.post(running.url + "/v1/completions", json=body, timeout=30)
        assert second.status_code == 200
        assert second.json()["choices"][0]["text"] == model.generate("w5 w6", method="ar", max_new_tokens=20,
                                                                     chat=False).text
        assert httpx.get(running.url + "/health").status_code == 200
    finally:
        running.close()


def test_health_fails_when_the_loop_dies_or_stalls(model):
    running = Running(model, max_batch=2, speculation=Speculation('ar'), stall_seconds=0.5)
    try:
        server, scheduler = running.app.state.server, running.scheduler
        assert httpx.get(running.url + "/health").json()["status"] == "ok"
        # Stalled: a row is active and no step ends (the step blocks).
        release, step = threading.Event(), scheduler.step
        scheduler.step = lambda: release.wait(30) and False or step()
        body = {"model": running.name, "prompt": "w5 w6", "max_tokens": 3, "temperature": 0}
        reply = []
        t = threading.Thread(target=lambda: reply.append(httpx.post(running.url + "/v1/completions", json=body,
                                                                    timeout=30)))
        t.start()
        wait_until(lambda: httpx.get(running.url + "/health").status_code == 503, 5, "a stall was not reported")
        assert httpx.get(running.url + "/health").json()["status"] == "stalled"
        release.set()
        t.join(30)
        assert reply[0].status_code == 200
        wait_until(lambda: httpx.get(running.url + "/health").status_code == 200, 5, "health did not recover")

        # Dead: the loop itself ends with an error; requests still held end, new ones are refused.
        class Fatal(BaseException):
            pass

        def die():
            raise Fatal("injected: the loop itself failed")

        scheduler.step = die
        wait_until(lambda: server.fatal is not None, 5, "the loop did not die")
        health = httpx.get(running.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "dead" and "injected" in health.json()["error"]
        r = httpx.post(running.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_serving"
    finally:
        running.close()


def test_selfspec_serve_exits_non_zero_when_its_loop_dies(tmp_path):
    """A supervisor (systemd, Kubernetes) restarts a server whose process ends: so it must end."""
    checkpoint = save_tiny(tmp_path / "tiny")
    code = (f"import sys\n"
            f"from selfspec.core.batch import Scheduler\n"
            f"def run(self, stop):\n    stop.wait(2); raise RuntimeError('injected: the loop died')\n"
            f"Scheduler.run = run\n"
            f"from selfspec.cli import main; sys.exit(main(sys.argv[1:]))")
    server = subprocess.run(
        [sys.executable, "-c", code, "serve", "--model", str(checkpoint), "--port", str(free_port()), "--method", "ar"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert server.returncode == 1, server.stderr[-2000:]
    assert "decoding stopped (RuntimeError: injected: the loop died)" in server.stderr


def test_a_ray_replica_whose_loop_died_fails_its_health_check(model):
    from selfspec.serve.replicas import Replica
    from selfspec.serve.server import Server

    replica = Replica.__new__(Replica)  # its model and app as __serve_build_asgi_app__ leaves them
    replica.server = Server(model, speculation=Speculation('ar'))
    replica.server.start()
    replica.check_health()
    replica.server.scheduler.step = lambda: (_ for _ in ()).throw(SystemExit("injected"))
    wait_until(lambda: replica.server.fatal is not None, 5, "the loop did not die")
    with pytest.raises(RuntimeError, match="not running"):
        replica.check_health()
