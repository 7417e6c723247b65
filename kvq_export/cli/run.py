"""``kvq generate``, ``kvq serve`` and ``kvq demo``: running exports."""

from __future__ import annotations

import logging

import click

from kvq_export.cli._base import (
    STDOUT,
    calibration_options,
    cli,
    deprecated_alias,
    device_option,
    json_option,
    make_console,
    utf8_arg,
    write_json_output,
)
from kvq_export.cli_types import NON_NEGATIVE, ByteSize, FiniteFloat, outside_exports
from kvq_export.demo import DEMO_PROMPT, DEMO_SAMPLING, DEPARTS, TABLE_COLUMNS, long_range_line, run_demo, serve_lines
from kvq_export.runtime import RUNTIMES, open_session
from kvq_export.runtime.base import continuation_text
from kvq_export.runtime.ort_setup import choose_providers
from kvq_export.runtime.sampling import SamplingConfig


@cli.command()
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text (repeat for a batch).")
@click.option("--max-new-tokens", type=click.IntRange(0), default=64, show_default=True,
              help="Tokens generated per prompt.")
@click.option("--temperature", type=NON_NEGATIVE, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(1), default=None, help="Sample from the K most likely tokens only.")
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=None,
              help="Sample from the smallest set of tokens whose probability reaches P (0 < P <= 1).")
@click.option("--seed", type=click.IntRange(0), default=None, help="Random seed of sampling (reproducible runs).")
@click.option("--repetition-penalty", type=FiniteFloat(0.01, 100), default=1.0, show_default=True,
              help="> 1 discourages tokens the row already holds (prompt included); 1 = off.")
@click.option("--runtime", type=click.Choice(RUNTIMES), default="kvq", show_default=True,
              help="kvq: kvq's loop on ONNX Runtime; genai: onnxruntime-genai's C++ loop (ort-gqa exports).")
@json_option("tokens, text and cache bytes")
@device_option()
@click.option("--no-verify", "no_verify", is_flag=True,
              help="Skip checking the weight files against the checksums in kvq.json (faster on trusted storage).")
def generate(export_dir, prompts, max_new_tokens, temperature, top_k, top_p, seed, repetition_penalty, runtime,
             json_out, providers, no_verify) -> None:
    """Generate text from an export directory on ONNX Runtime (quantized cache between steps).

    EXPORT_DIR: a kvq export directory.
    """
    for prompt in prompts:  # bytes that are not UTF-8 arrive as lone surrogates: refuse them before any work
        utf8_arg(prompt, "--prompt")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              repetition_penalty=repetition_penalty)
    session = open_session(export_dir, runtime, verify_weights=not no_verify, providers=providers)
    stream = _TextStream(session, prompts[0]) if len(prompts) == 1 and json_out != STDOUT else None
    results = session.generate(list(prompts), max_new_tokens, sampling, on_token=stream)
    if json_out:
        write_json_output(json_out, {"export": str(export_dir), "scheme": session.manifest.scheme.name,
                                     "runtime": runtime, "results": [r.to_dict() for r in results]})
        if json_out == STDOUT:
            return
    if stream is not None:
        stream.close()
    else:
        for r in results:
            click.echo(f"{r.prompt}{r.text}")
    click.echo(f"[cache: {results[0].cache_bytes} bytes]", err=True)


class _TextStream:
    """Prints a single prompt's continuation as tokens arrive (re-decoding the tail keeps spacing right).

    Nothing is printed before the first token, so a prompt the session refuses leaves stdout empty.
    """

    def __init__(self, session, prompt: str) -> None:
        self.session, self.prompt = session, prompt
        self.prompt_tokens: list[int] | None = None
        self.tokens: list[int] = []
        self.shown = ""

    def __call__(self, row: int, token: int) -> None:
        if self.prompt_tokens is None:
            self.prompt_tokens = self.session.encode(self.prompt)
            click.echo(self.prompt, nl=False)
        self.tokens.append(token)
        text = continuation_text(self.session.decode, self.prompt_tokens, self.tokens)
        click.echo(text[len(self.shown):], nl=False)
        self.shown = text

    def close(self) -> None:
        """End the line (the prompt alone when no token came)."""
        click.echo(self.prompt if self.prompt_tokens is None else "")


