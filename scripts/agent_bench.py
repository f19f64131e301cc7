"""Agent and code-assistant traffic through `selfspec serve`: sessions that repeat system prompts and
tool schemas, rewrite files they were just shown, quote shared documents and retry requests
(selfspec/data/agent_sessions.jsonl), each multi-turn session re-sending its history.

For each method, a fresh server in this process on a loopback port (and a fresh suffix store), then
`--clients` concurrent clients, each running whole sessions one after another, greedy,
`--max-tokens` per turn. Methods run in the order given, the whole list `--rounds` times
(interleaved). Reports generated tokens/s, × the first method (plain decoding by default), α, mean
tokens per round, and whether every answer equals the first method's with the same prefill (greedy:
it must). METHOD+prefix runs with the server's prefix reuse (`selfspec serve --prefix-cache`).

    .venv/bin/python scripts/agent_bench.py --methods ar,lookup,hybrid,suffix --clients 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import threading
import time
from importlib import resources

import openai
import uvicorn

import selfspec
from selfspec.core.speculation import Speculation
from selfspec.serve.server import create_app


def setup_line(setup: dict) -> str:
    """The results file's first line (scripts/performance.py reads it): what ran, where, how."""
    env = "SELFSPEC_SUFFIX_PAYOFF=1 " if os.environ.get("SELFSPEC_SUFFIX_PAYOFF") == "1" else ""
    return (f"Setup: {setup['model']}, {setup['dtype']}, {'exact mode' if setup['exact'] else 'not exact'}; "
            f"{setup['sessions']} sessions ({setup['turns']} turns) of selfspec/data/agent_sessions.jsonl, "
            f"{setup['clients']} concurrent clients, max_tokens {setup['max_tokens']} per turn, greedy, one server per "
            f"method (fresh suffix store), {setup['rounds']} round{'s' if setup['rounds'] != 1 else ''}; "
            f"machine: {setup['cpu']}{', ' + str(setup['cores']) + ' cores' if setup.get('cores') else ''}"
            f"{', ' + str(setup['busy']) + ' other processes spinning' if setup.get('busy') else ''}; "
            f"command: {env}{setup['command']}")


