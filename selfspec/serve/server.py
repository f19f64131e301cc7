"""`selfspec serve`: an OpenAI-compatible HTTP server, a thin layer over the batch scheduler.

Requests are validated and tokenized on the event loop, then submitted to one `Scheduler` whose
thread decodes every active request together (selfspec.core.batch). Its callbacks hand committed
tokens back to the loop, where they are detokenized, cut at stop strings and sent, as one JSON
response or as server-sent events. All tokenizer use stays on the loop's thread (HF fast
tokenizers are not safe to share between threads). A client that goes away cancels its request,
which frees its row at the next step, and so does the server's wall-time limit per request; a full
queue answers 503 with Retry-After. Every request that got a row leaves one line in the access log
(logger `selfspec.access`) when its row is freed. GET / is a page over this same API that shows
where each token came from (static/; the stream's trace: selfspec.serve.trace).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import secrets
import threading
import time
from pathlib import Path

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from selfspec.serve import metrics
from selfspec.api import Detokenizer, SelfSpecModel
from selfspec.core.batch import QueueFull, Request, Scheduler
from selfspec.core.speculation import Speculation
from selfspec.model.prefix_cache import PrefixStore
from selfspec.serve.openai_schema import ChatRequest, CompletionRequest, Reply, error_body
from selfspec.serve.trace import Trace

DEFAULT_MAX_TOKENS = 256  # when a request gives none (OpenAI's own default is the context's room)
DEFAULT_MAX_REQUEST_S = 600.0  # generous: SmolLM2's 2048-token context on 2 busy cores takes minutes
DEFAULT_STALL_S = 120.0  # /health fails when rows are active and no step has ended for this long
DEFAULT_PREFIX_MB = 256.0  # each prefix store's budget: thousands of tokens of a small model's cache entries
# Where prefixes are kept unless asked: 4-bit models, whose fused prefill costs about what a GEMM's
# does (Qwen2.5-Coder 0.5B's agent sessions: plain decoding 1.19x, suffix 1.35x with reuse; 1.17x and
# 1.30x with another process spinning);
# in bfloat16 the fused prefill of a first-seen prompt costs 1.6-1.9x a GEMM's and reuse did not pay
# (SmolLM2: 1.01x and 0.96x), 2-core AMD EPYC, results/agent_bench/prefix_*.
PREFIX_BY_DEFAULT = ("int4",)
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.25
STATIC = Path(__file__).parent / "static"  # the page at / (index.html, app.js, style.css)
access_log = logging.getLogger("selfspec.access")
log = logging.getLogger("selfspec.serve.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers


class Server:
    """The model, its scheduler and the thread that runs it; what the routes share."""

    def __init__(self, model: SelfSpecModel, *, max_batch: int = 8, max_queue: int = 32,
                 api_key: str | None = None, speculation: Speculation | None = None, served_name: str | None = None,
                 max_request_seconds: float | None = DEFAULT_MAX_REQUEST_S, peers=None,
                 stall_seconds: float = DEFAULT_STALL_S, on_fatal=None, suffix_scope: str = "shared",
                 suffix_tokens: int | None = None, prefix_mb: float | None = None):
        """speculation: the default for requests that choose none, or only some of its options under
        `selfspec` (None: method "auto"). max_request_seconds: wall time from arrival after which a request ends with finish_reason
        "length" (None: no limit). peers: where replicas pool their /metrics (selfspec.serve.replicas.Peers);
        None for a lone server. stall_seconds: /health answers 503 when rows are active and no
        scheduler step has ended for this long. on_fatal(error): called once if the scheduler's
        thread dies (`selfspec serve` then exits non-zero, for its supervisor to restart it).
        suffix_scope: whose text `suffix` drafts from: "shared" (every request's: output is the same
        either way, verification is exact, but timing can hint that a text was seen before) or
        "user" (one store per request `user` field, OpenAI's end-user id; none given: one store for
        all such requests). suffix_tokens: the suffix store's budget over all tenants (None: the model's default).
        prefix_mb: MiB of earlier requests' cache entries kept in all (reused as the suffix stores
        are scoped) for prompts that start with the same tokens (SelfSpecModel.keep_prefixes); 0 keeps
        none; None: DEFAULT_PREFIX_MB for the dtypes in PREFIX_BY_DEFAULT, else 0. Where reuse would
        not be exact (no fused layer), none are kept and the log says why."""
        if suffix_scope not in ("shared", "user"):
            raise ValueError(f"suffix_scope must be 'shared' or 'user', got {suffix_scope!r}")
        self.suffix_scope = suffix_scope
        if suffix_tokens is not None:
            model.suffix_tokens = suffix_tokens
        if prefix_mb is None:
            prefix_mb = DEFAULT_PREFIX_MB if model.dtype_name in PREFIX_BY_DEFAULT else 0
        if prefix_mb < 0:
            raise ValueError(f"prefix_mb must be >= 0, got {prefix_mb}")
        reason = PrefixStore.available(model.adapter) if prefix_mb else None
        if reason is not None:
            log.warning("selfspec: prompts are prefilled whole, no prefix reuse: %s", reason)
        self.prefix_bytes = int(prefix_mb * 2**20) if reason is None else 0  # kept from `start` to `stop`
        self._prefix_before = 0  # the model's own budget, given back at `stop`
        self.model = model
        self.name = served_name or model.name
        self.scheduler = Scheduler(model.adapter, max_batch=max_batch, max_queue=max_queue)
        self.api_key = api_key or None
        self.speculation = speculation or Speculation()
        self.rejected = {"queue_full": 0, "invalid": 0}
        self.max_request_seconds = max_request_seconds
        self.peers = peers
        self.started = int(time.time())
        self.stall_seconds = stall_seconds
        self.on_fatal = on_fatal
        self.fatal: BaseException | None = None  # what ended the scheduler's thread, if it died
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._prefix_before = self.model.prefix_bytes
        self.model.keep_prefixes(self.prefix_bytes)
        self._thread = threading.Thread(target=self._decode, name="selfspec-scheduler", daemon=True)
        self._thread.start()

    def _decode(self) -> None:
        """The scheduler's thread. Its loop survives any one request's or step's failure; if the
        loop itself ends with an error, every request still held is failed and `on_fatal` runs."""
        try:
            self.scheduler.run(self._stop)
        except BaseException as error:  # noqa: BLE001 - nothing decodes any more: say so and stop
            self.fatal = error
            log.critical("the scheduler's loop died; nothing is decoded any more", exc_info=error)
            with contextlib.suppress(Exception):
                self.scheduler.close()
            if self.on_fatal is not None:
                self.on_fatal(error)

    def health(self) -> tuple[bool, dict]:
        """Liveness of decoding, not only of HTTP: the scheduler's thread runs, and while rows are
        active its steps keep ending."""
        s = self.scheduler
        since = time.monotonic() - s.last_beat
        body = {"model": self.name, "active": len(s.active), "queued": s.queue_depth,
                "seconds_since_step": round(since, 3)}
        if self._thread is None or not self._thread.is_alive() or self.fatal is not None:
            why = f": {type(self.fatal).__name__}: {self.fatal}" if self.fatal is not None else ""
            return False, {"status": "dead", "error": f"the scheduler's thread is not running{why}", **body}
        if (s.active or s.queue_depth) and since > self.stall_seconds:
            return False, {"status": "stalled", "error": f"no scheduler step has ended for {since:.0f} s "
                                                         f"(limit {self.stall_seconds:g} s)", **body}
        return True, {"status": "ok", **body}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.scheduler.close()
        self.model.keep_prefixes(self._prefix_before)  # the model as it was lent to the server

    # -- one request ----------------------------------------------------------------------------

    def check(self, body) -> None:
        if body.model != self.name:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves {self.name!r} "
                                f"(GET /v1/models)", param="model", code="model_not_found")
        problem = body.unsupported()
        if problem:
            raise ApiError(400, problem)

    def encode(self, body) -> list[int]:
        model = self.model
        try:
            if isinstance(body, ChatRequest):
                if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
                    raise ApiError(400, f"{self.name} has no chat template: use /v1/completions", param="messages")
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if not isinstance(ids, list) else ids
                return list(ids)
            return model.encode(body.prompt_value(), chat=False).tolist()
        except ApiError:
            raise
        except ValueError as error:
            raise ApiError(400, str(error), param="messages" if isinstance(body, ChatRequest) else "prompt")

    def submit(self, body, ids: list[int], job: Job) -> Request:
        context = self.model.adapter.max_positions
        if len(ids) >= context:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; {self.name}'s context is {context}: shorten it",
                           param="messages" if isinstance(body, ChatRequest) else "prompt",
                           code="context_length_exceeded")
        limit = body.limit or min(DEFAULT_MAX_TOKENS, context - len(ids))
        try:
            prepared = self.model.prepare(
                ids, speculation=self.speculation.override(body.selfspec), fresh_drafter=True,
                tenant=("user", body.user) if self.suffix_scope == "user" else None,
                max_new_tokens=limit, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
            )
        except ValueError as error:
            raise ApiError(400, str(error), param="max_tokens" if "max_new_tokens" in str(error) else None)
        job.max_tokens = limit
        request = prepared.request(job.on_tokens, job.on_done)
        request.time_limit_s = self.max_request_seconds
        job.request = request
        try:
            self.scheduler.submit(request)
        except QueueFull:
            self.rejected["queue_full"] += 1
            raise ApiError(503, "the server is at capacity: retry shortly", type_="server_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        except RuntimeError:  # closed: shutting down, or its loop died
            raise ApiError(503, "the server is not decoding (shutting down or failed): retry on another "
                                "instance", type_="server_error", code="not_serving")
        return request

    def finished(self, job: Job) -> None:
        """A request's row was freed (event loop): log it and share the new figures."""
        stats = job.request.stats
        alpha = "-" if stats.alpha is None else f"{stats.alpha:.3f}"
        access_log.info("%s %s prompt=%d completion=%d method=%s alpha=%s seconds=%.2f finish=%s", job.id,
                        job.route, stats.prompt_tokens, stats.new_tokens, stats.method, alpha,
                        time.perf_counter() - job.request.submitted_s, job.outcome)
        if job.outcome == "error":
            log.error("%s failed", job.id, exc_info=job.error)
        if self.peers is not None:
            self.peers.publish(metrics.snapshot(self))


