"""The HTTP layer: an OpenAI-compatible FastAPI app over a backend, and :func:`serve`, which runs it with uvicorn.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` sends
server-sent events, ending with ``data: [DONE]``) and ``GET /health``. A request's prompt plus ``max_tokens``
must fit the model's positions (else 400, with the numbers), so no request holds a batch slot past its context. A
client that goes away cancels its request. On shutdown uvicorn lets in-flight requests finish for
``shutdown_timeout`` seconds, then cancels them; the backend's thread stops last.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvq_export.errors import KVQError
from kvq_export.serve.backends import Backend, GenerationError, Job, StreamEnd, TokenStream, open_backend
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


def prompt_tokens(backend: Backend, request: GenerationRequest) -> list[int]:
    """Token ids of a request's prompt: text as ``kvq generate`` encodes it, ids checked, chat through the template."""
    tokenizer = backend.tokenizer
    if request.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("this export's tokenizer has no chat template; use /v1/completions", param="messages")
        try:
            text = tokenizer.apply_chat_template(list(request.prompt), add_generation_prompt=True, tokenize=False)
        except Exception as err:  # noqa: BLE001 - the template (jinja) rejects a conversation with its own errors
            raise RequestError(f"the chat template refused these messages: {err}", param="messages") from None
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template wrote the special tokens
    elif isinstance(request.prompt, str):
        ids = list(tokenizer(request.prompt)["input_ids"])
    else:
        ids = list(request.prompt)
        bad = [t for t in ids if not 0 <= t < backend.vocab_size]
        if bad:
            raise RequestError(f"prompt token {bad[0]} is outside the vocabulary; allowed: 0 .. "
                               f"{backend.vocab_size - 1}", param="prompt")
    if not ids:
        raise RequestError("the prompt encodes to no token", param="messages" if request.chat else "prompt")
    return ids


def create_app(backend: Backend, *, model_name: str) -> FastAPI:
    """The FastAPI app serving ``backend`` as model ``model_name``; the app's shutdown closes the backend."""
    from starlette.exceptions import HTTPException

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(backend.close)

    app = FastAPI(title="kvq", lifespan=lifespan)

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(err.detail), kind=kind), status_code=err.status_code)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "active_requests": backend.active, **backend.describe()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": int(os.path.getmtime(backend.directory)),
                "owned_by": "kvq", "kvq": backend.describe()}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(backend, request, parse_completion(await _body(request), served=model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(backend, request, parse_chat(await _body(request), served=model_name))

    return app


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
    job = Job(tuple(ids), max_tokens, request.sampling)
    tracker = TextTracker(backend.tokenizer, ids, request.stop)
    reply = Reply(request.chat, request.model)
    if request.stream:  # submitted when the response starts: a client gone before then never runs
        return EventSourceResponse(_events(backend, job, tracker, reply, request), ping=15)
    try:
        stream = backend.submit(job)
    except GenerationError as err:
        return JSONResponse(error_body(str(err), kind="server_error"), status_code=503)
    collect = asyncio.ensure_future(_collect(stream, tracker))
    try:
        while not collect.done():  # a client that goes away cancels its request
            await asyncio.wait({collect}, timeout=DISCONNECT_POLL)
            if not collect.done() and await http_request.is_disconnected():
                logger.info("client gone: request cancelled after %d tokens", len(tracker.tokens))
                return JSONResponse(error_body("client disconnected"), status_code=499)
        finish = collect.result()
    except GenerationError as err:
        return JSONResponse(error_body(str(err), kind="server_error"), status_code=503 if stream.cancelled.is_set()
                            else 500)
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


async def _events(backend: Backend, job: Job, tracker: TextTracker, reply: Reply,
                  request: GenerationRequest) -> AsyncIterator[dict[str, str]]:
    """The server-sent events of a streamed request; leaving early (client gone, shutdown) cancels it."""
    def event(data: dict[str, Any]) -> dict[str, str]:
        return {"data": json.dumps(data)}

    try:
        stream = backend.submit(job)
    except GenerationError as err:
        yield event(error_body(str(err), kind="server_error"))
        return
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
        yield event(error_body(str(err), kind="server_error"))
    finally:
        if not complete:
            logger.info("stream closed early (client gone or server stopping): request cancelled after %d tokens",
                        len(tracker.tokens))
        stream.cancel()


def serve(export_dir: str | os.PathLike[str], *, host: str = "127.0.0.1", port: int = 8000,
          model_name: str | None = None, backend: str = "auto", verify_weights: bool = True,
          threads: int | None = None, shutdown_timeout: float = 10.0, providers: Sequence[str] | None = None) -> None:
    """Serve an export over HTTP until SIGINT/SIGTERM (``kvq serve``).

    The port is bound before the model loads, so a taken port is a one-line :class:`KVQError`; ``port=0`` picks a
    free one (logged).
    """
    import uvicorn

    sock = bind(host, port)
    try:
        runner = open_backend(export_dir, kind=backend, verify_weights=verify_weights, threads=threads,
                              providers=providers)
        runner.start()
    except BaseException:
        sock.close()
        raise
    name = model_name or Path(export_dir).resolve().name
    bound_host, bound_port = sock.getsockname()[:2]
    logger.info("model %r on http://%s:%d/v1 (%s)", name, bound_host, bound_port, runner.description)
    try:
        config = uvicorn.Config(create_app(runner, model_name=name), timeout_graceful_shutdown=shutdown_timeout,
                                log_level="info")
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled once it has shut down: a clean stop
        logger.info("stopped by SIGINT")
    finally:
        runner.close()  # also when uvicorn stopped before the app's shutdown ran
        sock.close()


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
