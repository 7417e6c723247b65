"""The HTTP layer: an OpenAI-compatible FastAPI app over a backend, and :func:`serve`, which runs it with uvicorn.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` sends
server-sent events, ending with ``data: [DONE]``), ``GET /health`` and ``GET /metrics`` (Prometheus). With an API
key, the ``/v1`` endpoints want ``Authorization: Bearer <key>`` (else 401); ``/health`` and ``/metrics`` stay open
to the supervisor and the scraper. A request's prompt plus ``max_tokens`` must fit the context (else 400, with the
numbers), so no request holds a row past it; a full wait queue answers 429 with ``Retry-After``; a request past
its deadline ends with 504. A client that goes away cancels its request. ``/health`` answers 503 once the
generation thread has died, and :func:`serve` then stops and raises, so the process exits non-zero for its
supervisor to restart it. On SIGTERM or SIGINT uvicorn stops accepting connections and lets in-flight requests
finish for ``shutdown_timeout`` seconds, then cancels them; the backend's thread stops last. Nothing of a
request's text is logged (uvicorn's access log holds the method, path and status).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvq_export.errors import KVQError
from kvq_export.serve.backends import (
    Backend,
    GenerationError,
    Job,
    QueueFull,
    ServeLimits,
    StreamEnd,
    TokenStream,
)
from kvq_export.serve.factory import open_backend
from kvq_export.serve.metrics import CONTENT_TYPE
from kvq_export.serve.protocol import (
    GenerationRequest,
    Reply,
    RequestError,
    bounded_max_tokens,
    error_body,
    parse_chat,
    parse_completion,
)
from kvq_export.serve.text import TextTracker

logger = logging.getLogger(__name__)

#: Seconds between checks that a non-streaming client is still connected.
DISCONNECT_POLL = 0.25
#: The environment variable ``kvq serve`` reads its API key from when ``--api-key`` is not given.
API_KEY_ENV = "KVQ_API_KEY"


def prompt_tokens(backend: Backend, request: GenerationRequest) -> list[int]:
    """Token ids of a request's prompt: text as ``kvq generate`` encodes it, ids checked, chat through the template."""
    codec = backend.codec
    if request.chat:
        if not codec.chat_template:
            raise RequestError("this export's tokenizer has no chat template; use /v1/completions", param="messages")
        try:
            text = codec.chat_prompt(request.prompt)
        except Exception as err:  # noqa: BLE001 - the template (jinja) rejects a conversation with its own errors
            raise RequestError(f"the chat template refused these messages: {err}", param="messages") from None
        ids = codec.encode(text, add_special_tokens=False)  # the template wrote the special tokens
    elif isinstance(request.prompt, str):
        ids = codec.encode(request.prompt)
    else:
        ids = list(request.prompt)
        bad = [t for t in ids if not 0 <= t < backend.vocab_size]
        if bad:
            raise RequestError(f"prompt token {bad[0]} is outside the vocabulary; allowed: 0 .. "
                               f"{backend.vocab_size - 1}", param="prompt")
    if not ids:
        raise RequestError("the prompt encodes to no token", param="messages" if request.chat else "prompt")
    return ids


