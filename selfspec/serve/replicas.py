"""`selfspec serve --replicas N`: copies of the server behind one OpenAI endpoint, on Ray Serve.

Self-speculation pays at low concurrency per model, so traffic grows by adding replicas rather
than rows. Each replica is one Ray Serve replica: it loads its own model and runs its own
scheduler and speculation, and its routes are the FastAPI app `create_app` builds (Ray Serve's
FastAPI ingress), so errors, the API key, limits and the access log are the lone server's. Ray
Serve's proxy routes each request to a replica, and can scale their number on ongoing requests.

/metrics on any replica shows every replica's figures and their total: each replica sends its
snapshot (selfspec.serve.metrics) to one small actor, the board, when a request ends and every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging.config
import os
import socket
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from selfspec.serve.server import access_log, create_app, log_config

APP = "selfspec"  # the Ray Serve application's name, and its deployment's
BOARD = "selfspec-metrics"  # the named actor replicas report to
NAMESPACE = "selfspec"
SHARE_EVERY_S = 1.0
# Ray Serve's default: a replica counts as busy from 2 ongoing requests on, where speculation
# still pays (a large batch neutralises it); autoscaling adds replicas rather than rows.
TARGET_ONGOING = 2
INSTALL = 'pip install "selfspec[ray]"'


def require():
    """Ray and Ray Serve, imported; without them, an error that says how to install them."""
    try:
        import ray
        from ray import serve
    except ImportError as error:
        raise ModuleNotFoundError(f"--replicas needs Ray Serve ({error.name} is missing): {INSTALL}") from None
    return ray, serve


@dataclass
class Scale:
    """How many replicas: a fixed number, or Ray Serve autoscaling between two bounds."""

    replicas: int = 1
    autoscale: tuple[int, int] | None = None

    @classmethod
    def parse(cls, replicas: int | None, autoscale: str | None) -> Scale:
        """From --replicas (the count, or the initial count when autoscaled) and --autoscale MIN:MAX."""
        if replicas is not None and replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if autoscale is None:
            return cls(replicas or 1)
        try:
            low, high = (int(x) for x in autoscale.split(":"))
        except ValueError:
            raise ValueError(f"--autoscale takes MIN:MAX, e.g. 1:4 (got {autoscale!r})") from None
        if not 0 <= low <= high or high < 1:
            raise ValueError("--autoscale MIN:MAX needs 0 <= MIN <= MAX and MAX >= 1")
        return cls(min(max(replicas or low, low, 1), high), (low, high))

    def options(self) -> dict:
        if self.autoscale is None:
            return {"num_replicas": self.replicas}
        low, high = self.autoscale
        return {"autoscaling_config": {"min_replicas": low, "max_replicas": high, "initial_replicas": self.replicas,
                                       "target_ongoing_requests": TARGET_ONGOING}}


class Board:
    """Each replica's latest metrics snapshot. A replica that stopped keeps its last one, so that
    the totals' counters never go down."""

    def __init__(self):
        self.snapshots: dict[str, dict] = {}

    def put(self, replica: str, snapshot: dict) -> None:
        self.snapshots[replica] = snapshot

    def all(self) -> dict[str, dict]:
        return self.snapshots

    def clear(self) -> None:
        self.snapshots = {}


class Peers:
    """A replica's side of the board (what selfspec.serve.server.Server calls `peers`)."""

    def __init__(self, board, replica: str):
        self.board, self.replica = board, replica

    def publish(self, snapshot: dict) -> None:
        self.board.put.remote(self.replica, snapshot)  # fire and forget: nothing waits on metrics

    async def gather(self, own: dict) -> dict[str, dict]:
        self.publish(own)  # calls from one caller run in order: `all` sees this snapshot
        return await self.board.all.remote()

    async def run(self, snapshot: Callable[[], dict]) -> None:
        """Publish every SHARE_EVERY_S until cancelled: rows start and queues move between requests' ends."""
        while True:
            self.publish(snapshot())
            await asyncio.sleep(SHARE_EVERY_S)


class Replica:
    """One copy of the server; `deploy` wraps it with Ray Serve's FastAPI ingress, whose app
    `__serve_build_asgi_app__` builds in the replica, around the replica's own model."""

    def __init__(self, load: Callable, server_options: dict, threads: int):
        import torch

        torch.set_num_threads(threads)  # replicas on one machine share its cores
        config = log_config()  # the access log only: uvicorn does not run in a replica
        config["loggers"] = {access_log.name: config["loggers"][access_log.name]}
        # The process's own stderr, which Ray forwards to the driver as it comes: Ray Serve's
        # stand-in for sys.stderr holds lines back.
        config["handlers"]["default"]["stream"] = "ext://sys.__stderr__"
        logging.config.dictConfig(config)
        self.model = load()
        self.server_options = server_options

    def __serve_build_asgi_app__(self):
        ray, serve = require()
        board = ray.get_actor(BOARD, namespace=NAMESPACE)
        peers = Peers(board, serve.get_replica_context().replica_tag)
        app = create_app(self.model, **self.server_options, peers=peers)
        self.server = app.state.server
        return app

    def check_health(self) -> None:
        """Ray Serve's periodic probe: a replica whose decoding loop died or stalled raises here,
        and Ray Serve replaces it."""
        server = getattr(self, "server", None)
        if server is not None:
            ok, body = server.health()
            if not ok:
                raise RuntimeError(body["error"])


