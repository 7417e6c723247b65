"""Where served requests run: onnxruntime-genai's continuous-batching ``og.Engine``, or one ``KVQSession``.

Both run generation in one thread of their own and hand each request's tokens to a :class:`TokenStream`, which
the asyncio handler reads; neither ever blocks the event loop.

- :class:`EngineBackend` (exports onnxruntime-genai can serve: ``--flavor ort-gqa``): every ``og.Engine`` call
  must come from the thread that created it, so one thread owns the model and the engine. It takes new requests
  and cancellations from a queue, steps the engine while any request is pending and routes each token event to
  its request's stream. Concurrent requests decode as one batch.
- :class:`SessionBackend` (every other flavor): a worker thread runs a :class:`~kvq_export.runtime.base.Session`
  (kvq's loop) for one request at a time, in arrival order; a cancelled request stops at its next token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from kvq_export.errors import KVQError
from kvq_export.manifest import Manifest
from kvq_export.runtime import open_session
from kvq_export.runtime.base import Session
from kvq_export.runtime.genai import GENAI_CONFIG, RUNTIME, GenaiSession, unsupported_reason
from kvq_export.runtime.sampling import SamplingConfig
from kvq_export.runtime.session import load_tokenizer
from kvq_export.vocab import FinishReason

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "engine", "session")
#: Seconds :meth:`Backend.close` waits for its thread.
CLOSE_TIMEOUT = 10.0


class GenerationError(KVQError):
    """A request failed while generating (the runtime raised, or the server is shutting down)."""


@dataclass(frozen=True)
class Job:
    """What a backend generates for one request: token ids in, at most ``max_tokens`` out."""

    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingConfig


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
    slot (a batch row, or the session's turn); it is idempotent and safe after the end.
    """

    def __init__(self, job: Job, backend: Backend, loop: asyncio.AbstractEventLoop) -> None:
        self.job = job
        self.finish_reason: StreamEnd | None = None
        self.cancelled = threading.Event()
        self._backend = backend
        self._loop = loop
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._ended = threading.Event()  # the producer posted its last item

    # -- producer side (the backend's thread) -------------------------------------------------------------
    def put(self, token: int) -> None:
        """Hand one generated token to the reader."""
        self._post(("token", int(token)))

    def end(self, reason: StreamEnd) -> None:
        """The last item: the finish reason."""
        self._close(("end", reason))

    def fail(self, message: str) -> None:
        """The last item: an error the reader raises."""
        self._close(("error", message))

    def _close(self, item: tuple[str, Any]) -> None:
        if not self._ended.is_set():
            self._ended.set()
            self._post(item)
            self._backend._forget(self)

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
                raise GenerationError(value)

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
                 reason: str | None = None, providers: Sequence[str] | None = None) -> None:
        self.directory = Path(directory)
        self.manifest = Manifest.load(self.directory)
        self.verify_weights = verify_weights
        self.threads = threads
        self.providers = providers  # ONNX Runtime providers (None: the runtime's default choice)
        self.reason = reason  # why this backend serves the export (shown in /health)
        self.tokenizer = load_tokenizer(self.directory, self.manifest)
        self._streams: set[TokenStream] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def max_positions(self) -> int:
        """Tokens one request may hold (prompt plus generated)."""
        return self.manifest.model.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may use: 0 .. vocab_size - 1."""
        return self.manifest.model.vocab_size

    @property
    def active(self) -> int:
        """Requests submitted and not finished (queued or generating)."""
        with self._lock:
            return len(self._streams)

    def describe(self) -> dict[str, Any]:
        """What ``/health`` and ``/v1/models`` say about how requests run."""
        info: dict[str, Any] = {"backend": self.description, "batching": self.batching,
                                "flavor": self.manifest.flavor, "scheme": self.manifest.scheme.name or "custom",
                                "max_positions": self.max_positions}
        if self.reason:
            info["reason"] = self.reason
        return info

    def submit(self, job: Job) -> TokenStream:
        """Queue a job; call from the event loop that reads the returned stream."""
        if self._closed:
            raise GenerationError("the server is shutting down")
        stream = TokenStream(job, self, asyncio.get_running_loop())
        with self._lock:
            self._streams.add(stream)
        self._enqueue(stream)
        return stream

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
                self._closed = True
                with self._lock:
                    left = list(self._streams)
                for stream in left:
                    stream.fail("the server's generation thread failed")

        self._thread = threading.Thread(target=main, name=f"kvq-{type(self).__name__}", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        logger.info("serving %s: %s%s", self.directory, self.description,
                    f" ({self.reason})" if self.reason else "")

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Cancel what is queued or running, stop the thread and wait for it (at most ``timeout`` seconds)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            running = list(self._streams)
        for stream in running:  # a session's generation stops at its next token, the engine cancels every turn
            stream.cancelled.set()
        self._enqueue(None)  # the thread's signal to stop
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the %s thread did not stop within %.0f s", type(self).__name__, timeout)
        with self._lock:
            left = list(self._streams)
        for stream in left:
            stream.fail("the server is shutting down")
        logger.info("stopped %s", self.description)

    def _forget(self, stream: TokenStream) -> None:
        with self._lock:
            self._streams.discard(stream)

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


class _Cancelled(Exception):
    """Raised from the token callback to end a cancelled generation early."""


class SessionBackend(Backend):
    """One :class:`~kvq_export.runtime.session.KVQSession`, one request at a time, in arrival order."""

    description = "kvq session on ONNX Runtime, one request at a time"
    batching = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._jobs: queue.SimpleQueue[TokenStream | None] = queue.SimpleQueue()

    def _load(self):
        return open_session(self.directory, "kvq", threads=self.threads, verify_weights=self.verify_weights,
                            providers=self.providers)

    def _enqueue(self, stream: TokenStream | None) -> None:
        self._jobs.put(stream)

    def _cancel(self, stream: TokenStream) -> None:
        pass  # the worker checks stream.cancelled before starting and at every token

    def _serve(self, session: Session) -> None:
        while (stream := self._jobs.get()) is not None:
            if stream.cancelled.is_set():
                stream.end(StreamEnd.CANCELLED)
                continue
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
            if stream.cancelled.is_set():
                raise _Cancelled
            stream.put(token)

        job = stream.job
        try:
            result = session.generate([list(job.prompt_tokens)], job.max_tokens, job.sampling, on_token=on_token)[0]
        except _Cancelled:
            stream.end(StreamEnd.CANCELLED)
        except KVQError as err:
            logger.warning("a request failed: %s", err)
            stream.fail(str(err))
        except Exception as err:  # noqa: BLE001 - one request's bug must not stop the server
            logger.exception("a request failed")
            stream.fail(f"{type(err).__name__}: {err}")
        else:
            stream.end(StreamEnd.STOP if result.finish_reason == FinishReason.EOS else StreamEnd.LENGTH)


@dataclass
class _Turn:
    """A request the engine holds."""

    stream: TokenStream
    request: Any  # og.Request
    turn: int


class EngineBackend(Backend):
    """onnxruntime-genai's ``og.Engine``: concurrent requests decode together, one step for the whole batch.

    The Engine schedules continuously (a request joins at any step) only with a paged cache (``engine.
    dynamic_batching``), which a kvq graph, holding one contiguous buffer per layer, does not have: onnxruntime-genai
    then runs its static scheduler, where waiting requests start together once the running batch has finished, and
    a request cannot be reseeded.
    """

    description = "onnxruntime-genai Engine, static batches (a request joins when the running batch ends)"
    batching = True
    supports_seed = False
    #: engine events fetched per step (tokens of one step: one per running request)
    EVENT_CAPACITY = 256

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inbox: queue.SimpleQueue[tuple[str, TokenStream | None]] = queue.SimpleQueue()
        self.max_batch_size: int | None = None

    def describe(self) -> dict[str, Any]:
        """Adds the engine's batch size."""
        return {**super().describe(), "max_batch_size": self.max_batch_size}

    def _load(self):
        # GenaiSession itself, not open_session: the engine needs its og model, not only the Session protocol
        session = GenaiSession(self.directory, threads=self.threads, verify_weights=self.verify_weights,
                               providers=self.providers)
        engine = session.og.Engine(session.model)
        self.max_batch_size = int(engine.get_capabilities().configured_max_batch_size)
        return session, engine

    def _enqueue(self, stream: TokenStream | None) -> None:
        self._inbox.put(("submit", stream))

    def _cancel(self, stream: TokenStream) -> None:
        self._inbox.put(("cancel", stream))

    def _serve(self, state) -> None:
        session, engine = state
        og = session.og
        events = engine.create_event_buffer(self.EVENT_CAPACITY)
        turns: list[_Turn] = []
        stopping = False
        while not stopping:
            # block while idle; between steps take whatever arrived without waiting
            commands = [self._inbox.get()] if not turns else []
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for command, stream in commands:
                if stream is None:
                    stopping = True
                elif command == "cancel":
                    self._cancel_turn(turns, stream)
                elif stream.cancelled.is_set():
                    stream.end(StreamEnd.CANCELLED)
                else:
                    self._begin(og, engine, turns, stream, self.vocab_size)
            if stopping:
                for turn in list(turns):
                    self._cancel_turn(turns, turn.stream)
            self._step(og, engine, events, turns, drain=stopping)
        for turn in turns:  # the engine did not report these finished while draining
            turn.request.close()
            turn.stream.end(StreamEnd.CANCELLED)
        del events, engine, session  # released in the thread that owns them

    @staticmethod
    def _begin(og, engine, turns: list[_Turn], stream: TokenStream, vocab_size: int) -> None:
        import numpy as np

        job = stream.job
        try:
            options = og.RequestOptions()
            options.set_max_session_tokens(len(job.prompt_tokens) + job.max_tokens)
            request = engine.create_request(options=options)
            turn = og.TurnOptions(request)
            turn.set_max_generated_tokens(job.max_tokens)
            sampling = job.sampling
            turn.set_do_sample(not sampling.greedy)
            if not sampling.greedy:
                turn.set_temperature(float(sampling.temperature))
                # 0: no top-k, as kvq's sampler without one; og refuses top_k > vocab, which keeps every token anyway
                turn.set_top_k(min(int(sampling.top_k or 0), vocab_size))
                turn.set_top_p(float(sampling.top_p or 1.0))
                if sampling.seed is not None:
                    turn.set_seed(int(sampling.seed))
            if sampling.repetition_penalty != 1:
                turn.set_repetition_penalty(float(sampling.repetition_penalty))
            turn_id = request.begin_turn(np.asarray(job.prompt_tokens, dtype=np.int32), turn)
        except Exception as err:  # noqa: BLE001 - og raises untyped errors; the request fails, the server stays
            logger.warning("onnxruntime-genai refused a request: %s", err)
            stream.fail(f"onnxruntime-genai refused the request: {err}")
            return
        turns.append(_Turn(stream, request, turn_id))

    @staticmethod
    def _cancel_turn(turns: list[_Turn], stream: TokenStream) -> None:
        for turn in turns:
            if turn.stream is stream:
                try:
                    turn.request.cancel_turn(turn.turn)  # the engine reports it finished (cancelled) at its next step
                except Exception as err:  # noqa: BLE001 - og's own error: the turn ended meanwhile
                    logger.debug("cancelling a turn: %s", err)
                return

    def _step(self, og, engine, events, turns: list[_Turn], *, drain: bool) -> None:
        """One engine step (all of them when ``drain``, bounded): route tokens, close finished requests."""
        flags = og.EngineEventFlags
        for _ in range(100 if drain else 1):
            if not turns:
                return
            if not engine.has_pending_requests():  # never reported finished: end them rather than spin on them
                for turn in turns:
                    turn.request.close()
                    turn.stream.fail("onnxruntime-genai dropped the request without finishing it")
                turns.clear()
                return
            try:
                fired = list(engine.run(events))
            except Exception as err:  # noqa: BLE001 - a failed step fails the requests it held, not the server
                logger.exception("an onnxruntime-genai engine step failed")
                for turn in turns:
                    turn.request.close()
                    turn.stream.fail(f"the engine step failed: {err}")
                turns.clear()
                return
            for event in fired:
                turn = next((t for t in turns if t.request == event.request), None)
                if turn is None:
                    continue
                if event.flags & flags.TOKEN:
                    turn.stream.put(event.token)
                if event.flags & flags.FAILED:
                    turn.stream.fail(f"onnxruntime-genai failed the request: {event.error_code.name}")
                elif event.flags & flags.TURN_FINISHED:
                    turn.stream.end(_FINISH.get(event.finish_reason.name, StreamEnd.STOP))
                else:
                    continue
                turn.request.close()
                turns.remove(turn)