def create_app(backend: Backend, *, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``backend`` as model ``model_name``; the app's shutdown closes the backend.

    ``api_key``: the bearer token the ``/v1`` endpoints want (None: open).
    """
    from starlette.exceptions import HTTPException

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(backend.close)

    app = FastAPI(title="kvq", lifespan=lifespan)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_check(api_key))])

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(err.detail), kind=kind), status_code=err.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = backend.alive
        body = {"status": "ok" if alive else "failed", "model": model_name, "active_requests": backend.active,
                "waiting_requests": backend.waiting, **backend.describe()}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(backend.metrics.exposition(), media_type=CONTENT_TYPE)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": int(os.path.getmtime(backend.directory)),
                "owned_by": "kvq", "kvq": backend.describe()}
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completions(request: Request):
        return await _generate(backend, request, parse_completion(await _body(request), served=model_name))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(backend, request, parse_chat(await _body(request), served=model_name))

    app.include_router(v1)
    return app


def bearer_check(api_key: str | None):
    """The ``/v1`` endpoints' dependency: 401 unless ``Authorization: Bearer <api_key>`` (None: open).

    A dependency, not a middleware: Starlette's middleware hides a client's disconnect from the endpoint.
    """
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def authorize(request: Request) -> None:
        if expected is not None and not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                                            expected):
            raise RequestError("missing or wrong API key: send Authorization: Bearer <key>", status=401,
                               code="invalid_api_key", kind="authentication_error",
                               headers={"WWW-Authenticate": "Bearer"})

    return authorize


def _refusal(err: GenerationError) -> JSONResponse:
    """The JSON error of a request that could not run (queue full: 429 with ``Retry-After``)."""
    if isinstance(err, QueueFull):
        return JSONResponse(error_body(str(err), kind="rate_limit_error", code="queue_full"), status_code=429,
                            headers={"Retry-After": str(err.retry_after)})
    kind = "timeout_error" if err.status == 504 else "server_error"
    return JSONResponse(error_body(str(err), kind=kind), status_code=err.status)


async def _body(request: Request) -> Any:
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from None
    except RecursionError:  # Python's JSON parser recurses once per nesting level
        raise RequestError("the request body is not valid JSON: nested too deeply") from None


async def _generate(backend: Backend, http_request: Request, request: GenerationRequest):
    from sse_starlette import EventSourceResponse

    if request.sampling.seed is not None and not request.sampling.greedy and not backend.supports_seed:
        raise RequestError(f"seed is not supported by this server's backend ({backend.description}); send "
                           "temperature 0 for a reproducible answer", param="seed", code="unsupported_field")
    ids = prompt_tokens(backend, request)
    max_tokens = bounded_max_tokens(request, len(ids), backend.max_positions)
    job = Job(tuple(ids), max_tokens, request.sampling, cache_prompt=request.cache_prompt)
    tracker = TextTracker(backend.codec.decode, ids, request.stop)
    reply = Reply(request.chat, request.model)
    try:  # before any response starts: a full queue is a 429, streamed or not
        stream = backend.submit(job)
    except GenerationError as err:
        return _refusal(err)
    if request.stream:
        return EventSourceResponse(_events(stream, tracker, reply, request), ping=15)
    collect = asyncio.ensure_future(_collect(stream, tracker))
    try:
        while not collect.done():  # a client that goes away cancels its request
            await asyncio.wait({collect}, timeout=DISCONNECT_POLL)
            if not collect.done() and await http_request.is_disconnected():
                logger.info("client gone: request cancelled after %d tokens", len(tracker.tokens))
                return JSONResponse(error_body("client disconnected"), status_code=499)
        finish = collect.result()
    except GenerationError as err:
        return _refusal(GenerationError(str(err), 503) if stream.cancelled.is_set() and err.status == 500 else err)
    finally:
        collect.cancel()
        stream.cancel()
    return reply.full(tracker.text, finish, reply.usage(len(ids), len(tracker.tokens)))


async def _collect(stream: TokenStream, tracker: TextTracker) -> StreamEnd:
    """Read a request to its end; returns the finish reason."""
    async for token in stream:
        tracker.add(token, stream=False)
        if tracker.stopped:
            stream.cancel()
            return StreamEnd.STOP
    if stream.finish_reason == StreamEnd.CANCELLED:
        raise GenerationError("the request was cancelled (the server is shutting down)")
    return stream.finish_reason


async def _events(stream: TokenStream, tracker: TextTracker, reply: Reply,
                  request: GenerationRequest) -> AsyncIterator[dict[str, str]]:
    """The server-sent events of a streamed request; leaving early (client gone, shutdown) cancels it."""
    def event(data: dict[str, Any]) -> dict[str, str]:
        return {"data": json.dumps(data)}

    complete = False
    try:
        if request.chat:
            yield event(reply.chunk("", role=True))
        finish = None
        async for token in stream:
            delta = tracker.add(token, stream=True)
            if delta:
                yield event(reply.chunk(delta))
            if tracker.stopped:
                finish = StreamEnd.STOP
                break
        if finish is None and stream.finish_reason == StreamEnd.CANCELLED:
            raise GenerationError("the request was cancelled (the server is shutting down)")
        rest = tracker.finish()
        if rest:
            yield event(reply.chunk(rest))
        yield event(reply.chunk(None if request.chat else "", finish or stream.finish_reason))
        if request.include_usage:
            yield event(reply.usage_chunk(reply.usage(len(tracker.prompt_tokens), len(tracker.tokens))))
        yield {"data": "[DONE]"}
        complete = True
    except GenerationError as err:
        complete = True
        yield event(error_body(str(err), kind="timeout_error" if err.status == 504 else "server_error"))
    finally:
        if not complete:
            logger.info("stream closed early (client gone or server stopping): request cancelled after %d tokens",
                        len(tracker.tokens))
        stream.cancel()


def serve(export_dir: str | os.PathLike[str], *, host: str = "127.0.0.1", port: int = 8000,
          model_name: str | None = None, backend: str = "auto", verify_weights: bool = True,
          threads: int | None = None, shutdown_timeout: float = 10.0, providers: Sequence[str] | None = None,
          api_key: str | None = None, limits: ServeLimits | None = None, **batch_options: Any) -> None:
    """Serve an export over HTTP until SIGINT/SIGTERM (``kvq serve``).

    The port is bound before the model loads, so a taken port is a one-line :class:`KVQError`; ``port=0`` picks a
    free one (logged). ``api_key``: the bearer token clients must send (None: :data:`API_KEY_ENV` when set, else
    open). ``limits`` and ``batch_options`` (``max_seqs``, ``cache_budget``, ``prefill_chunk``,
    ``allow_batch_variance``) go to :func:`~kvq_export.serve.factory.open_backend`. Raises :class:`KVQError`
    after stopping when the generation thread died, so the process exits non-zero.
    """
    import uvicorn

    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    sock = bind(host, port)
    try:
        runner = open_backend(export_dir, kind=backend, verify_weights=verify_weights, threads=threads,
                              providers=providers, limits=limits, **batch_options)
        runner.start()
    except BaseException:
        sock.close()
        raise
    name = model_name or Path(export_dir).resolve().name
    bound_host, bound_port = sock.getsockname()[:2]
    logger.info("model %r on http://%s:%d/v1 (%s%s)", name, bound_host, bound_port, runner.description,
                ", API key required" if api_key else "")
    config = uvicorn.Config(create_app(runner, model_name=name, api_key=api_key),
                            timeout_graceful_shutdown=shutdown_timeout, log_level="info")
    server = uvicorn.Server(config)

    def stop() -> None:  # the generation thread died: /health says so, then the server stops
        server.should_exit = True

    runner.on_failure = stop
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled once it has shut down: a clean stop
        logger.info("stopped by SIGINT")
    finally:
        runner.close()  # also when uvicorn stopped before the app's shutdown ran
        sock.close()
    if runner.failed:
        raise KVQError("the generation thread failed (see the log above); the server stopped")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (a one-line :class:`KVQError` when it cannot be had)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as err:
        raise KVQError(f"cannot listen on {host}:{port}: {err}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise KVQError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock
