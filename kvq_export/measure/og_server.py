"""The thinnest OpenAI-style server around onnxruntime-genai's ``og.Engine``: the baseline a user would write.

``python -m kvq_export.measure.og_server MODEL_DIR --port P`` serves ``/v1/completions`` (text prompt, streamed or
not), ``/v1/chat/completions`` (messages, rendered by og's own chat template), ``/v1/models`` and ``/health``.
One thread creates ``og.Model``, its tokenizer and ``og.Engine`` and makes every call on them (og requires the
engine's calls to come from the thread that created it); requests reach it through a queue, tokens come back to
the event loop per request. Nothing is admitted, bounded or refused beyond what og itself does, and fields it has
no use for are ignored (``cache_prompt`` among them): that is the point of a baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

logger = logging.getLogger(__name__)

#: engine events fetched per step
EVENTS = 256
#: answer tokens when a request names none (OpenAI's completion default)
DEFAULT_MAX_TOKENS = 16


@dataclass
class _Job:
    """One request on its way through the engine thread; ``out`` receives text pieces, then a final dict."""

    prompt: str
    max_tokens: int
    temperature: float
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    messages: list[dict[str, Any]] | None = None  # a chat request: rendered by og's chat template
    request: Any = None
    turn: int = 0
    decoder: Any = None
    prompt_tokens: int = 0
    generated: int = 0

    def send(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class EngineThread:
    """The one thread that owns ``og.Model``, ``og.Tokenizer`` and ``og.Engine``."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = threading.Event()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="og-engine", daemon=True)

    def start(self) -> None:
        """Start the thread and wait until the model is loaded (raises what og raised if it could not)."""
        self.thread.start()
        self.ready.wait()
        if self.error:
            raise RuntimeError(self.error)

    def stop(self) -> None:
        """Let the thread finish its step and leave."""
        self.inbox.put(None)
        self.thread.join(30)

    def submit(self, job: _Job) -> None:
        """Queue a request (picked up before the next engine step)."""
        self.inbox.put(("submit", job))

    def cancel(self, job: _Job) -> None:
        """Cancel a request whose client went away."""
        self.inbox.put(("cancel", job))

    def _run(self) -> None:
        import onnxruntime_genai as og

        try:
            model = og.Model(self.model_dir)
            tokenizer = og.Tokenizer(model)
            engine = og.Engine(model)
        except Exception as err:  # noqa: BLE001 - og's own errors: reported by start()
            self.error = f"onnxruntime-genai could not load {self.model_dir}: {err}"
            self.ready.set()
            return
        self.ready.set()
        events, jobs = engine.create_event_buffer(EVENTS), []
        while True:
            commands = [self.inbox.get()] if not jobs else []  # block while idle
            while not self.inbox.empty():
                commands.append(self.inbox.get())
            if any(command is None for command in commands):
                break
            for kind, job in commands:
                if kind == "submit":
                    self._begin(og, tokenizer, engine, job, jobs)
                elif job in jobs:
                    job.request.cancel_turn(job.turn)  # og reports the turn finished at its next step
            if jobs:
                self._step(og, engine, events, jobs)
        for job in jobs:
            job.request.close()
            job.send({"error": "the server is stopping"})

    @staticmethod
    def _begin(og, tokenizer, engine, job: _Job, jobs: list[_Job]) -> None:
        import numpy as np

        try:
            if job.messages is not None:
                job.prompt = tokenizer.apply_chat_template(json.dumps(job.messages), add_generation_prompt=True)
            ids = np.asarray(tokenizer.encode(job.prompt), dtype=np.int32)
            job.prompt_tokens = len(ids)
            job.request = engine.create_request()
            turn = og.TurnOptions(job.request)
            turn.set_max_generated_tokens(job.max_tokens)
            turn.set_do_sample(job.temperature > 0)
            if job.temperature > 0:
                turn.set_temperature(job.temperature)
            job.turn = job.request.begin_turn(ids, turn)
            job.decoder = tokenizer.create_stream()
        except Exception as err:  # noqa: BLE001 - og refused this request: it fails, the server stays
            job.send({"error": str(err)})
            return
        jobs.append(job)

    @staticmethod
    def _step(og, engine, events, jobs: list[_Job]) -> None:
        flags = og.EngineEventFlags
        for event in engine.run(events):
            job = next((j for j in jobs if j.request == event.request), None)
            if job is None:
                continue
            if event.flags & flags.TOKEN:
                job.generated += 1
                job.send(job.decoder.decode(event.token))
            if event.flags & (flags.FAILED | flags.TURN_FINISHED):
                job.send({"finish_reason": "length" if event.finish_reason.name.startswith("MAX") else "stop",
                          "usage": {"prompt_tokens": job.prompt_tokens, "completion_tokens": job.generated,
                                    "total_tokens": job.prompt_tokens + job.generated},
                          **({"error": event.error_code.name} if event.flags & flags.FAILED else {})})
                job.request.close()
                jobs.remove(job)