#: og's finish reasons as OpenAI's
_FINISH = {"EOS": StreamEnd.STOP, "STOP_STRING": StreamEnd.STOP, "MAX_GENERATED_TOKENS": StreamEnd.LENGTH,
           "MAX_SESSION_TOKENS": StreamEnd.LENGTH, "CANCELLED": StreamEnd.CANCELLED}


def open_backend(directory: str | Path, *, kind: str = "auto", verify_weights: bool = True,
                 threads: int | None = None, providers: Sequence[str] | None = None) -> Backend:
    """The backend for an export: ``engine`` where onnxruntime-genai can serve it (``auto``), else ``session``."""
    if kind not in BACKENDS:
        raise KVQError(f"unknown backend {kind!r}; allowed: {', '.join(BACKENDS)}")
    directory = Path(directory)
    manifest = Manifest.load(directory)
    entry = manifest.runtimes.get(RUNTIME)
    servable = entry is not None and entry.supported and (directory / GENAI_CONFIG).is_file()
    why_not = None if servable else ((entry and entry.reason) or unsupported_reason(manifest)
                                     or f"it has no {GENAI_CONFIG}: re-export it")
    if kind == "engine" and not servable:
        raise KVQError(f"onnxruntime-genai cannot serve {directory}: {why_not}")
    if kind == "engine" or kind == "auto" and servable:
        return EngineBackend(directory, verify_weights=verify_weights, threads=threads, providers=providers)
    reason = f"onnxruntime-genai cannot serve this export: {why_not}" if why_not else "chosen with --backend session"
    return SessionBackend(directory, verify_weights=verify_weights, threads=threads, reason=reason,
                          providers=providers)
