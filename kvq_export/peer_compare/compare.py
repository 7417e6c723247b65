"""Peers side by side: llama.cpp, transformers and onnxruntime-genai caches next to the kvq preset of each.

Same model (SmolLM2-135M: kvq and transformers run its fp32 weights; llama.cpp runs the GGUF file they come
from, whose *weights* are Q4_1, or with ``llama_weights="fp32"`` the same file dequantized), same text
(:func:`~kvq_export.peer_compare.runs.text_windows`), same protocol: strict-decode perplexity, and the median
single-token step at ``context`` tokens, batch 1, steps interleaved (:mod:`kvq_export.measure.timing`). Each
engine is compared with *its own* unquantized cache: ``ppl_delta`` and ``speed_ratio`` line up across engines.

The peers: ``kvq`` (:func:`~kvq_export.peer_compare.runs.run_kvq`), ``llama.cpp``
(:func:`~kvq_export.peer_compare.llama.run_llama_cpp`), ``hf`` (:func:`~kvq_export.peer_compare.runs.run_hf`), ``genai``
(:func:`~kvq_export.peer_compare.genai.run_genai`) and the deployer's comparison ``deploy``
(:func:`~kvq_export.peer_compare.deploy.run_deploy`). :func:`run_peers` runs those :class:`PeerSettings` name;
``tools/peer_compare.py`` is the command line.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvq_export.bench import PPL_OFFSET
from kvq_export.errors import KVQError
from kvq_export.peer_compare.deploy import DEPLOY_LLAMA_CACHES, DEPLOY_PLAN, deploy_markdown, fmt, run_deploy
from kvq_export.peer_compare.genai import GENAI_SCHEMES, run_genai
from kvq_export.peer_compare.llama import LLAMA_CPP_DEFAULT, LLAMA_CPP_TYPES, dequantized_gguf, run_llama_cpp
from kvq_export.peer_compare.rows import Row, merge_rows, rows_from_json
from kvq_export.peer_compare.runs import gguf_path, run_hf, run_kvq, text_windows
from kvq_export.request import DEFAULT_PERCENTILE

logger = logging.getLogger(__name__)

PEERS = ("kvq", "llama.cpp", "hf", "genai", "deploy")
#: the peers run unless named: the deployer's comparison (``deploy``) runs only when asked for
DEFAULT_PEERS = ("kvq", "llama.cpp", "hf", "genai")


def names(text: str | None) -> list[str] | None:
    """A comma list's names (None stays None)."""
    return None if text is None else [n.strip() for n in text.split(",") if n.strip()]


def ints(text: str) -> list[int]:
    return [int(n) for n in names(text) or []]


@dataclass
class PeerSettings:
    """What one comparison runs (the command line's options, by the same names; lists are comma strings)."""

    model: str = "smollm2"
    peers: str = ",".join(DEFAULT_PEERS)
    ppl_windows: int = 2
    ppl_tokens: int = 512
    ppl_offset: int | None = None  # default PPL_OFFSET; 0 with 8 x 512 is protocol P
    context: int = 1024
    steps: int = 32
    kvq_flavor: str = "reference"
    threads: int | None = None  # llama.cpp's (deploy peer: 2 unless given)
    llama_caches: str = ",".join(LLAMA_CPP_DEFAULT)
    llama_weights: str = "gguf"
    no_ppl: bool = False
    json_out: str | None = None
    genai_contexts: str = "512,2048,8192"
    genai_ppl_windows: int = 8
    genai_ppl_tokens: int = 512
    work_dir: str = "/tmp/kvq-peers"
    genai_ppl_engines: str | None = None
    genai_timed_engines: str | None = None
    deploy_contexts: str = "512,2048,8000"
    deploy_llama_caches: str = ",".join(DEPLOY_LLAMA_CACHES)
    deploy_plans: str = str(DEPLOY_PLAN)
    deploy_merge: str | None = None
    markdown: str | None = None
    genai_int4_percentile: float = DEFAULT_PERCENTILE
    genai_precision: str = "fp32"
    kvq_weights: str = "fp32"
    kvq_accuracy_level: int | None = None
    genai_schemes: str = ",".join(GENAI_SCHEMES)
    genai_no_own_scales: bool = False
    genai_batches: str = "1"
    genai_batch_max_context: int = 2048

    def check(self) -> None:
        """One-line KVQErrors for unknown peers or llama.cpp caches."""
        unknown = sorted(set(names(self.peers)) - set(PEERS))
        if unknown:
            raise KVQError(f"unknown peer(s) {', '.join(unknown)}; allowed: {', '.join(PEERS)}")
        unknown = sorted(set(names(self.llama_caches) + names(self.deploy_llama_caches)) - set(LLAMA_CPP_TYPES))
        if unknown:
            raise KVQError(f"unknown llama.cpp cache(s) {', '.join(unknown)}; allowed: {', '.join(LLAMA_CPP_TYPES)}")

    @property
    def peer_list(self) -> list[str]:
        return [] if self.deploy_merge else names(self.peers)  # a merge measures nothing


