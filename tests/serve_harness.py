"""What the ``kvq serve`` tests share: tiny prompts, an in-process server on 127.0.0.1, the official client."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

from tiny_models import WORDS, tiny_tokenizer

from kvq_export.serve import create_app
from kvq_export.serve.app import bind
from kvq_export.serve.backends import Job, StreamEnd

NAME = "tiny"
TIMEOUT = 30.0  # seconds, any one request
#: the tiny tokenizer has no chat template: this one writes each message as ``w1 <content>`` and ends with ``w2``
CHAT_TEMPLATE = "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w2{% endif %}"


def words(n: int, start: int = 0) -> str:
    """``n`` vocabulary words: a prompt of ``n`` tokens."""
    return " ".join(WORDS[(start + 13 * j) % len(WORDS)] for j in range(n))


def chat_tokenizer():
    """The tiny word-level tokenizer with :data:`CHAT_TEMPLATE`."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@contextmanager
def serving(app):
    """Uvicorn serving the ASGI ``app`` in a thread on a free 127.0.0.1 port; yields the base URL."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@contextmanager
def running(backend, *, api_key: str | None = None):
    """``backend`` started and served by :func:`serving` as model :data:`NAME`; yields the base URL."""
    backend.start()
    with serving(create_app(backend, model_name=NAME, api_key=api_key)) as url:
        yield url


def client(url: str, api_key: str = "unused"):
    """The official OpenAI client on ``url`` (no retries, :data:`TIMEOUT` per request)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, timeout=TIMEOUT, max_retries=0)


async def run_jobs(backend, jobs, delays=None, cancel_after=None) -> list[tuple[list[int], StreamEnd]]:
    """Submit ``jobs`` (after ``delays`` seconds each), read every stream; ``cancel_after[i]`` tokens cancel job i."""
    async def one(i: int, job: Job):
        await asyncio.sleep(delays[i] if delays else 0)
        stream = backend.submit(job)
        tokens = []
        async for token in stream:
            tokens.append(token)
            if cancel_after and cancel_after[i] is not None and len(tokens) >= cancel_after[i]:
                stream.cancel()
                return tokens, StreamEnd.CANCELLED
        return tokens, stream.finish_reason

    return await asyncio.gather(*(one(i, job) for i, job in enumerate(jobs)))


def served(backend, jobs, **kwargs) -> list[tuple[list[int], StreamEnd]]:
    """:func:`run_jobs` to the end (each job's tokens and how it ended), in a loop of its own."""
    return asyncio.run(asyncio.wait_for(run_jobs(backend, jobs, **kwargs), timeout=120))