class Completion(BaseModel):
    """The fields of OpenAI's completion request this server reads (any others are ignored)."""

    model: str = ""
    prompt: str
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class Chat(BaseModel):
    """The fields of OpenAI's chat-completion request this server reads (any others are ignored)."""

    model: str = ""
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    stream: bool = False
    stream_options: dict[str, Any] | None = None


def _text_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "finish_reason": finish_reason}


def _chat_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish_reason}


def create_app(engine: EngineThread, model_name: str) -> FastAPI:
    """The FastAPI app: ``/health``, ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "onnxruntime-genai"}]}

    @app.post("/v1/completions")
    async def completions(body: Completion):
        job = _Job(body.prompt, body.max_tokens, body.temperature, asyncio.get_running_loop(), asyncio.Queue())
        engine.submit(job)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_events(engine, job, head, usage, _text_choice),
                                     media_type="text/event-stream")
        parts, end = await _collect(engine, job)
        if "error" in end:
            return JSONResponse({"error": {"message": end["error"], "type": "server_error"}}, status_code=500)
        return {**head, "choices": [_text_choice("".join(parts), end["finish_reason"])], "usage": end["usage"]}

    @app.post("/v1/chat/completions")
    async def chat(body: Chat):
        max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
        job = _Job("", max_tokens, body.temperature, asyncio.get_running_loop(), asyncio.Queue(),
                   messages=body.messages)
        engine.submit(job)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_events(engine, job, {**head, "object": "chat.completion.chunk"}, usage,
                                             _chat_choice), media_type="text/event-stream")
        parts, end = await _collect(engine, job)
        if "error" in end:
            return JSONResponse({"error": {"message": end["error"], "type": "server_error"}}, status_code=500)
        message = {"role": "assistant", "content": "".join(parts)}
        return {**head, "object": "chat.completion", "usage": end["usage"],
                "choices": [{"index": 0, "message": message, "finish_reason": end["finish_reason"]}]}

    return app


async def _collect(engine: EngineThread, job: _Job) -> tuple[list[str], dict[str, Any]]:
    parts = []
    try:
        while isinstance(item := await job.out.get(), str):
            parts.append(item)
    except asyncio.CancelledError:
        engine.cancel(job)
        raise
    return parts, item


async def _events(engine: EngineThread, job: _Job, head: dict[str, Any], usage: bool, choice) -> AsyncIterator[str]:
    def event(data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data)}\n\n"

    done = False
    try:
        while isinstance(item := await job.out.get(), str):
            yield event({**head, "choices": [choice(item, None)]})
        done = True
        if "error" in item:
            yield event({"error": {"message": item["error"], "type": "server_error"}})
            return
        yield event({**head, "choices": [choice("", item["finish_reason"])]})
        if usage:
            yield event({**head, "choices": [], "usage": item["usage"]})
        yield "data: [DONE]\n\n"
    finally:
        if not done:  # the client went away mid-answer
            engine.cancel(job)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m kvq_export.measure.og_server MODEL_DIR [--host H] [--port P] [--model-name NAME]``."""
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m kvq_export.measure.og_server", description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", help="an onnxruntime-genai model folder (genai_config.json)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-name", default="og")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    engine = EngineThread(args.model_dir)
    engine.start()
    try:
        # in-flight requests get 5 s after SIGTERM (a request og runs to the end of the context would hold it)
        uvicorn.run(create_app(engine, args.model_name), host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=5)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