@dataclass
class PeerResults:
    """The rows of one comparison: the plain peers', the genai peer's and the deployer's."""

    rows: list[Row] = field(default_factory=list)
    genai: list[Row] = field(default_factory=list)
    deploy: list[Row] = field(default_factory=list)
    #: the 1-minute load average at every update: the machine is shared
    loads: list[float] = field(default_factory=list)

    def all_rows(self) -> list[Row]:
        return self.rows + self.genai + self.deploy


class _Saver:
    """Rewrites ``json_out`` with every row measured so far (a stopped run keeps what it measured)."""

    def __init__(self, settings: PeerSettings, command: str, results: PeerResults) -> None:
        self.settings, self.command, self.results = settings, command, results

    def __call__(self, measured: list[Row]) -> None:
        from kvq_export.validate.report import write_json

        self.results.loads.append(round(os.getloadavg()[0], 2))
        if self.settings.json_out:
            write_json({"settings": asdict(self.settings), "command": self.command,
                        "load_average_1min": self.results.loads, "rows": [asdict(r) for r in measured]},
                       self.settings.json_out)


def run_peers(settings: PeerSettings, command: str = "") -> PeerResults:
    """Run the peers ``settings`` name; the JSON file is rewritten as rows come in (``command`` is recorded)."""
    settings.check()
    results = PeerResults()
    save = _Saver(settings, command, results)
    peers = settings.peer_list
    windows = text_windows(settings.model, settings.ppl_windows, settings.ppl_tokens, settings.ppl_offset)
    if "kvq" in peers:
        results.rows += run_kvq(settings.model, windows, settings.context, settings.steps, settings.kvq_flavor,
                                not settings.no_ppl)
    if "llama.cpp" in peers:
        results.rows += _llama_cpp_rows(settings, windows)
    if "hf" in peers:
        results.rows += run_hf(settings.model, windows, settings.context, settings.steps, not settings.no_ppl)
    if "genai" in peers:
        results.genai = _genai_rows(settings, lambda measured: save(results.rows + measured))
    if settings.deploy_merge:
        results.deploy = _merged_deploy(settings)
    elif "deploy" in peers:
        results.deploy = _deploy_rows(settings, command, results, save)
    save(results.all_rows())
    return results


def _llama_cpp_rows(settings: PeerSettings, windows: list[list[int]]) -> list[Row]:
    gguf = gguf_path(settings.model)
    if gguf is None:
        return [Row("llama.cpp", "-", "-", status="unavailable: --model is not a GGUF file")]
    if settings.llama_weights == "fp32":
        # one folder per source: its stamp says which file the copy was made from
        folder = Path(settings.work_dir) / f"llama-fp32-{gguf.stem}"
        gguf = dequantized_gguf(gguf, folder / f"{gguf.stem}.F32.gguf")
    return run_llama_cpp(gguf, windows, settings.context, settings.steps, settings.threads, not settings.no_ppl,
                         names(settings.llama_caches))


def _genai_rows(settings: PeerSettings, on_update: Callable[[list[Row]], None]) -> list[Row]:
    s = settings
    p_windows = text_windows(s.model, s.genai_ppl_windows, s.genai_ppl_tokens, offset=0)
    return run_genai(s.model, p_windows, ints(s.genai_contexts), s.steps, Path(s.work_dir), not s.no_ppl,
                     s.genai_int4_percentile or None, names(s.genai_ppl_engines), names(s.genai_timed_engines),
                     precision=s.genai_precision, kvq_weights=s.kvq_weights, schemes=names(s.genai_schemes),
                     own_scales=not s.genai_no_own_scales, batches=ints(s.genai_batches),
                     batch_max_context=s.genai_batch_max_context, kvq_accuracy_level=s.kvq_accuracy_level,
                     on_update=on_update)


def _merged_deploy(settings: PeerSettings) -> list[Row]:
    """Runs that split the deploy peer's work: one table from their JSON files."""
    sources = [json.loads(Path(f).read_text()) for f in names(settings.deploy_merge)]
    rows = merge_rows([rows_from_json(data) for data in sources])
    if settings.markdown:
        Path(settings.markdown).write_text(deploy_markdown(
            rows, ints(settings.deploy_contexts),
            [(d.get("command", "?"), d.get("load_average_1min", [])) for d in sources]))
    return rows


