"""The plain peers: kvq's presets (through ``kvq bench``) and transformers' ``QuantizedCache`` backends.

Each is compared with its own unquantized cache (kvq ``fp16``, transformers ``DynamicCache``) on the same text
(:func:`text_windows`, tokenized once with the model's tokenizer) and the same protocol: strict-decode perplexity,
and the median single-token step at a context, steps interleaved across caches.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvq_export.bench import PPL_OFFSET, run_bench
from kvq_export.bench_config import BenchConfig
from kvq_export.corpus import load_corpus, token_windows
from kvq_export.measure.runners import KvqRunner
from kvq_export.measure.scoring import NllPool
from kvq_export.measure.timing import interleaved
from kvq_export.model_source import load_model, resolve_spec
from kvq_export.peer_compare.rows import Row, finish

logger = logging.getLogger(__name__)

KVQ_PRESETS = ("q8_0", "q4_0", "q4_1", "kivi-4", "kivi-2", "fp8")
#: transformers QuantizedCache configurations -> (backend, nbits, module it needs, kvq preset)
HF_CACHES = {"quanto-int4": ("quanto", 4, "optimum.quanto", "kivi-4"),
             "quanto-int2": ("quanto", 2, "optimum.quanto", "kivi-2"),
             "hqq-int4": ("hqq", 4, "hqq", "kivi-4"), "hqq-int2": ("hqq", 2, "hqq", "kivi-2"),
             "fp8": ("fp8", None, None, "fp8")}


def has_module(module: str | None) -> bool:
    """Whether ``module`` can be imported (None: nothing is needed)."""
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def hf_dir(model: str) -> Path:
    """The Hugging Face directory of a model spec (kvq's cached fp32 conversion for a GGUF model)."""
    from kvq_export.measure.builder import model_hf_dir

    return model_hf_dir(model)


def text_windows(model: str, n: int, length: int, offset: int | None = None) -> list[list[int]]:
    """The shared evaluation text as token ids (the model's own tokenizer), from ``offset`` (PPL_OFFSET)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir(model), local_files_only=True)
    return token_windows(tokenizer, load_corpus("britannica"), n, length,
                         offset=PPL_OFFSET if offset is None else offset)


def protocol_text(model: str, contexts: list[int]) -> list[int]:
    """The britannica tokens from token 0 that every timed engine prefills (as many as the longest context)."""
    return text_windows(model, 1, max(contexts), offset=0)[0] if contexts else []


def gguf_path(model: str) -> Path | None:
    """The GGUF file behind a model spec (the built-in smollm2 ships one), if any."""
    source = resolve_spec(model)
    return source.path if source.kind == "gguf" else None


def run_kvq(model: str, windows: list[list[int]], context: int, steps: int, flavor: str,
            ppl: bool = True) -> list[Row]:
    """Run kvq's presets on ONNX Runtime: decode speed through ``kvq bench``, strict-decode perplexity."""
    report = run_bench(BenchConfig(model, list(KVQ_PRESETS), flavors=(flavor,), contexts=(context,), batches=(1,),
                                   steps=steps, warmup=4, prefill_tokens=64, prefill_repeats=1))
    rows = []
    for result in report.results:
        row = Row("kvq " + flavor, result.scheme, result.scheme, decode_ms=result.decode_ms_median)
        if ppl:
            with KvqRunner(report.settings["exports"][flavor][result.scheme]) as runner:
                row.ppl = runner.perplexity(windows)
        rows.append(row)
        logger.info("kvq %s: %s", flavor, row)
    return finish(rows, "fp16")


def _hf_caches(config: Any) -> dict[str, Callable[[], Any] | str]:
    """Cache factories by name (``dynamic`` first), or why a backend is unavailable."""
    from transformers.cache_utils import DynamicCache, QuantizedCache

    caches: dict[str, Callable[[], Any] | str] = {"dynamic": lambda: DynamicCache(config=config)}
    for name, (backend, nbits, module, _) in HF_CACHES.items():
        if not has_module(module):
            caches[name] = f"unavailable: pip install {'optimum-quanto' if backend == 'quanto' else backend}"
            continue
        kwargs = {} if nbits is None else {"nbits": nbits}
        caches[name] = lambda backend=backend, kwargs=kwargs: QuantizedCache(backend, config, **kwargs)
    return caches


def _hf_perplexity(hf_model: Any, make: Callable[[], Any], windows: list[list[int]]) -> float:
    """Strict decode of every window on a fresh cache, NLL pooled by token."""
    import torch

    pool = NllPool()
    for window in windows:
        cache = make()
        for i in range(len(window) - 1):
            logits = hf_model(input_ids=torch.tensor([[window[i]]]), cache=cache, use_cache=True).logits
            pool.add(logits[0, -1].numpy(), [window[i + 1]])
    return pool.ppl


def run_hf(model: str, windows: list[list[int]], context: int, steps: int, ppl: bool = True) -> list[Row]:
    """Run transformers' QuantizedCache backends vs DynamicCache, in PyTorch on the fp32 model."""
    import torch

    hf_model, _ = load_model(model)
    rows, caches = {}, {}
    prompt = (windows[0] * (context // len(windows[0]) + 1))[:context]
    with torch.inference_mode():
        for name, make in _hf_caches(hf_model.config).items():
            row = rows[name] = Row("transformers", name, "fp16" if name == "dynamic" else HF_CACHES[name][3])
            if isinstance(make, str):
                row.status = make
                continue
            try:
                row.ppl = _hf_perplexity(hf_model, make, windows) if ppl else None
                caches[name] = make()
                hf_model(input_ids=torch.tensor([prompt]), cache=caches[name], use_cache=True, logits_to_keep=1)
            except Exception as err:  # noqa: BLE001 - a peer failing must not stop the others
                row.failed(err)
                caches.pop(name, None)
            logger.info("transformers %s: %s", name, row)
        if caches:
            def stepper(cache):
                return lambda i: hf_model(input_ids=torch.tensor([[prompt[i % len(prompt)]]]), cache=cache,
                                          use_cache=True)

            for name, timing in interleaved({n: stepper(c) for n, c in caches.items()}, steps, warmup=4).items():
                rows[name].decode_ms = 1e3 * timing.median
    return finish(list(rows.values()), "dynamic")
