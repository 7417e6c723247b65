"""Where served requests run: a thread of their own, fed through :class:`TokenStream` s, never the event loop.

- :class:`~kvq_export.serve.scheduler.BatchBackend` (``buffer``-layout exports, ``--flavor ort-gqa``): continuous
  batching over rows of one cache (:mod:`kvq_export.serve.scheduler`).
- :class:`SessionBackend` (every other flavor): a worker thread runs a :class:`~kvq_export.runtime.base.Session`
  (kvq's loop) for one request at a time, in arrival order; a cancelled request stops at its next token.

Both share what :class:`Backend` does: the export's :class:`~kvq_export.runtime.text_codec.TextCodec`, the bounded
wait queue (:class:`ServeLimits`), per-request deadlines, the Prometheus metrics and the thread's health.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from kvq_export.errors import KVQError
from kvq_export.manifest import Manifest
from kvq_export.runtime import open_session
from kvq_export.runtime.base import Session
from kvq_export.runtime.sampling import SamplingConfig
from kvq_export.runtime.text_codec import TextCodec
from kvq_export.serve.metrics import ServeMetrics
from kvq_export.vocab import FinishReason

logger = logging.getLogger(__name__)

#: Seconds :meth:`Backend.close` waits for its thread.
CLOSE_TIMEOUT = 10.0


class GenerationError(KVQError):
    """A request failed while generating (the runtime raised, its deadline passed, or the server is stopping)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class QueueFull(GenerationError):
    """Every row is busy and the wait queue is full: the client should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, status=429)
        self.retry_after = retry_after


@dataclass(frozen=True)
class ServeLimits:
    """What the server holds back: waiting requests, a request's time, and its tokens."""

    #: requests waiting for a row (beyond those running) before new ones get 429
    max_waiting: int = 256
    #: seconds from arrival a request may take before it fails (None: no deadline)
    request_timeout: float | None = None
    #: tokens one request may hold, prompt plus generated (None: the export's positions)
    context: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            raise KVQError(f"invalid max_waiting={self.max_waiting!r}: allowed: an integer >= 0")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise KVQError(f"invalid request_timeout={self.request_timeout!r}: allowed: seconds > 0, or None")
        if self.context is not None and (isinstance(self.context, bool) or not isinstance(self.context, int)
                                         or self.context < 2):
            raise KVQError(f"invalid context={self.context!r}: allowed: an integer >= 2, or None")


@dataclass(frozen=True)
class Job:
    """What a backend generates for one request: token ids in, at most ``max_tokens`` out."""

    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingConfig
    #: reuse a cached prefix of the prompt, and keep this one's codes for later requests (where the backend caches)
    cache_prompt: bool = True


class StreamEnd(StrEnum):
    """How a :class:`TokenStream` ends: OpenAI's finish reasons, or without an answer."""

    STOP = "stop"  # end of sequence (or a stop string matched, see the app)
    LENGTH = "length"  # max_tokens
    CANCELLED = "cancelled"
    ERROR = "error"  # the reader raised GenerationError


