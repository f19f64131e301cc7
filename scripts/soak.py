"""Soak test for `selfspec serve`: many concurrent clients sending a seeded mix of valid requests
(chat and completion, streamed and not, greedy and sampled), invalid bodies, over-long prompts and
clients that hang up at random points; then it checks that nothing was lost.

Starts the server in this process on a free loopback port (nothing leaves the machine). Prints the
count of each outcome by kind of request, the process's resident memory before and after, and
fails (exit 1) if any request is unaccounted for: a 5xx other than 503 "queue_full", a valid request
refused, an invalid one accepted, a row or queue entry left, or an access-log line missing.
tests/test_server_faults.py drives the same mix on a tiny model, with injected failures.

    .venv/bin/python scripts/soak.py --requests 500 --clients 12
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import random
import sys
import threading
import time

try:
    import httpx2 as httpx  # the HTTP library recent openai releases ship with
except ImportError:
    import httpx

KINDS = {"valid": 10, "invalid": 3, "long": 1, "leave": 4}  # relative weights of each kind of request


def plan_requests(rng: random.Random, name: str, n: int, context: int, words: list[str],
                  kinds: dict[str, int] = KINDS, fail_prefix: str | None = None) -> list[dict]:
    """n requests: each a kind, an HTTP body (or raw bytes for malformed JSON) and when to hang up.
    Kind "fail" (only with fail_prefix) starts its prompt with fail_prefix, for a test to inject a
    failure into."""
    def text(count):
        return " ".join(rng.choice(words) for _ in range(count))

    plans = []
    for i in range(n):
        kind = rng.choices(list(kinds), list(kinds.values()))[0]
        chat, stream, greedy = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.7
        prompt = text(rng.randrange(1, 12))
        if kind == "fail":
            prompt = fail_prefix + " " + prompt
        elif kind == "long":
            prompt = text(context + 20)
        body = {"model": name, "max_tokens": rng.randrange(4, 60), "stream": stream,
                "temperature": 0 if greedy else 0.9, **({} if greedy else {"seed": rng.randrange(1000)})}
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        raw = None
        if kind == "invalid":
            raw, body = rng.choice([
                (b'{"model": "%s", "prompt": "hi", oops}' % name.encode(), body),
                (None, {**body, "model": "gpt-4"}),
                (None, {**body, "temperature": -1}),
                (None, {**body, "max_tokens": "many"}),
                (None, {**body, "frobnicate": 1}),
                (None, {k: v for k, v in body.items() if k not in ("messages", "prompt")}),
            ])
        plans.append({"i": i, "kind": kind, "chat": chat, "greedy": greedy, "text": prompt, "body": body, "raw": raw,
                      "leave_after": rng.uniform(0.02, 1.0), "chunks": rng.randrange(0, 4),
                      "delay": rng.uniform(0, 1.5)})
    return plans


def send(url: str, plan: dict, timeout: float = 120) -> dict:
    """One planned request: {"status": code, "json" or "events"}, or {"status": "left"} when the
    client hung up as planned."""
    path = "/v1/chat/completions" if plan["chat"] else "/v1/completions"
    time.sleep(plan["delay"])
    if plan["raw"] is not None:
        r = httpx.post(url + path, content=plan["raw"], headers={"content-type": "application/json"}, timeout=timeout)
        return {"status": r.status_code, "json": r.json()}
    leave = plan["kind"] == "leave"
    try:
        if not plan["body"].get("stream"):
            r = httpx.post(url + path, json=plan["body"], timeout=plan["leave_after"] if leave else timeout)
            return {"status": r.status_code, "json": r.json()}
        with httpx.stream("POST", url + path, json=plan["body"], timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                return {"status": r.status_code, "json": r.json()}
            events = []
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    break
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if leave and len(events) > plan["chunks"]:
                        return {"status": "left"}  # hang up mid-stream: the response is closed here
            return {"status": 200, "events": events}
    except httpx.TimeoutException:
        if leave:
            return {"status": "left"}
        raise


def answer(plan: dict, outcome: dict) -> tuple[str, str | None]:
    """The answer's text and finish reason ("error" for an error inside a stream)."""
    if "events" in outcome:
        if any("error" in e for e in outcome["events"]):
            return "", "error"
        choices = [e["choices"][0] for e in outcome["events"] if e.get("choices")]
        part = (lambda c: c.get("delta", {}).get("content") or "") if plan["chat"] else (lambda c: c.get("text") or "")
        return "".join(part(c) for c in choices), next((c["finish_reason"] for c in choices if c["finish_reason"]), None)
    choice = outcome["json"]["choices"][0]
    return (choice["message"]["content"] if plan["chat"] else choice["text"]), choice["finish_reason"]