def load_sessions(path: str | None = None) -> list[dict]:
    text = open(path).read() if path else resources.files("selfspec").joinpath("data/agent_sessions.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def run_sessions(url: str, name: str, sessions: list[dict], clients: int, max_tokens: int) -> tuple[dict, float]:
    """Every session's answers, keyed (session, turn), and the generated tokens."""
    answers, tokens, queue = {}, [0], list(enumerate(sessions))

    async def one_client():
        while queue:
            i, session = queue.pop(0)
            messages = [{"role": "system", "content": session["system"]}]
            for t, turn in enumerate(session["turns"]):
                messages.append({"role": "user", "content": turn})
                reply = await client.chat.completions.create(model=name, messages=messages, max_tokens=max_tokens,
                                                             temperature=0)
                text = reply.choices[0].message.content
                answers[i, t] = text
                tokens[0] += reply.usage.completion_tokens
                messages.append({"role": "assistant", "content": text})

    # closed inside the event loop (left to the garbage collector, it closed after the loop had)
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as client:
        await asyncio.gather(*(one_client() for _ in range(clients)))
    return answers, tokens[0]


def run_method(model, method: str, sessions: list[dict], args) -> tuple[dict, dict]:
    model.reset_suffix_stores()
    method, reuse = method.removesuffix("+prefix"), method.endswith("+prefix")
    app = create_app(model, max_batch=args.max_batch, max_queue=64, speculation=Speculation(method),
                     prefix_mb=args.prefix_mb if reuse else 0)  # explicit either way
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        t0 = time.perf_counter()
        answers, tokens = asyncio.run(run_sessions(f"http://127.0.0.1:{port}/v1", model.name, sessions, args.clients,
                                                   args.max_tokens))
        wall = time.perf_counter() - t0
        totals = app.state.server.scheduler.totals
        gamma = model.resolve(Speculation(method)).speculation.draft_len if method != "ar" else 0
        return {"tokens": tokens, "wall_s": wall, "drafted": totals.drafted, "accepted": totals.accepted,
                "rounds": totals.rounds, "gamma": gamma, "prompt_tokens": totals.prompt_tokens,
                "reused": totals.prefix_tokens, "steps": totals.steps, "rows": totals.rows,
                "drafts_dropped": totals.drafts_dropped, "drafts_cut": totals.drafts_cut,
                "drafting_skipped": totals.drafting_skipped, "draft_s": totals.draft_s, "verify_s": totals.verify_s,
                "prefill_s": totals.prefill_s}, answers
    finally:
        server.should_exit = True
        thread.join(30)


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="bundled name, checkpoint or .gguf (default: smollm2)")
    p.add_argument("--dtype", default="auto", help="as selfspec generate's --dtype (default auto: the model's default)")
    p.add_argument("--methods", default="ar,lookup,hybrid,suffix",
                   help="comma-separated; the first is the baseline; METHOD+prefix: with the server's prefix reuse "
                        "(a fresh store; without +prefix, none)")
    p.add_argument("--prefix-mb", type=float, default=256, help="the prefix store's MiB for +prefix methods (default 256)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens per turn (default 128)")
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default 8)")
    p.add_argument("--rounds", type=int, default=1, help="times the whole method list runs, interleaved (default 1)")
    p.add_argument("--sessions", default=None, help="a sessions JSONL file (default: the bundled agent_sessions)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="N other processes spinning on the CPU for the whole run (a machine not idle; default 0)")
    args = p.parse_args(argv)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        return _main(args, argv)
    finally:
        for spinner in spinners:
            spinner.kill()


def _main(args, argv) -> int:
    model = selfspec.load(args.model, dtype=args.dtype, progress=False)
    sessions = load_sessions(args.sessions)
    methods = args.methods.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    # Each method's answers against the first method's with the same prefill: with prefix reuse every
    # prefill runs through the fused layer (rounded as the decode steps are, not as a whole-prompt
    # GEMM), so greedy identity holds within each of the two.
    references, differing = {}, {m: 0 for m in methods}
    for _ in range(args.rounds):
        for method in methods:
            figures, answers = run_method(model, method, sessions, args)
            runs[method].append(figures)
            reference = references.setdefault(method.endswith("+prefix"), answers)
            differing[method] += sum(answers.get(key) != text for key, text in reference.items())
            print(f"{method}: {figures['tokens'] / figures['wall_s']:.1f} tok/s", file=sys.stderr, flush=True)
    rows = {}
    for method, rs in runs.items():
        tokens, wall = sum(r["tokens"] for r in rs), sum(r["wall_s"] for r in rs)
        drafted, accepted, rounds, prompt, reused = (sum(r[k] for r in rs) for k in
                                                     ("drafted", "accepted", "rounds", "prompt_tokens", "reused"))
        rows[method] = {"tok_s": round(tokens / wall, 2), "gamma": rs[0]["gamma"],
                        "draft_per_round": round(drafted / rounds, 2) if rounds else None,
                        "alpha": round(accepted / drafted, 3) if drafted else None,
                        "tokens_per_round": round((accepted + rounds) / rounds, 2) if rounds else None,
                        "prompt_reused": round(reused / prompt, 3) if prompt else None,
                        "differing_answers": differing[method],
                        # the scheduler's own counts, summed over rounds (Totals: rows per forward, drafts
                        # dropped / cut / not asked for, seconds drafting, verifying, prefilling)
                        "scheduler": {k: round(sum(r[k] for r in rs), 3) for k in
                                      ("steps", "rows", "drafts_dropped", "drafts_cut", "drafting_skipped", "draft_s",
                                       "verify_s", "prefill_s")},
                        "wall_s": round(wall, 2)}
    base = rows[methods[0]]["tok_s"]
    for row in rows.values():
        row["x_first"] = round(row["tok_s"] / base, 2)
    setup = {"model": model.name, "dtype": model.dtype_name, "exact": model.exact, "cpu": _cpu(),
             "sessions": len(sessions), "turns": sum(len(s["turns"]) for s in sessions), "clients": args.clients,
             "max_tokens": args.max_tokens, "rounds": args.rounds, "busy": args.busy, "cores": os.cpu_count(), "command": " ".join(["scripts/agent_bench.py", *(argv or sys.argv[1:])])}
    print(setup_line(setup) + "\n")
    firsts = {}
    for m in methods:
        firsts.setdefault(m.endswith("+prefix"), m)
    same = " / ".join(firsts.values())
    print("| method | tok/s | × " + methods[0] + " | γ max | drafted/round | α | tokens/round | prompt reused | "
          "answers ≠ " + same + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method, r in rows.items():
        print(f"| {method} | {r['tok_s']} | {r['x_first']} | {r['gamma']} | {r['draft_per_round']} | {r['alpha']} | "
              f"{r['tokens_per_round']} | {r['prompt_reused']} | {r['differing_answers']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "results": rows}, f, indent=2)
    return 1 if any(r["differing_answers"] for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