class Job:
    """One request's bridge from the scheduler's thread to the event loop."""

    _END = object()

    def __init__(self, server: Server, route: str, reply: Reply, stop: list[str], trace: bool = False):
        self.server, self.route, self.id = server, route, reply.id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.text = Detokenizer(server.model.tokenizer, stop)
        self.trace = Trace(server.model.tokenizer) if trace and server.model.tokenizer is not None else None
        self.error: BaseException | None = None
        self.max_tokens = 0
        self.request: Request | None = None

    # Scheduler thread: hand over, nothing else.
    def on_tokens(self, tokens: list[int]) -> bool:
        self._put(tokens)
        return True

    def on_done(self, error: BaseException | None) -> None:
        self.error = error
        self._put(self._END)
        # Logged from here, not where the response ends: a client that left has no response.
        self._call(self.server.finished, self)

    def _put(self, item) -> None:
        self._call(self.queue.put_nowait, item)

    def _call(self, fn, *args) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server is shutting down
            self.loop.call_soon_threadsafe(fn, *args)

    # Event loop.
    async def deltas(self):
        """Text to send, as it becomes safe to show; ends at the end of the generation or at a stop
        string (which cancels the request's row)."""
        async for delta, _ in self.rounds():
            if delta:
                yield delta

    async def rounds(self):
        """(text now safe to show, possibly "", the round it came with) per verify round, then
        (the text held back to the end, None); ends as `deltas` does."""
        while True:
            item = await self.queue.get()
            if item is self._END:
                rest = self.text.finish() if self.error is None else ""
                if rest:
                    yield rest, None
                return
            yield self.text.feed(item), item
            if self.text.stopped:
                self.request.cancel()
                return

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "length" at max_tokens or the server's time limit, else "stop" (EOS or a stop string)."""
        if self.text.stopped:
            return "stop"
        if self.request.timed_out:
            return "length"
        return "length" if self.request.stats.new_tokens >= self.max_tokens else "stop"

    @property
    def outcome(self) -> str:
        """How the request ended, for the access log: the finish reason, "cancelled" (client gone or
        server shutting down) or "error"."""
        if self.request.cancelled.is_set() and not self.text.stopped:
            return "cancelled"
        return "error" if self.error is not None else self.finish_reason


