"""Load benchmark for `selfspec serve`: N concurrent streaming clients, speculation on and off.

Starts the server in this process on a free loopback port (nothing leaves the machine), then for
each mode runs `--clients` concurrent clients, each sending `--requests` streamed chat requests
one after another with the real `openai` client, greedy, `--max-tokens` each. Reports requests/s,
generated tokens/s, time to first token and p50/p99 request latency, and fails loudly on any
failed request. Bounded: clients × requests per mode, and `--timeout` seconds per request.

With `--replicas 1 2`, speculation on only: the single process first, then the same load through
Ray Serve replicas (selfspec.serve.replicas, a local Ray instance on loopback) for each count given;
every greedy answer must equal the single process's, and a differing one counts as failed.

    .venv/bin/python scripts/load_bench.py --clients 4 --requests 3 --max-tokens 64
    .venv/bin/python scripts/load_bench.py --clients 4 --requests 3 --max-tokens 64 --replicas 1 2
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
import urllib.request

import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

import selfspec
from selfspec import Speculation
from selfspec.tools.bench import load_prompts
from selfspec.serve.server import create_app


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="bundled name or local checkpoint (default: smollm2)")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients (default 4)")
    p.add_argument("--requests", type=int, default=3, help="requests per client, sequential (default 3)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default 8)")
    p.add_argument("--on", default="auto", help="method with speculation on (default auto: the tuned profile)")
    p.add_argument("--timeout", type=float, default=300, help="seconds before a request counts as failed")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--replicas", type=int, nargs="+", default=None, metavar="N",
                   help="speculation on only: the single process, then N Ray Serve replicas for each N given "
                        "(e.g. 1 2); needs pip install \"selfspec[ray]\"")
    p.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs (and torch threads) per replica (default: the machine's cores / N)")
    args = p.parse_args()

    model = selfspec.load(args.model)
    prompts = [x.text for x in load_prompts(None, per_category=10)]
    results = {}
    if args.replicas:
        results = run_replicas(model, prompts, args)
    for label, method in (("off (ar)", "ar"), (f"on ({args.on})", args.on)) if not args.replicas else ():
        results[label], _ = run_mode(model, method, prompts, args)
        print(f"{label}: {json.dumps(results[label])}", file=sys.stderr, flush=True)
    setup = (f"{model.name}, {platform.machine()} {_cpu()}, torch {__import__('torch').__version__}, "
             f"{args.clients} clients × {args.requests} streamed chat requests, max_tokens {args.max_tokens}, "
             f"greedy, server --max-batch {args.max_batch}, loopback")
    print(f"Setup: {setup}\n")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "results": results, "command": " ".join(sys.argv)}, f, indent=2)
    return 1 if any(r["failed"] for r in results.values()) else 0


def _server_options(model, method: str, args) -> dict:
    return dict(max_batch=args.max_batch, max_queue=args.clients * args.requests, speculation=Speculation(method),
                served_name=model.name)


def run_mode(model, method: str, prompts: list[str], args) -> tuple[dict, dict]:
    """The load on one server in this process: its figures, and each request's answer."""
    port = _free_port()
    app = create_app(model, **_server_options(model, method, args))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        out, answers = asyncio.run(_clients(f"http://127.0.0.1:{port}/v1", model.name, prompts, args))
        totals = app.state.server.scheduler.totals
        out["alpha"] = round(totals.accepted / totals.drafted, 3) if totals.drafted else None
        out["rows_per_verify"] = round(totals.rows / totals.steps, 2) if totals.steps else None
        return out, answers
    finally:
        server.should_exit = True
        thread.join(30)