class PortTaken(RuntimeError):
    """The serving port is another program's."""


@contextlib.contextmanager
def holding(host: str, port: int):
    """The serving port, bound (not listening) for the block's duration. A starting Ray instance
    picks its own ports (metrics, the dashboard agent) among the free ones, and could otherwise
    pick this one before Ray Serve's proxy binds it. Raises PortTaken if the port is in use now."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    held = socket.socket(family, kind, proto)
    try:
        try:
            held.bind(address)
        except OSError as error:
            raise PortTaken(f"port {port} on {host} is in use ({error.strerror}): choose another --port") from None
        yield
    finally:
        held.close()


def start_ray(address: str | None, cpus: int, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Join the cluster at `address`, or start a local Ray instance on loopback with `cpus` CPUs,
    keeping the serving `host`:`port` out of the ports it picks for itself (`holding`).
    Call it before anything in the process imports ray (`require` too): ray reads the settings
    below when first imported."""
    if not address or _loopback(address):
        # Ray's switch for one-machine instances (its default on macOS): every Ray process then
        # listens and connects on 127.0.0.1, where Ray would otherwise swap in the machine's
        # network address.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray folds alike log lines from several workers into one and holds them back meanwhile: the
    # access log needs every line, when it happens.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if address:
        ray, _ = require()
        ray.init(address=address, namespace=NAMESPACE)
        return
    with holding(host, port):  # refused here, before Ray loads, if the port is taken
        ray, _ = require()
        # "local": a new instance, even where `ray start` left an address for ray.init to join.
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, namespace=NAMESPACE)


def _loopback(address: str) -> bool:
    host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def deploy(load: Callable, server_options: dict, scale: Scale, *, host: str = "127.0.0.1", port: int = 8000,
           replica_cpus: float = 1, drain_s: float = 5) -> str:
    """Run the replicas on the Ray instance this process is connected to (start_ray) and return the
    endpoint's URL once every replica is up. `load()` returns the model (it runs in each replica).
    Ray Serve binds `host` and `port` at its first start on a Ray instance and keeps them."""
    ray, serve = require()
    # Detached, so that replicas keep a board if this process dies; emptied of a previous run's figures.
    board = ray.remote(num_cpus=0)(Board).options(name=BOARD, namespace=NAMESPACE, get_if_exists=True,
                                                  lifetime="detached").remote()
    ray.get(board.clear.remote())
    serve.start(http_options={"host": host, "port": port})
    deployment = serve.deployment(
        serve.ingress()(Replica), name=APP, ray_actor_options={"num_cpus": replica_cpus},
        # Past its rows and queue a replica answers 503 itself; Ray Serve routes up to that.
        max_ongoing_requests=server_options.get("max_batch", 8) + server_options.get("max_queue", 32),
        graceful_shutdown_timeout_s=drain_s, logging_config={"enable_access_log": False},  # ours replaces it
        **scale.options())
    threads = max(1, int(replica_cpus))
    serve.run(deployment.bind(load, server_options, threads), name=APP, route_prefix="/", blocking=False)
    url = f"http://{host}:{port}"
    if not answers_as_selfspec(url):
        raise PortTaken(f"{url} does not answer as selfspec: another program has port {port}; choose another --port")
    return url


def answers_as_selfspec(url: str) -> bool:
    """Whether `url`/health is a selfspec server's (its routes need no API key there)."""
    url = url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")  # a wildcard: ask loopback
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as reply:
            body = json.loads(reply.read())
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and body.get("status") == "ok" and "model" in body


def undeploy() -> None:
    """Stop the replicas (each drains as `deploy` set) and remove the application."""
    _, serve = require()
    serve.delete(APP)


def stop(joined: bool) -> None:
    """Remove the application and its board; a Ray instance this process started goes with them."""
    ray, serve = require()
    if joined:
        undeploy()
        ray.kill(ray.get_actor(BOARD, namespace=NAMESPACE))
    else:
        serve.shutdown()
    ray.shutdown()


def local_cpus(scale: Scale, replica_cpus: float) -> int:
    """CPUs for a local Ray instance: the machine's, or more when the replicas ask for more (they
    then share cores rather than wait for ones that do not exist)."""
    most = scale.autoscale[1] if scale.autoscale else scale.replicas
    return max(os.cpu_count() or 1, int(most * replica_cpus + 0.999))