def create_app(model: SelfSpecModel, ui: bool = True, **server_options) -> FastAPI:
    """The FastAPI app serving `model`; ui: the page at / (static/, over the API); options: see Server."""
    server = Server(model, **server_options)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.start()
        sharing = asyncio.create_task(server.peers.run(lambda: metrics.snapshot(server))) if server.peers else None
        yield
        if sharing is not None:
            sharing.cancel()
        server.stop()
        if server.peers is not None:
            server.peers.publish(metrics.snapshot(server))  # its last figures stay in the totals

    app = FastAPI(title="selfspec", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def _api_error(request, error: ApiError):
        if error.status < 500:
            server.rejected["invalid"] += 1
        return JSONResponse(error.body, status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, error: RequestValidationError):
        server.rejected["invalid"] += 1
        return JSONResponse(error_body(_describe(error.errors()), param=_param(error.errors())), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request, error: HTTPException):
        return JSONResponse(error_body(str(error.detail), "invalid_request_error" if error.status_code < 500
                                       else "server_error"), status_code=error.status_code, headers=error.headers)

    if server.api_key:
        app.add_middleware(_ApiKey, key=server.api_key)

    if ui:  # static files only: the page asks for the API key itself, and the API checks it
        app.mount("/ui", StaticFiles(directory=STATIC), name="ui")

        @app.get("/", include_in_schema=False)
        async def page():
            return FileResponse(STATIC / "index.html")

    @app.get("/health")
    async def health():
        ok, body = server.health()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.started,
                                            "owned_by": "selfspec"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HttpRequest):
        return await _complete(server, body, http, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        return await _complete(server, body, http, chat=False)

    @app.get("/metrics")
    async def prometheus():
        own = metrics.snapshot(server)
        snapshots = {None: own} if server.peers is None else await server.peers.gather(own)
        return Response(metrics.render(snapshots), media_type=CONTENT_TYPE_LATEST)

    return app


class _ApiKey:
    """Refuses every route but /health and the page's static files without 'Authorization: Bearer
    KEY'. Plain ASGI rather than @app.middleware("http"), whose wrapping of `receive` hides a
    client's disconnect from the route."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in ("/health", "/") and not scope["path"].startswith("/ui/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                refusal = JSONResponse(error_body("missing or wrong API key: send 'Authorization: Bearer <key>'",
                                                  code="invalid_api_key"), status_code=401)
                return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)


def log_config() -> dict:
    """uvicorn's logging configuration with the access log added: its lines on stderr as uvicorn's."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"][access_log.name] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