def _deploy_rows(settings: PeerSettings, command: str, results: PeerResults, save: _Saver) -> list[Row]:
    s, contexts = settings, ints(settings.deploy_contexts)

    def progress(measured: list[Row]) -> None:
        save(results.rows + results.genai + measured)
        if s.markdown:
            Path(s.markdown).write_text(deploy_markdown(measured, contexts, [(command, results.loads)]))

    p_windows = text_windows(s.model, s.genai_ppl_windows, s.genai_ppl_tokens, offset=0)
    return run_deploy(s.model, p_windows, contexts, s.steps, Path(s.work_dir), s.threads or 2, not s.no_ppl,
                      names(s.deploy_llama_caches), names(s.deploy_plans), names(s.genai_ppl_engines),
                      names(s.genai_timed_engines), on_update=progress)


def _table(title: str, columns: list[str], left: tuple[str, ...]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


def peers_table(rows: list[Row], settings: PeerSettings) -> Any:
    """The plain peers' rich Table: perplexity, its delta against each engine's own base, decode ms and ratio."""
    s = settings
    offset = PPL_OFFSET if s.ppl_offset is None else s.ppl_offset
    table = _table(f"peers on {s.model}: strict-decode perplexity on {s.ppl_windows}x{s.ppl_tokens} britannica "
                   f"tokens from token {offset}; decode step at {s.context} tokens, batch 1"
                   + (f"; llama.cpp weights {s.llama_weights}" if "llama.cpp" in s.peer_list else ""),
                   ["engine", "cache", "kvq preset", "ppl", "Δppl vs own base", "KL", "top-1", "decode ms",
                    "x own base", "status"], ("engine", "cache", "kvq preset", "status"))
    for r in rows:
        delta = ("-" if r.ppl_delta is None
                 else f"{r.ppl_delta:+.3f} ({100 * r.ppl_delta / (r.ppl - r.ppl_delta):+.2f}%)")
        table.add_row(r.engine, r.cache, r.kvq_counterpart, fmt(r.ppl, ".3f"), delta, fmt(r.mean_kl, ".4f"),
                      fmt(r.top1, ".1%"), fmt(r.decode_ms, ".2f"), fmt(r.speed_ratio, ".2f"), r.status)
    return table


def genai_table(rows: list[Row], settings: PeerSettings) -> Any:
    """The kvq ort-gqa vs onnxruntime-genai builder table: protocol P ppl, step ms per context, prefill, bytes."""
    s = settings
    runs = sorted({(b, c) for r in rows for b, at in (r.decode_ms_batch or {}).items() for c in at})
    prefills = sorted({c for r in rows for c in (r.prefill_tok_s_at or {})})
    table = _table(f"kvq ort-gqa vs onnxruntime-genai builder on {s.model}: strict-decode perplexity on "
                   f"{s.genai_ppl_windows}x{s.genai_ppl_tokens} britannica tokens from 0; decode step "
                   f"median of {s.steps} interleaved (bN: batch N)",
                   ["engine", "cache", "weights", "dir MB", "ppl", "Δppl vs own fp32",
                    *[f"step ms @{c} b{b}" for b, c in runs], *[f"prefill tok/s @{c}" for c in prefills],
                    "cache bytes (last run)"], ("engine", "cache"))
    for r in rows:
        base = None if r.ppl_delta is None else r.ppl - r.ppl_delta
        delta = "-" if base is None else f"{r.ppl_delta:+.3f} ({100 * r.ppl_delta / base:+.2f}%)"
        table.add_row(r.engine, r.cache, r.weights, fmt(r.dir_bytes and r.dir_bytes / 1e6, ".1f"),
                      fmt(r.ppl, ".4f"), delta,
                      *[fmt((r.decode_ms_batch or {}).get(b, {}).get(c), ".2f") for b, c in runs],
                      *[fmt((r.prefill_tok_s_at or {}).get(c), ".0f") for c in prefills], fmt(r.cache_bytes, "d"))
    return table


def deploy_rich_table(rows: list[Row], settings: PeerSettings) -> Any:
    """The deployer's table (:func:`~kvq_export.peer_compare.deploy.deploy_table`) as a rich Table."""
    from kvq_export.peer_compare.deploy import deploy_table

    header, cells = deploy_table(rows, ints(settings.deploy_contexts))
    table = _table(f"the deployer's comparison on {settings.model}: int4 weights, batch 1, steps interleaved "
                   f"({settings.steps} timed); Δppl on protocol P", header, ("engine", "weights", "cache"))
    for line in cells:
        table.add_row(*line)
    return table