@cli.command()
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="Built-in name (smollm2), a Hugging Face model directory, or a .gguf file.")
@click.option("--prompt", default=None, help="Prompt text (default: a built-in ~130-token story opening).")
@click.option("--max-new-tokens", type=click.IntRange(2), default=64, show_default=True,
              help="Tokens generated per scheme.")
@click.option("--repetition-penalty", type=FiniteFloat(0.01, 100), default=None,
              help="Greedy decoding's repetition penalty (default: the demo's, 1.3).")
@click.option("--work-dir", "workdir", type=click.Path(file_okay=False), default=None, callback=outside_exports,
              help="Where the exports live (default: the kvq cache directory).")
@deprecated_alias("--workdir", "--work-dir", "workdir", type=click.Path(file_okay=False))
@device_option()
@calibration_options()
def demo(model_spec, prompt, max_new_tokens, repetition_penalty, workdir, providers, calibration) -> None:
    """fp16 baseline, the most accurate <= 5-bit cache, the ort-gqa fast path and the deployer's int4-weight export.

    Each is fed the baseline's continuation (top-1 agreement and KL, as kvq validate scores them) and continues the
    prompt greedily; the demo ends with the kvq serve line of the deployer's export.
    """
    import dataclasses

    from rich.markup import escape
    from rich.table import Table

    console = make_console()
    prompt = prompt or DEMO_PROMPT
    sampling = DEMO_SAMPLING if repetition_penalty is None else dataclasses.replace(
        DEMO_SAMPLING, repetition_penalty=repetition_penalty)
    result = run_demo(model_spec, prompt, max_new_tokens, workdir, sampling, calibration=calibration,
                      providers=providers)
    rows, base = result.rows, result.rows[0]
    where = choose_providers(providers)[0].removesuffix("ExecutionProvider")
    console.print(f"[bold]prompt[/bold] ({base.prompt_tokens} tokens): {escape(prompt)}")
    console.print(f"greedy, repetition penalty {sampling.repetition_penalty:g}, {max_new_tokens} new tokens, "
                  f"ONNX Runtime on this machine's {where}; {DEPARTS} marks where a text first departs from the "
                  "text of the run it is measured against\n")
    for r in rows:
        text = escape(r.text.strip()) if r.departs is None else (
            f"{escape(r.shared.lstrip())}[bold red]{DEPARTS}[/bold red]{escape(r.text[len(r.shared):].rstrip())}")
        console.print(f"[bold]{escape(r.role)}[/bold] — {escape(r.scheme)} ({r.flavor}, {r.weights} weights): {text}\n")
    table = Table(title=f"{model_spec}: the baseline's {base.predictions} tokens fed to every export; top-1 and KL "
                        "against the fp16 cache on the same weights")
    for col in TABLE_COLUMNS:
        table.add_column(col, justify="left" if col in ("", "scheme (flavor)", "weights", "against") else "right")
    for r in rows:
        own = r.against == r.role
        departs = "-" if own else "never" if r.departs is None else f"token {r.departs + 1}"
        table.add_row(escape(r.role), escape(f"{r.scheme} ({r.flavor})"), r.weights,
                      f"{r.directory_bytes / 1e6:.0f} MB", f"{r.bits_per_element:.2f}",
                      "-" if own else escape(r.against),
                      "-" if own else f"{r.top1:.3f}", "-" if own else f"{r.kl:.2g}", departs, f"{r.decode_ms:.1f}",
                      f"{r.decode_ratio:.2f}")
    console.print(table)
    last = rows[-1]
    if result.combined_top1 is not None:
        console.print(f"{escape(last.role)} against the {escape(base.role)} (its weights' and its cache's error "
                      f"together): top-1 {result.combined_top1:.3f}, KL {result.combined_kl:.2g}")
    if result.long_range is not None:
        console.print(escape(long_range_line(last.role, last.against, result.long_range)))
    console.print(f"\n[bold]serve the {escape(last.role)}[/bold] (an OpenAI-compatible API; the curl line from a "
                  "second shell):")
    first_sentence = prompt.split(". ")[0].rstrip(".") + "."
    for line in serve_lines(last.directory, first_sentence, max_new_tokens):
        console.print(f"  {escape(line)}", soft_wrap=True, highlight=False)


