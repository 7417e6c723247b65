"""The deployer's comparison: each runtime's 4-bit weights side by side, with and without a quantized cache.

kvq ``--flavor ort-gqa`` with int4 weights (unquantized buffer, :data:`DEPLOY_INT8` caches, the ≤ 5-bit plan
:data:`DEPLOY_PLAN`), onnxruntime-genai's builder at ``-p int4`` (fp32 cache, ``int8_per_channel`` on kvq's scale
file) and llama.cpp on the GGUF: decode steps per context and prefill interleaved in one process at batch 1, file
and cache bytes, Δppl on protocol P against each engine's own unquantized cache, and the accuracy targets met or
missed (:func:`deploy_targets`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from kvq_export.errors import KVQError
from kvq_export.peer_compare.genai import GENAI_SCHEMES, genai_engines, measure_engines, require_genai
from kvq_export.peer_compare.llama import LlamaCppRunner, gguf_file_type, import_llama_cpp, llama_cpp_counterpart
from kvq_export.peer_compare.rows import Row, delta_pct
from kvq_export.peer_compare.runs import gguf_path, protocol_text

#: kvq's fast-path plan (≤ 5 bits/element at 4096 tokens) beside its int8 cache
DEPLOY_PLAN = Path(__file__).resolve().parents[2] / "models" / "smollm2-plan-gqa-5-hc.json"
DEPLOY_LLAMA_CACHES = ("q8_0", "q4_0")
#: kvq's int8 caches beside the builder's: ``ort-int8`` its exact twin (symmetric, the same scales), ``ort-int8-asymv``
#: what only kvq's graph gives the node (values with zero points, added back after attention)
DEPLOY_INT8 = ("ort-int8", "ort-int8-asymv")
#: the plan's targets on protocol P: Δppl at most PLAN_DELTA_PCT % within PLAN_BITS bits/element at 4096 tokens
PLAN_DELTA_PCT, PLAN_BITS = 1.0, 5.0


def run_deploy(model: str, p_windows: list[list[int]], contexts: Sequence[int], steps: int, work: Path,
               threads: int | None = 2, ppl: bool = True, llama_caches: Sequence[str] = DEPLOY_LLAMA_CACHES,
               plans: Sequence[str] = (str(DEPLOY_PLAN),), ppl_engines: Sequence[str] | None = None,
               timed_engines: Sequence[str] | None = None,
               on_update: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """What a deployer weighs, side by side: each runtime's 4-bit weights, with and without a quantized cache.

    kvq ``--flavor ort-gqa`` with int4 weights (fp32 buffer, the :data:`DEPLOY_INT8` caches, ``plans``),
    onnxruntime-genai's builder at ``-p int4`` (fp32 cache, ``int8_per_channel`` on kvq's scale file) and llama.cpp
    on the model's GGUF (f16 cache and ``llama_caches``; ``threads`` threads, flash attention), all timed interleaved
    at batch 1 in one process and scored on protocol P against their own unquantized cache.
    """
    require_genai()
    gguf = gguf_path(model) if llama_caches else None
    if llama_caches and gguf is None:
        raise KVQError(f"llama.cpp rows need a GGUF model, and --model {model} is not one")
    if llama_caches:
        import_llama_cpp()  # before the long builds: a missing peer is a one-line error, not a late one
    engines = genai_engines(model, work, None, "int4", "int4", ("int8_per_channel",), own_scales=False,
                            spin_twins=False,  # ort-int8 comes with the builder's int8_per_channel twin
                            kvq_schemes=(*(s for s in DEPLOY_INT8 if s not in GENAI_SCHEMES.values()), *plans))
    for cache in ("f16", *(c for c in llama_caches if c != "f16")) if llama_caches else ():
        row = Row("llama.cpp", cache, llama_cpp_counterpart(cache), weights=f"{gguf_file_type(gguf)} (GGUF)",
                  dir_bytes=gguf.stat().st_size)
        engines.add(f"llama.cpp {cache}", row, lambda c=cache: LlamaCppRunner(gguf, c, threads))
    return measure_engines(engines, p_windows, contexts, steps, protocol_text(model, list(contexts)), ppl,
                           ppl_engines, timed_engines, on_update=on_update)


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, or ``-`` when it was not measured."""
    return "-" if value is None else format(value, spec)


def _fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}%"


def _deploy_reference(rows: list[Row]) -> Row | None:
    """The row the deployer's ratios divide by: the builder's int8 cache (int4 weights, its CPU default)."""
    return next((r for r in rows if r.engine == "genai builder" and r.kvq_counterpart == "ort-int8"), None)


