"""The FastAPI application: OpenAI's HTTP API translated into engine calls through a worker.

The worker (see :mod:`.worker`) runs the engine either on a thread of this
process (:class:`~.worker.EngineWorker`: ``build_app(engine)``) or in a
process of its own (:class:`~.engine_process.ProcessWorker`:
``build_app(EngineSpec(...))``, what ``kvgen serve`` does by default); the
routes are the same for both.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming
as server-sent events ending in ``data: [DONE]``, or one JSON body),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. ``/v1/*`` needs
``Authorization: Bearer KEY`` when an API key is set (compared in constant
time). Every error is OpenAI's JSON (:class:`ApiError`). A client that
disconnects -- mid-stream or while waiting for a whole body -- has its
requests aborted at once (their pages return to the pool before the next
step).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import ServeMetrics
from .prompts import Prompter
from .protocol import ApiError, ChatRequest, CompletionRequest, parse
from .responses import Choices, Formatter
from .sse import SSEResponse
from .stream import Stream
from .worker import EngineWorker

DEFAULT_MAX_PENDING = 1024


class ServeState:
    """What the routes share: the worker, the prompter, the metrics and the settings."""

    def __init__(self, engine: Any, model_name: str, api_key: str | None, max_pending: int,
                 chat_template: str | None, drain_timeout: float) -> None:
        from .engine_process import EngineSpec, ProcessWorker

        self.model_name = model_name
        self.api_key = api_key
        self.drain_timeout = drain_timeout
        self.metrics = ServeMetrics()
        kind = ProcessWorker if isinstance(engine, EngineSpec) else EngineWorker
        self.worker = kind(engine, max_pending=max_pending, metrics=self.metrics)
        info = self.worker.info
        self.prompter = Prompter(info.tokenizer, vocab_size=info.vocab_size, max_model_len=info.max_model_len,
                                 chat_template=chat_template)
        self.created = int(time.time())
        self.stopped_summary: dict[str, int] | None = None


def build_app(engine: Any, *, model_name: str, api_key: str | None = None,
              max_pending: int = DEFAULT_MAX_PENDING, chat_template: str | None = None,
              drain_timeout: float = 30.0) -> FastAPI:
    """An app serving ``engine`` as ``model_name``; the engine runs while the app lives.

    ``engine``: an LLMEngine (run on a thread of this process), or an
    :class:`~.engine_process.EngineSpec` (the engine is built and run in a
    process of its own, started here: this call returns once the engine is
    built, or raises its error). After shutdown
    ``app.state.serve.stopped_summary`` holds what was left in the engine:
    ``{"requests", "pages_used", "sequences"}`` (all 0 when nothing leaked;
    None when the engine process had died); the same is printed as one line
    on stderr.
    """
    state = ServeState(engine, model_name, api_key, max_pending, chat_template, drain_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.worker.start()
        try:
            yield
        finally:
            s = await state.worker.stop()
            if s is None:
                why = f"had failed ({state.worker.error!r})" if state.worker.error else "did not stop in time"
                print(f"kvgen serve: stopped; the engine {why}", file=sys.stderr, flush=True)
            else:
                state.stopped_summary = {k: s[k] for k in ("requests", "pages_used", "sequences")}
                print(f"kvgen serve: stopped; {s['requests']} requests left, {s['pages_used']} of {s['pages_total']} "
                      f"KV pages in use, {s['sequences']} sequences in the cache", file=sys.stderr, flush=True)

    app = FastAPI(title="kvgen serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    app.add_middleware(_CountResponses, metrics=state.metrics)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, str(exc.detail), type="not_found" if exc.status_code == 404 else
                       "invalid_request_error")
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), state.api_key.encode())
        if not ok:
            raise ApiError(401, "missing or wrong API key; send 'Authorization: Bearer KEY'",
                           type="authentication_error", headers={"WWW-Authenticate": "Bearer"})

    def check_model(name: str) -> None:
        if name != state.model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{state.model_name}`.",
                           type="not_found", param="model")

    @app.get("/health")
    async def health() -> Response:
        if not state.worker.alive:
            return JSONResponse({"status": "error", "error": repr(state.worker.error)}, status_code=503)
        if state.worker.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.worker.alive:  # the gauges as of now (the engine refreshes them only now and then)
            with contextlib.suppress(ApiError):
                await state.worker.refresh_metrics()
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "kvgen",
            "max_model_len": state.prompter.max_model_len}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        authorize(request)
        req = parse(CompletionRequest, await request.body())
        check_model(req.model)
        prompts = [state.prompter.encode(p) for p in req.prompts()]
        max_tokens = state.prompter.max_tokens(req.max_tokens, prompts, "max_tokens")
        fmt = Formatter(False, state.model_name, state.prompter, req.logprobs or 0)
        return await _run(request, req, prompts, req.sampling_kwargs(max_tokens, req.logprobs), fmt, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        authorize(request)
        req = parse(ChatRequest, await request.body())
        check_model(req.model)
        prompts = [state.prompter.chat([m.as_dict() for m in req.messages])]
        max_tokens = state.prompter.max_tokens(req.requested_max_tokens, prompts,
                                               "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
        fmt = Formatter(True, state.model_name, state.prompter, req.top_logprobs or 0)
        return await _run(request, req, prompts, req.sampling_kwargs(max_tokens, req.num_logprobs), fmt, arrival)

    async def _run(request: Request, req: Any, prompts: list[list[int]], kwargs: dict[str, Any], fmt: Formatter,
                   arrival: float) -> Response:
        from kvgen.engine.errors import EngineError
        from kvgen.engine.sampling_params import SamplingParams

        try:
            params = SamplingParams(**kwargs)
        except EngineError as e:
            raise ApiError(400, str(e)) from None
        stream = await state.worker.submit(prompts, params, arrival)
        try:
            choices = Choices(req.n, [len(p) for p in prompts], keep=not req.stream)
            if req.stream:
                return SSEResponse(stream, choices, fmt, req.include_usage, state.worker.close)  # it closes the stream
        except BaseException:  # no response will close it: abort its requests, free its max_pending slots
            state.worker.close(stream)
            raise
        return JSONResponse(await _collect(request, stream, choices, fmt))  # _collect closes it

    async def _collect(request: Request, stream: Stream, choices: Choices, fmt: Formatter) -> dict[str, Any]:
        async def consume() -> None:
            async for index, out in stream.outputs():
                choices.update(index, out, out.finished)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(consume())
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise ApiError(499, "the client closed the connection")
            work.result()
        finally:
            for t in (work, watch):
                t.cancel()
            state.worker.close(stream)
        return fmt.full(choices)

    return app


class _CountResponses:
    """ASGI middleware counting responses by status (pure ASGI: streaming and disconnects pass untouched)."""

    def __init__(self, app: Any, metrics: ServeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.response(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