class TokenStream:
    """One request's tokens: produced by a backend thread, read by ``async for`` in the handler's event loop.

    The stream ends with a :class:`StreamEnd`: ``stop`` (end of sequence), ``length`` (``max_tokens``) or
    ``cancelled``; a failure raises :class:`GenerationError` in the reader. :meth:`cancel` frees the request's
    slot (a cache row, or the session's turn); it is idempotent and safe after the end.
    """

    def __init__(self, job: Job, backend: Backend, loop: asyncio.AbstractEventLoop) -> None:
        self.job = job
        self.finish_reason: StreamEnd | None = None
        self.cancelled = threading.Event()
        self.arrival = time.monotonic()
        timeout = backend.limits.request_timeout
        self.deadline = None if timeout is None else self.arrival + timeout
        self.running = False  # admitted to generation (a row, or the session's turn); False while waiting
        self.generated = 0
        self._backend = backend
        self._loop = loop
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._ended = threading.Event()  # the producer posted its last item

    # -- producer side (the backend's thread) -------------------------------------------------------------
    def put(self, token: int) -> None:
        """Hand one generated token to the reader."""
        if self.generated == 0:
            self._backend.metrics.time_to_first_token.observe(time.monotonic() - self.arrival)
        self.generated += 1
        self._backend.metrics.generation_tokens.inc()
        self._post(("token", int(token)))

    def end(self, reason: StreamEnd) -> None:
        """The last item: the finish reason."""
        self._close(("end", reason), reason)

    def fail(self, message: str, status: int = 500) -> None:
        """The last item: an error the reader raises (``status``: the HTTP status it answers with)."""
        self._close(("error", (message, status)), StreamEnd.ERROR)

    @property
    def overdue(self) -> bool:
        """Its deadline has passed."""
        return self.deadline is not None and time.monotonic() > self.deadline

    def _close(self, item: tuple[str, Any], reason: StreamEnd) -> None:
        if not self._ended.is_set():
            self._ended.set()
            self._post(item)
            self._backend._forget(self, reason)

    def _post(self, item: tuple[str, Any]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody reads this stream any more
            pass

    # -- reader side (the event loop) ---------------------------------------------------------------------
    async def __aiter__(self) -> AsyncIterator[int]:
        while self.finish_reason is None:
            kind, value = await self._queue.get()
            if kind == "token":
                yield value
            elif kind == "end":
                self.finish_reason = value
            else:
                self.finish_reason = StreamEnd.ERROR
                raise GenerationError(*value)

    def cancel(self) -> None:
        """Stop generating for this request (a client went away, a stop string matched, the server stops)."""
        if not self._ended.is_set() and not self.cancelled.is_set():
            self.cancelled.set()
            self._backend._cancel(self)


class Backend(ABC):
    """Runs :class:`Job` s in a thread of its own. Subclasses declare what they are through class attributes."""

    #: one line for logs and ``/health``
    description: ClassVar[str]
    #: whether requests share decode steps
    batching: ClassVar[bool]
    #: whether a sampled request's ``seed`` makes it reproducible
    supports_seed: ClassVar[bool] = True

    def __init__(self, directory: str | Path, *, verify_weights: bool = True, threads: int | None = None,
                 reason: str | None = None, providers: Sequence[str] | None = None,
                 limits: ServeLimits | None = None, metrics: ServeMetrics | None = None) -> None:
        self.directory = Path(directory)
        self.manifest = Manifest.load(self.directory)
        self.verify_weights = verify_weights
        self.threads = threads
        self.providers = providers  # ONNX Runtime providers (None: the runtime's default choice)
        self.reason = reason  # why this backend serves the export (shown in /health)
        self.limits = limits or ServeLimits()
        self.metrics = metrics or ServeMetrics()
        self.codec = TextCodec(self.directory, self.manifest)  # replies are text: a served export has a tokenizer
        #: called (from the backend's thread) when that thread fails: the server then stops
        self.on_failure: Callable[[], None] | None = None
        self.failed = False
        self._streams: set[TokenStream] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def max_positions(self) -> int:
        """Tokens one request may hold (prompt plus generated)."""
        return self.limits.context or self.manifest.model.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may use: 0 .. vocab_size - 1."""
        return self.manifest.model.vocab_size

    @property
    def active(self) -> int:
        """Requests submitted and not finished (waiting or generating)."""
        with self._lock:
            return len(self._streams)

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet generating."""
        with self._lock:
            return self._waiting()

    def _waiting(self) -> int:
        """:attr:`waiting`, with the lock held."""
        return sum(not s.running for s in self._streams)

    @property
    def alive(self) -> bool:
        """The generation thread runs (False once it failed or the backend closed)."""
        return self._thread is not None and self._thread.is_alive() and not self.failed

    def describe(self) -> dict[str, Any]:
        """What ``/health`` and ``/v1/models`` say about how requests run."""
        info: dict[str, Any] = {"backend": self.description, "batching": self.batching,
                                "flavor": self.manifest.flavor, "scheme": self.manifest.scheme.name or "custom",
                                "max_positions": self.max_positions, "max_waiting": self.limits.max_waiting}
        if self.reason:
            info["reason"] = self.reason
        return info

    def submit(self, job: Job) -> TokenStream:
        """Queue a job; call from the event loop that reads the returned stream."""
        if self._closed:
            raise GenerationError("the server is shutting down", status=503)
        with self._lock:
            waiting = self._waiting()
            if waiting >= self.limits.max_waiting + self.free_slots():
                raise QueueFull(f"{waiting} requests are waiting, the most this server queues "
                                f"(--max-waiting {self.limits.max_waiting}); retry later", retry_after=1)
            stream = TokenStream(job, self, asyncio.get_running_loop())
            self._streams.add(stream)
        self.metrics.prompt_tokens.inc(len(job.prompt_tokens))
        self._enqueue(stream)
        self._update_gauges()
        return stream

    def free_slots(self) -> int:
        """Requests that could start generating now (a waiting request takes one)."""
        return 0

    def start(self) -> None:
        """Load the model in the backend's thread and start serving; a load error is raised here."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                state = self._load()
            except BaseException as err:  # noqa: BLE001 - handed to the caller of start()
                failure.append(err)
                ready.set()
                return
            ready.set()
            try:
                self._serve(state)
            except BaseException:  # a bug in the loop: fail what waits instead of leaving it waiting forever
                logger.exception("the %s thread failed; the server answers no more requests", type(self).__name__)
                self._fail_all("the server's generation thread failed")
                if self.on_failure is not None:
                    self.on_failure()

        self._thread = threading.Thread(target=main, name=f"kvq-{type(self).__name__}", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        logger.info("serving %s: %s%s", self.directory, self.description,
                    f" ({self.reason})" if self.reason else "")

    def _fail_all(self, message: str) -> None:
        self.failed = self._closed = True
        with self._lock:
            left = list(self._streams)
        for stream in left:
            stream.fail(message, status=503)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Cancel what is queued or running, stop the thread and wait for it (at most ``timeout`` seconds)."""
        if self._closed and not self.failed:
            return
        self._closed = True
        with self._lock:
            running = list(self._streams)
        for stream in running:  # generation stops at the stream's next token
            stream.cancelled.set()
        self._enqueue(None)  # the thread's signal to stop
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the %s thread did not stop within %.0f s", type(self).__name__, timeout)
        with self._lock:
            left = list(self._streams)
        for stream in left:
            stream.fail("the server is shutting down", status=503)
        logger.info("stopped %s", self.description)

    def _started(self, stream: TokenStream) -> None:
        """``stream`` leaves the wait queue and starts generating (the backend's thread calls this)."""
        stream.running = True
        self._update_gauges()

    def _forget(self, stream: TokenStream, reason: StreamEnd) -> None:
        with self._lock:
            self._streams.discard(stream)
        self.metrics.requests.labels(finish=str(reason)).inc()
        self.metrics.request_latency.observe(time.monotonic() - stream.arrival)
        self._update_gauges()

    def _update_gauges(self) -> None:
        with self._lock:
            waiting, total = self._waiting(), len(self._streams)
        self.metrics.sequences_running.set(total - waiting)
        self.metrics.sequences_waiting.set(waiting)

    @abstractmethod
    def _load(self) -> Any:
        """Open the model (in the backend's thread); returns what :meth:`_serve` needs."""

    @abstractmethod
    def _serve(self, state: Any) -> None:
        """The thread's loop, until :meth:`_enqueue` receives None."""

    @abstractmethod
    def _enqueue(self, stream: TokenStream | None) -> None:
        """Hand a new stream (None: stop) to the thread."""

    @abstractmethod
    def _cancel(self, stream: TokenStream) -> None:
        """Ask the thread to stop generating for ``stream``."""


class _Stopped(Exception):
    """Raised from the token callback to end a cancelled or overdue generation early."""


class SessionBackend(Backend):
    """One :class:`~kvq_export.runtime.session.KVQSession`, one request at a time, in arrival order."""

    description = "kvq session on ONNX Runtime, one request at a time"
    batching = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._jobs: queue.SimpleQueue[TokenStream | None] = queue.SimpleQueue()

    def _load(self):
        return open_session(self.directory, "kvq", threads=self.threads, verify_weights=self.verify_weights,
                            providers=self.providers, tokenizer=False)

    def _enqueue(self, stream: TokenStream | None) -> None:
        self._jobs.put(stream)

    def _cancel(self, stream: TokenStream) -> None:
        pass  # the worker checks stream.cancelled before starting and at every token

    def _serve(self, session: Session) -> None:
        while (stream := self._jobs.get()) is not None:
            if stream.cancelled.is_set():
                stream.end(StreamEnd.CANCELLED)
            elif stream.overdue:
                stream.fail("the request's deadline passed before it started", status=504)
            else:
                self._started(stream)
                self._generate(session, stream)
        while True:  # stopping: whatever is still queued never starts
            try:
                left = self._jobs.get_nowait()
            except queue.Empty:
                return
            if left is not None:
                left.end(StreamEnd.CANCELLED)

    def _generate(self, session: Session, stream: TokenStream) -> None:
        def on_token(row: int, token: int) -> None:
            if stream.cancelled.is_set() or stream.overdue:
                raise _Stopped
            stream.put(token)

        job = stream.job
        try:
            result = session.generate([list(job.prompt_tokens)], job.max_tokens, job.sampling, on_token=on_token)[0]
        except _Stopped:
            if stream.cancelled.is_set():
                stream.end(StreamEnd.CANCELLED)
            else:
                stream.fail("the request's deadline passed", status=504)
        except KVQError as err:
            logger.warning("a request failed: %s", err)
            stream.fail(str(err))
        except Exception as err:  # noqa: BLE001 - one request's bug must not stop the server
            logger.exception("a request failed")
            stream.fail(f"{type(err).__name__}: {err}")
        else:
            stream.end(StreamEnd.STOP if result.finish_reason == FinishReason.EOS else StreamEnd.LENGTH)