def storm(url: str, plans: list[dict], clients: int, progress=None, timeout: float = 120) -> list[dict]:
    """Send every plan from `clients` concurrent threads; each outcome in plan order."""
    outcomes: list[dict | None] = [None] * len(plans)
    pending, lock = list(plans), threading.Lock()

    def client():
        while True:
            with lock:
                if not pending:
                    return
                plan = pending.pop(0)
            try:
                outcomes[plan["i"]] = send(url, plan, timeout)
            except Exception as error:  # noqa: BLE001 - counted: a request that got no answer
                outcomes[plan["i"]] = {"status": f"no answer: {type(error).__name__}"}
            if progress is not None:
                progress()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def problems(plans: list[dict], outcomes: list[dict]) -> list[str]:
    """Outcomes that break the server's contract (see the module's docstring)."""
    found = []
    for plan, outcome in zip(plans, outcomes):
        status, where = outcome["status"], f"request {plan['i']} ({plan['kind']}): {str(outcome)[:300]}"
        if status == "left":
            continue
        if not isinstance(status, int):
            found.append(where)
        elif status == 503 and outcome["json"]["error"].get("code") == "queue_full":
            continue
        elif plan["kind"] in ("invalid", "long"):
            if not (400 <= status < 500 and "message" in outcome["json"].get("error", {})):
                found.append(where)
        elif plan["kind"] in ("valid", "leave") and (status != 200 or answer(plan, outcome)[1] == "error"):
            found.append(where)
    return found


def _rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="bundled name, checkpoint or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--requests", type=int, default=500, help="requests in all (default 500)")
    p.add_argument("--clients", type=int, default=12, help="concurrent clients (default 12)")
    p.add_argument("--max-batch", type=int, default=4, help="the server's --max-batch (default 4)")
    p.add_argument("--max-queue", type=int, default=6, help="the server's --max-queue (default 6)")
    p.add_argument("--max-request-seconds", type=float, default=30, help="the server's limit (default 30)")
    p.add_argument("--method", default="auto", help="the server's speculation (default auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)

    import uvicorn

    import selfspec
    from selfspec import Speculation
    from selfspec.serve.server import create_app

    model = selfspec.load(args.model, progress=False)
    access = collections.Counter()

    class Count(logging.Handler):
        def emit(self, record):
            access[record.getMessage().rsplit("finish=", 1)[-1]] += 1

    logging.getLogger("selfspec.access").addHandler(Count())
    logging.getLogger("selfspec.access").setLevel(logging.INFO)
    app = create_app(model, max_batch=args.max_batch, max_queue=args.max_queue, speculation=Speculation(args.method),
                     max_request_seconds=args.max_request_seconds)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    words = model.tokenizer.decode(list(range(1000, 3000))).split()
    plans = plan_requests(random.Random(args.seed), model.name, args.requests, model.adapter.max_positions, words)
    rss_before, t0, done = _rss_mb(), time.time(), [0]

    def progress():
        done[0] += 1
        if done[0] % 50 == 0:
            print(f"{done[0]}/{len(plans)} requests, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    outcomes = storm(url, plans, args.clients, progress)
    wall = time.time() - t0
    scheduler = app.state.server.scheduler
    deadline = time.time() + 30
    while (scheduler.active or scheduler.waiting) and time.time() < deadline:
        time.sleep(0.1)
    health = httpx.get(url + "/health").json()["status"]
    rss_after = _rss_mb()
    server.should_exit = True
    thread.join(30)

    counts = collections.Counter(f"{p['kind']} -> {o['status']}" for p, o in zip(plans, outcomes))
    found = problems(plans, outcomes)
    left = len(scheduler.active) + len(scheduler.waiting)
    logged = sum(access.values())
    figures = {"requests": len(plans), "clients": args.clients, "wall_s": round(wall, 1), "outcomes": dict(sorted(counts.items())),
               "access_log": dict(sorted(access.items())), "admitted": scheduler.totals.requests,
               "rows_or_queue_left": left, "health_after": health, "rss_mb_before": round(rss_before),
               "rss_mb_after": round(rss_after), "problems": found[:10], "command": " ".join(sys.argv)}
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    ok = not found and not left and logged == scheduler.totals.requests and health == "ok"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
