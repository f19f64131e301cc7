"""`selfspec serve`: an OpenAI-compatible HTTP server, a thin layer over the batch scheduler.

Requests are validated and tokenized on the event loop, then submitted to one `Scheduler` whose
thread decodes every active request together (selfspec.batch). Its callbacks hand committed
tokens back to the loop, where they are detokenized, cut at stop strings and sent, as one JSON
response or as server-sent events. All tokenizer use stays on the loop's thread (HF fast
tokenizers are not safe to share between threads). A client that goes away cancels its request,
which frees its row at the next step; a full queue answers 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException

from selfspec.api import Detokenizer, SelfSpecModel
from selfspec.batch import QueueFull, Request, Scheduler
from selfspec.openai_schema import ChatRequest, CompletionRequest, Reply, error_body

DEFAULT_MAX_TOKENS = 256  # when a request gives none (OpenAI's own default is the context's room)
RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers


class Server:
    """The model, its scheduler and the thread that runs it; what the routes share."""

    def __init__(self, model: SelfSpecModel, *, max_batch: int = 8, max_queue: int = 32,
                 api_key: str | None = None, options: dict | None = None, served_name: str | None = None):
        self.model = model
        self.name = served_name or model.name
        self.scheduler = Scheduler(model.adapter, max_batch=max_batch, max_queue=max_queue)
        self.api_key = api_key or None
        self.options = {k: v for k, v in (options or {}).items() if v is not None}
        self.rejected = {"queue_full": 0, "invalid": 0}
        self.started = int(time.time())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.scheduler.run, args=(self._stop,), name="selfspec-scheduler",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.scheduler.close()

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
        spec = body.selfspec.model_dump(exclude_none=True) if body.selfspec else {}
        try:
            prepared = self.model.prepare(
                ids, fresh_drafter=True, max_new_tokens=limit, temperature=body.temperature, top_p=body.top_p,
                seed=body.seed, **{**self.options, **spec},
            )
        except ValueError as error:
            raise ApiError(400, str(error), param="max_tokens" if "max_new_tokens" in str(error) else None)
        job.max_tokens = limit
        request = prepared.request(job.on_tokens, job.on_done)
        job.request = request
        try:
            self.scheduler.submit(request)
        except QueueFull:
            self.rejected["queue_full"] += 1
            raise ApiError(503, "the server is at capacity: retry shortly", type_="server_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        return request


class Job:
    """One request's bridge from the scheduler's thread to the event loop."""

    _END = object()

    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer, stop: list[str]):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.text = Detokenizer(tokenizer, stop)
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

    def _put(self, item) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server is shutting down
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    # Event loop.
    async def deltas(self):
        """Text to send, as it becomes safe to show; ends at the end of the generation or at a stop
        string (which cancels the request's row)."""
        while True:
            item = await self.queue.get()
            if item is self._END:
                rest = self.text.finish() if self.error is None else ""
                if rest:
                    yield rest
                return
            delta = self.text.feed(item)
            if delta:
                yield delta
            if self.text.stopped:
                self.request.cancel()
                return

    @property
    def finish_reason(self) -> str:
        if self.text.stopped:
            return "stop"
        return "length" if len(self.text.tokens) >= self.max_tokens else "stop"


def create_app(model: SelfSpecModel, **server_options) -> FastAPI:
    """The FastAPI app serving `model`; options: see Server."""
    server = Server(model, **server_options)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.start()
        yield
        server.stop()

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

    @app.middleware("http")
    async def _auth(request: HttpRequest, call_next):
        if server.api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                return JSONResponse(error_body("missing or wrong API key: send 'Authorization: Bearer <key>'",
                                               code="invalid_api_key"), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.name, "active": len(server.scheduler.active),
                "queued": server.scheduler.queue_depth}

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

    registry = CollectorRegistry()
    registry.register(_Metrics(server))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _complete(server: Server, body, http: HttpRequest, chat: bool):
    server.check(body)
    ids = server.encode(body)
    job = Job(asyncio.get_running_loop(), server.model.tokenizer, body.stop)
    request = server.submit(body, ids, job)
    reply = Reply(chat, server.name)
    if body.stream:
        return StreamingResponse(_events(job, request, reply, body), media_type="text/event-stream")
    try:
        text = "".join([delta async for delta in _until_disconnect(job, http)])
    finally:
        request.cancel()  # a no-op once finished; frees the row if the client left
    if job.error is not None:
        raise ApiError(500, f"generation failed: {job.error}", type_="server_error")
    return reply.complete(text, job.finish_reason, request.stats)


async def _until_disconnect(job: Job, http: HttpRequest):
    """The job's deltas; stops early if the client disconnects while waiting."""
    deltas = job.deltas().__aiter__()
    while True:
        next_delta = asyncio.ensure_future(deltas.__anext__())
        while True:
            done, _ = await asyncio.wait({next_delta}, timeout=0.25)
            if done:
                break
            if await http.is_disconnected():
                next_delta.cancel()
                job.request.cancel()
                return
        try:
            yield next_delta.result()
        except StopAsyncIteration:
            return


async def _events(job: Job, request: Request, reply: Reply, body):
    """Server-sent events in OpenAI's chunk format, ending `data: [DONE]`. If the client
    disconnects, the response task is cancelled and `finally` frees the row."""
    try:
        if reply.chat:
            yield _sse(reply.chunk(None, first=True))
        async for delta in job.deltas():
            yield _sse(reply.chunk(delta))
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
    locs = [x for x in (errors[0].get("loc", ()) if errors else ()) if x != "body"]
    return ".".join(str(x) for x in locs) or None


class _Metrics:
    """Prometheus collector reading the scheduler's counters at scrape time."""

    def __init__(self, server: Server):
        self.server = server

    def collect(self):
        s, t = self.server.scheduler, self.server.scheduler.totals

        def counter(name, doc, value):
            return CounterMetricFamily(f"selfspec_{name}", doc, value=value)

        def gauge(name, doc, value):
            return GaugeMetricFamily(f"selfspec_{name}", doc, value=value)

        yield counter("requests", "Requests finished (including failed and cancelled)", t.requests)
        yield counter("requests_failed", "Requests that ended with an error", t.failed)
        yield counter("requests_cancelled", "Requests cancelled (client gone or stop string)", t.cancelled)
        rejected = CounterMetricFamily("selfspec_requests_rejected", "Requests refused before decoding",
                                       labels=["reason"])
        for reason, count in self.server.rejected.items():
            rejected.add_metric([reason], count)
        yield rejected
        yield counter("prompt_tokens", "Prompt tokens prefilled", t.prompt_tokens)
        yield counter("generated_tokens", "Tokens generated", t.new_tokens)
        yield counter("draft_tokens", "Draft tokens proposed", t.drafted)
        yield counter("accepted_tokens", "Draft tokens accepted", t.accepted)
        yield counter("verify_rounds", "Verify rounds over all requests", t.rounds)
        yield counter("draft_seconds", "Time spent drafting", t.draft_s)
        yield counter("verify_seconds", "Time spent in verify forwards (once per batched forward)", t.verify_s)
        yield counter("prefill_seconds", "Time spent prefilling prompts", t.prefill_s)
        yield gauge("acceptance_rate", "α over all finished requests: accepted / drafted",
                    t.accepted / t.drafted if t.drafted else 0.0)
        yield gauge("mean_accepted_length", "Tokens committed per verify round, bonus included",
                    (t.accepted + t.rounds) / t.rounds if t.rounds else 0.0)
        yield gauge("batch_rows_mean", "Mean rows per batched verify forward", t.rows / t.steps if t.steps else 0.0)
        yield gauge("queue_depth", "Requests waiting for a row", s.queue_depth)
        yield gauge("active_rows", "Requests being decoded", len(s.active))
