"""`selfspec serve`: the OpenAI-compatible HTTP server (selfspec.serve), in one process or as Ray Serve replicas."""

from __future__ import annotations

import os
import sys

from selfspec.cli.options import (advanced_options, check_model_options, engine_options, first_line,
                                  load, model_group, print_error, speculation, speculation_options)


def add_parser(sub) -> None:
    sv = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server; concurrent requests are decoded together in one batch",
        usage="%(prog)s [-h] [-m MODEL] [--host HOST] [--port PORT] [--method METHOD] [options]",
        description="Serve the model over HTTP with the OpenAI API: POST /v1/chat/completions and /v1/completions "
                    "(stream: true for server-sent events), GET /v1/models, /health and /metrics (Prometheus). "
                    "Concurrent requests share each verify forward (continuous batching); every request's output "
                    "is what it would be alone. Requests may choose speculation under the extension key "
                    "'selfspec' (method, exit_layer, draft_len, threshold, ngram); the speculation flags below are "
                    "the server's defaults.")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000, metavar="PORT", help="TCP port (default 8000)")
    sv.add_argument("--api-key", default=os.environ.get("SELFSPEC_API_KEY"), metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on every route but /health and the page's files "
                         "(default: $SELFSPEC_API_KEY; unset: no key)")
    sv.add_argument("--no-ui", dest="ui", action="store_false",
                    help="do not serve the page at / (a chat and a completion box that show which tokens each "
                         "drafter proposed and the verify accepted; it asks for --api-key's key when one is set)")
    sv.add_argument("--name", default=None, help="model name clients must send (default: the model's name)")
    sv.add_argument("--max-batch", type=int, default=8, metavar="N", help="requests decoded together (default 8)")
    sv.add_argument("--max-queue", type=int, default=32, metavar="N",
                    help="requests waiting for a free row before the server answers 503 (default 32)")
    sv.add_argument("--max-request-seconds", type=float, default=600, metavar="S",
                    help="wall time from a request's arrival after which it ends with finish_reason 'length' "
                         "and frees its row (default 600; 0: no limit)")
    sv.add_argument("--stall-seconds", type=float, default=120, metavar="S",
                    help="GET /health answers 503 when requests are being decoded and no decoding step has ended "
                         "for this long (default 120); if the decoding loop dies the server exits with status 1")
    sv.add_argument("--drain-seconds", type=float, default=5, metavar="S",
                    help="on SIGTERM or Ctrl-C, seconds that active requests may run on before they are "
                         "cancelled and the server exits (default 5)")
    sv.add_argument("--suffix-scope", choices=("shared", "user"), default="shared",
                    help="whose text --method suffix drafts from: shared (default: every request's; outputs are "
                         "the same either way, but timing can hint that a text was seen before) or user (each request "
                         "'user' field drafts from its own text only, so one client's text never shapes another's drafts)")
    sv.add_argument("--suffix-tokens", type=int, default=1_000_000, metavar="N",
                    help="tokens of past prompts and answers the suffix store keeps over all users, the oldest dropped "
                         "first (default 1000000, tens of MB)")
    sv.add_argument("--prefix-cache", type=float, default=None, metavar="MB",
                    help="MiB of earlier requests' keys and values kept (reused as --suffix-scope says) so that a prompt "
                         "starting with text already read, as a chat's next turn or an agent's system prompt, "
                         "prefills only the rest; output is unchanged. Every prefill then runs through the fused "
                         "layer, slower for long first-seen prompts (default: 256 for --dtype int4, where it was "
                         "measured faster on multi-turn traffic, else 0: none)")
    model_group(sv)
    speculation_options(sv, "the server's defaults; a request may choose its own under 'selfspec'")
    engine_options(sv)
    advanced_options(sv)
    rs = sv.add_argument_group("replicas on Ray Serve", 'several copies of the server behind one endpoint; '
                               'needs pip install "selfspec[ray]"')
    rs.add_argument("--replicas", type=int, default=None, metavar="N",
                    help="run N replicas, each with its own model, scheduler and speculation, on a local Ray "
                         "instance (default: one process, no Ray)")
    rs.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                    help="let Ray Serve scale the replicas between MIN and MAX on ongoing requests (a replica "
                         "counts as busy from 2; --replicas is then the initial count)")
    rs.add_argument("--ray-address", default=None, metavar="ADDR",
                    help="join this Ray cluster (e.g. HEAD_IP:6379 from 'ray start --head') instead of "
                         "starting a local instance; replicas then run on any of its machines")
    rs.add_argument("--replica-cpus", type=float, default=1, metavar="C",
                    help="CPUs each replica reserves, and its torch threads (default 1)")