def _ratio(value: float | None, base: float | None) -> str:
    return "" if value is None or not base else f" ({value / base:.2f}×)"


def deploy_table(rows: list[Row], contexts: Sequence[int]) -> tuple[list[str], list[list[str]]]:
    """The deployer's table: column names and cells, one row per engine and cache.

    Decode steps and prefill rates are shown as measured and as a ratio to the builder's int8 cache row (step
    ``× builder`` < 1: faster; prefill > 1: faster); Δppl against each engine's own unquantized cache.
    """
    ref = _deploy_reference(rows)
    # cache bytes at the longest context any row was timed at (a run may stop before the longest asked for)
    last = max((c for r in rows for c in (r.cache_bytes_at or {})), default=max(contexts, default=None))
    header = ["engine", "weights", "cache", "bits/elem @4096", "files MB", f"cache MB @{last}",
              *[f"prefill tok/s @{c} (× builder int8)" for c in contexts],
              *[f"step ms @{c} (× builder int8)" for c in contexts], "ppl on P", "Δppl vs own unquantized cache"]
    ref_steps = (ref.decode_ms_at or {}) if ref else {}
    ref_prefills = (ref.prefill_tok_s_at or {}) if ref else {}
    cells = []
    for r in rows:
        steps, prefills = r.decode_ms_at or {}, r.prefill_tok_s_at or {}
        pct = delta_pct(r)
        cells.append([r.engine, r.weights, r.cache, fmt(r.bits_4096, ".3f"),
                      fmt(r.dir_bytes and r.dir_bytes / 1e6, ".1f"),
                      fmt((r.cache_bytes_at or {}).get(last) and r.cache_bytes_at[last] / 1e6, ".1f"),
                      *[fmt(prefills.get(c), ".0f") + _ratio(prefills.get(c), ref_prefills.get(c)) for c in contexts],
                      *[fmt(steps.get(c), ".2f") + _ratio(steps.get(c), ref_steps.get(c)) for c in contexts],
                      fmt(r.ppl, ".4f"), "-" if pct is None else f"{r.ppl_delta:+.4f} ({pct:+.2f}%)"])
    return header, cells


def markdown_table(header: list[str], cells: list[list[str]]) -> str:
    """A GitHub markdown table (``|`` in a cell escaped)."""
    def line(values: list[str]) -> str:
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *(line(c) for c in cells)])


def deploy_markdown(rows: list[Row], contexts: Sequence[int], runs: Sequence[tuple[str, Sequence[float]]]) -> str:
    """The deployer's table and targets as markdown, after each command that measured it and the load it ran at."""
    header, cells = deploy_table(rows, contexts)
    said = [f"`{command}` (1-minute load average {min(loads):g}–{max(loads):g} while it ran)" if loads
            else f"`{command}`" for command, loads in runs]
    return ("\n".join(said) + f"\n\n{markdown_table(header, cells)}\n\n"
            + "\n".join(f"- {line}" for line in deploy_targets(rows)) + "\n")


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else "met" if ok else "missed"


def deploy_targets(rows: list[Row]) -> list[str]:
    """The deployer's accuracy targets on protocol P, each ``met`` / ``missed`` / ``not measured`` with its numbers.

    kvq's int8 cache must lose no more than the builder's int8 cache against their own unquantized caches, and
    each plan row (bits known) at most PLAN_DELTA_PCT % within PLAN_BITS bits/element at 4096 tokens.
    """
    ref = _deploy_reference(rows)
    b = delta_pct(ref) if ref else None
    lines = []
    for name in DEPLOY_INT8:
        kvq8 = next((r for r in rows if r.engine == "kvq ort-gqa" and r.kvq_counterpart == name), None)
        a = delta_pct(kvq8) if kvq8 else None
        lines.append(f"kvq {name} Δppl {_fmt_pct(a)} ≤ builder int8_per_channel Δppl {_fmt_pct(b)}: "
                     f"{_verdict(None if a is None or b is None else a <= b)}")
    for r in rows:
        if r.engine == "kvq ort-gqa" and r.kvq_counterpart not in (*DEPLOY_INT8, "fp32-cache") and r.bits_4096:
            pct = delta_pct(r)
            ok = None if pct is None else pct <= PLAN_DELTA_PCT and r.bits_4096 <= PLAN_BITS
            lines.append(f"kvq {r.kvq_counterpart} Δppl {_fmt_pct(pct)} ≤ +{PLAN_DELTA_PCT:g}% at {r.bits_4096:.3f} "
                         f"≤ {PLAN_BITS:g} bits/elem: {_verdict(ok)}")
    return lines