@cli.command()
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (127.0.0.1: this machine).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 picks a free port.")
@click.option("--model-name", default=None, help="The `model` clients name (default: the export directory's name).")
@click.option("--backend", type=click.Choice(["auto", "batch", "session"]), default="auto", show_default=True,
              help="batch: continuous batching over the cache's rows (ort-gqa exports); session: kvq's loop, one "
                   "request at a time (every flavor); auto: batch where the export allows it.")
@click.option("--max-seqs", type=click.IntRange(1), default=None,
              help="At most this many sequences generating at once [default: as many as --cache-budget holds; alone: "
                   "a budget of that many --context rows].")
@click.option("--cache-budget", type=ByteSize(), default=None,
              help="Bytes of KV cache, e.g. 2GiB: each sequence holds rows in proportion to its tokens, and a request "
                   "waits while the budget is full [default: 2GiB unless --max-seqs is given].")
@click.option("--context", type=click.IntRange(2), default=None,
              help="Tokens one request may hold, prompt plus generated [default: the export's positions].")
@click.option("--prefill-chunk", type=click.IntRange(1), default=256, show_default=True,
              help="Prompt tokens per call and per scheduling round: a long prompt is prefilled in chunks between "
                   "decode steps.")
@click.option("--fixed-rows", is_flag=True,
              help="Give every sequence a row of the whole --context from its start, instead of rows in proportion "
                   "to its tokens that grow with it (fewer sequences fit the budget; nothing is moved or preempted).")
@click.option("--row-classes", is_flag=True,
              help="Hold sequences in rows of several capacities (256, 384, 512, ... tokens), moved to a larger row as "
                   "they grow, instead of rows of the whole --context whose memory the system commits page by page "
                   "(the default on a CPU where a row's head rows are whole pages).")
@click.option("--no-prefix-cache", is_flag=True,
              help="Do not keep cache rows after their request to reuse prompt prefixes (reuse never changes an "
                   "answer: every call attends over the stored codes).")
@click.option("--max-waiting", type=click.IntRange(0), default=256, show_default=True,
              help="Requests waiting for a row beyond those running; more get 429 with Retry-After.")
@click.option("--request-timeout", type=FiniteFloat(0.0, min_open=True), default=None,
              help="Seconds from arrival a request may take before it ends with 504 [default: no deadline].")
@click.option("--api-key", envvar="KVQ_API_KEY", default=None, show_envvar=True,
              help="Bearer token the /v1 endpoints require (401 otherwise); never logged.")
@click.option("--allow-batch-variance", is_flag=True,
              help="Batch decode steps even where the start-up self-check finds a row's logits in a batch differ from "
                   "alone (answers may then depend on the load); without it such a CPU decodes row by row.")
@click.option("--shutdown-timeout", type=NON_NEGATIVE, default=10.0, show_default=True,
              help="Seconds in-flight requests may finish after SIGINT/SIGTERM before they are cancelled.")
@device_option()
@click.option("--no-verify", "no_verify", is_flag=True,
              help="Skip checking the weight files against the checksums in kvq.json (faster on trusted storage).")
def serve(export_dir, host, port, model_name, backend, max_seqs, cache_budget, context, prefill_chunk, fixed_rows,
          row_classes, no_prefix_cache, max_waiting, request_timeout, api_key, allow_batch_variance, shutdown_timeout,
          providers, no_verify) -> None:
    """Serve an export over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics).

    EXPORT_DIR: a kvq export directory.
    """
    from kvq_export.serve import serve as run_server  # lazy: imports fastapi
    from kvq_export.serve.backends import ServeLimits

    logging.getLogger("kvq_export.serve").setLevel(min(logging.getLogger().getEffectiveLevel(), logging.INFO))
    logging.getLogger("kvq_export.runtime.rows").setLevel(min(logging.getLogger().getEffectiveLevel(), logging.INFO))
    limits = ServeLimits(max_waiting=max_waiting, request_timeout=request_timeout, context=context)
    batch = dict(max_seqs=max_seqs, cache_budget=cache_budget, prefill_chunk=prefill_chunk,
                 allow_batch_variance=allow_batch_variance, prefix_cache=not no_prefix_cache, fixed_rows=fixed_rows,
                 row_classes=row_classes) if backend != "session" else {}
    run_server(export_dir, host=host, port=port, model_name=model_name, backend=backend,
               verify_weights=not no_verify, shutdown_timeout=shutdown_timeout, providers=providers,
               api_key=api_key, limits=limits, **batch)