async def _complete(server: Server, body, http: HttpRequest, chat: bool):
    server.check(body)
    ids = server.encode(body)
    reply = Reply(chat, server.name)
    # The trace is a streaming option, as include_usage is (selfspec.serve.trace).
    trace = body.stream and bool((body.stream_options or {}).get("selfspec_trace"))
    job = Job(server, http.url.path, reply, body.stop, trace=trace)
    request = server.submit(body, ids, job)
    if body.stream:
        return StreamingResponse(_events(job, request, reply, body), media_type="text/event-stream")
    watch = asyncio.create_task(_cancel_when_gone(http, request))
    try:
        text = "".join([delta async for delta in job.deltas()])
    finally:
        watch.cancel()
        request.cancel()  # a no-op once finished; frees the row if this task was cancelled
    if job.error is not None:
        raise ApiError(500, f"generation failed: {job.error}", type_="server_error")
    return reply.complete(text, job.finish_reason, request.stats)


async def _cancel_when_gone(http: HttpRequest, request: Request) -> None:
    """Cancels a non-streamed request whose client disconnects (its row is freed at the next step,
    which ends the response). Polled on its own, not between tokens: tokens may never pause."""
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    request.cancel()


async def _events(job: Job, request: Request, reply: Reply, body):
    """Server-sent events in OpenAI's chunk format, ending `data: [DONE]`. If the client
    disconnects, the response task is cancelled and `finally` frees the row."""
    try:
        if reply.chat:
            yield _sse(reply.chunk(None, first=True))
        if job.trace is None:
            async for delta in job.deltas():
                yield _sse(reply.chunk(delta))
        else:  # a chunk per round, text or not, each with the trace (selfspec.serve.trace)
            async for delta, round_ in job.rounds():
                described = None if round_ is None else job.trace.add(round_)  # before cutting its text
                chunk = reply.chunk(delta or None)
                chunk["selfspec"] = {"tokens": job.trace.cut(delta)}
                if described is not None:
                    chunk["selfspec"]["round"] = described
                yield _sse(chunk)
        if job.error is not None:
            yield _sse(error_body(f"generation failed: {job.error}", "server_error"))
        else:
            yield _sse(reply.chunk(None, job.finish_reason))
            if body.include_usage_in_stream:
                yield _sse(reply.usage_chunk(request.stats))
        yield "data: [DONE]\n\n"
    finally:
        request.cancel()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _describe(errors) -> str:
    """Pydantic's errors as one sentence that names each field and what to change."""
    parts = []
    for e in errors[:5]:
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})")
        elif e.get("type") == "extra_forbidden":
            parts.append(f"unrecognized request argument: {where}")
        elif e.get("type") == "missing":
            parts.append(f"missing required field: {where}")
        else:
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "; ".join(parts)


def _param(errors) -> str | None:
    if errors and errors[0].get("type") == "json_invalid":
        return None  # its location is a character offset in the body, not a parameter
    locs = [x for x in (errors[0].get("loc", ()) if errors else ()) if x != "body"]
    return ".".join(str(x) for x in locs) or None