def run(args) -> int:
    import uvicorn

    from selfspec.serve.server import create_app, log_config

    spec = speculation(args)
    check_model_options(args, spec)
    if args.max_batch < 1 or args.max_queue < 0:
        raise ValueError("--max-batch must be >= 1 and --max-queue >= 0")
    if args.max_request_seconds < 0 or args.drain_seconds < 0:
        raise ValueError("--max-request-seconds and --drain-seconds must be >= 0")
    if args.stall_seconds <= 0:
        raise ValueError("--stall-seconds must be > 0")
    if args.suffix_tokens < 1:
        raise ValueError("--suffix-tokens must be >= 1")
    if args.prefix_cache is not None and args.prefix_cache < 0:
        raise ValueError("--prefix-cache must be >= 0 MB")
    server_options = dict(max_batch=args.max_batch, max_queue=args.max_queue, api_key=args.api_key, speculation=spec,
                          served_name=args.name, max_request_seconds=args.max_request_seconds or None,
                          stall_seconds=args.stall_seconds, ui=args.ui, suffix_scope=args.suffix_scope,
                          suffix_tokens=args.suffix_tokens, prefix_mb=args.prefix_cache)
    if args.replicas is not None or args.autoscale or args.ray_address:
        return run_replicas(args, server_options)
    model = load(args)
    method = args.method
    if method == "auto":
        method, k, g = model.tuned(args.profile, args.exit_layer, args.draft_len)
        method += "".join(f" {name}={v}" for name, v in (("k", k), ("γ", g)) if v is not None)
    app = create_app(model, **server_options)
    name = args.name or model.name
    print(f"selfspec: serving {name!r} on http://{args.host}:{args.port}/v1 (speculation: {method}; batch "
          f"{args.max_batch}, queue {args.max_queue}{'; API key required' if args.api_key else ''})", file=sys.stderr)
    if args.ui:
        print(f"selfspec: the page that shows the speculation: http://{args.host}:{args.port}/", file=sys.stderr)
    # uvicorn waits for open requests on SIGTERM; the timeout bounds that wait, then cancels them.
    http = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                         log_config=log_config(), timeout_graceful_shutdown=args.drain_seconds))
    state = app.state.server

    def fatal(error: BaseException) -> None:  # the scheduler's thread died: exit so a supervisor restarts us
        http.should_exit = True

    state.on_fatal = fatal
    http.run()
    if state.fatal is not None:
        print_error(f"decoding stopped ({type(state.fatal).__name__}: {state.fatal}); exiting")
        return 1
    return 0


def run_replicas(args, server_options: dict) -> int:
    """`serve` as Ray Serve replicas (selfspec.serve.replicas), in the foreground until SIGTERM or Ctrl-C."""
    import functools
    import signal
    import threading

    from selfspec.serve import replicas

    scale = replicas.Scale.parse(args.replicas, args.autoscale)
    try:
        replicas.start_ray(args.ray_address, replicas.local_cpus(scale, args.replica_cpus), args.host, args.port)
    except ModuleNotFoundError:
        raise  # Ray is not installed: main prints the install command
    except replicas.PortTaken as error:
        print_error(str(error))
        return 2
    except Exception as error:  # noqa: BLE001 - Ray's reasons are many; the user needs the one line
        print_error(f"Ray could not start{' at ' + args.ray_address if args.ray_address else ''}: "
                    f"{first_line(error)}")
        return 2
    stopping, serving = threading.Event(), threading.Event()

    def stop_request(*_):
        stopping.set()
        if not serving.is_set():
            raise KeyboardInterrupt  # still starting: unwind out of the deploy, then stop what started

    for sig in (signal.SIGINT, signal.SIGTERM):  # from here on, a stop request stops Ray and the replicas too
        signal.signal(sig, stop_request)
    try:
        try:
            url = replicas.deploy(functools.partial(load, args), server_options, scale, host=args.host,
                                  port=args.port, replica_cpus=args.replica_cpus, drain_s=args.drain_seconds)
            serving.set()
        except KeyboardInterrupt:
            print("selfspec: stopped while the replicas were starting", file=sys.stderr)
            return 0
        except Exception as error:  # noqa: BLE001 - e.g. a replica could not load the model: Ray logged why
            print_error(f"the replicas did not start: {first_line(error)}")
            return 2
        count = f"{scale.autoscale[0]}-{scale.autoscale[1]} (autoscaled)" if scale.autoscale else scale.replicas
        print(f"selfspec: serving {args.name or args.model or 'the default model'} on {url}/v1 with {count} Ray Serve "
              f"replicas (speculation: {args.method}; batch {args.max_batch}, queue {args.max_queue} each"
              f"{'; API key required' if args.api_key else ''}); /metrics shows each replica and the total",
              file=sys.stderr)
        while not stopping.wait(1):
            pass
    finally:
        replicas.stop(joined=bool(args.ray_address))
    return 0