def run_replicas(model, prompts: list[str], args) -> dict:
    """Speculation on: one process, then the same load on N replicas for each N; answers that differ
    from the single process's count as failed."""
    from selfspec.serve import replicas

    label = f"1 process, on ({args.on})"
    results = {}
    results[label], reference = run_mode(model, args.on, prompts, args)
    print(f"{label}: {json.dumps(results[label])}", file=sys.stderr, flush=True)
    cores = os.cpu_count() or 1
    cpus = {n: args.replica_cpus or max(1, cores // n) for n in args.replicas}
    replicas.start_ray(None, max(replicas.local_cpus(replicas.Scale(n), cpus[n]) for n in args.replicas))
    port = _free_port()  # Ray Serve keeps the port of its first start
    try:
        for n in args.replicas:
            label = f"{n} replica{'s' * (n > 1)} ({cpus[n]:g} CPU each), on ({args.on})"
            url = replicas.deploy(functools.partial(selfspec.load, args.model), _server_options(model, args.on, args),
                                  replicas.Scale(n), port=port, replica_cpus=cpus[n])
            try:
                out, answers = asyncio.run(_clients(url + "/v1", model.name, prompts, args))
                out.update(_replica_figures(url))
            finally:
                replicas.undeploy()
            out["differing"] = sum(answers.get(key) != text for key, text in reference.items())
            out["failed"] += out["differing"]
            results[label] = out
            print(f"{label}: {json.dumps(out)}", file=sys.stderr, flush=True)
    finally:
        replicas.stop(joined=False)
    return results


def _replica_figures(url: str) -> dict:
    """α and rows per verify over all replicas, and each replica's requests, from /metrics."""
    samples = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[sample.labels.get("replica")] = sample.value
    total = {name: values.get(None, 0.0) for name, values in samples.items()}
    drafted, rounds = total["selfspec_draft_tokens_total"], total["selfspec_verify_rounds_total"]
    return {
        "alpha": round(total["selfspec_accepted_tokens_total"] / drafted, 3) if drafted else None,
        "rows_per_verify": round(total["selfspec_batch_rows_mean"], 2) if rounds else None,
        "requests_per_replica": sorted(int(v) for r, v in samples["selfspec_requests_total"].items() if r),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _clients(url: str, name: str, prompts: list[str], args) -> tuple[dict, dict]:
    """The figures of the load, and each request's answer by (client, request)."""
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=args.timeout)
    records, failures, answers = [], [], {}

    async def one_client(c: int):
        for r in range(args.requests):
            prompt = prompts[(c * args.requests + r) % len(prompts)]
            t0 = time.perf_counter()
            first, tokens, text = None, 0, ""
            try:
                stream = await client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True})
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter() - t0
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                    if chunk.usage:
                        tokens = chunk.usage.completion_tokens
                answers[c, r] = text
                records.append({"ttft": first, "latency": time.perf_counter() - t0, "tokens": tokens})
            except Exception as error:  # noqa: BLE001 - counted and reported
                failures.append(repr(error))

    t0 = time.perf_counter()
    await asyncio.gather(*(one_client(c) for c in range(args.clients)))
    wall = time.perf_counter() - t0
    latencies = sorted(r["latency"] for r in records)
    ttfts = sorted(r["ttft"] for r in records if r["ttft"] is not None)
    return {
        "requests": len(records), "failed": len(failures), "errors": failures[:3], "wall_s": round(wall, 2),
        "requests_per_s": round(len(records) / wall, 3), "tokens_per_s": round(sum(r["tokens"] for r in records) / wall, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "latency_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "latency_p99_s": round(_quantile(latencies, 0.99), 3) if latencies else None,
    }, answers


def _quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile (with few requests, p99 is the slowest one)."""
    return sorted_values[min(len(sorted_values) - 1, max(0, int(round(q * len(sorted_values) + 0.5)) - 1))]


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {__import__('os').cpu_count()} cores"
    except OSError:
        pass
    return platform.processor()


def table(results: dict) -> str:
    cols = ["requests", "failed", "requests_per_s", "tokens_per_s", "ttft_p50_s", "latency_p50_s", "latency_p99_s",
            "alpha", "rows_per_verify"]
    heads = ["speculation", "requests", "failed", "req/s", "tok/s", "TTFT p50 s", "latency p50 s", "latency p99 s",
             "α", "rows/verify"]
    if any("requests_per_replica" in r for r in results.values()):
        cols, heads = cols + ["differing", "requests_per_replica"], heads + ["≠ 1 process", "requests per replica"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for label, r in results.items():
        lines.append("| " + " | ".join([label] + ["–" if r.get(c) is None else str(r[c]) for c in cols]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
