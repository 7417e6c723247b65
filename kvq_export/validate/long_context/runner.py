"""``validate_long_context()``: an export against its fp16-cache baseline where a quantized cache matters most.

Short windows understate a cache's error: it grows with the distance attention reaches back over, and
retrieval fails before perplexity moves. Two measures, each on the export and on its baseline (the same model,
flavour and weights with an fp16 cache, as ``kvq validate`` resolves it):

* perplexity by distance (:mod:`.distance`): corpus windows up to the export's positions, grouped by position;
* retrieval (:mod:`.tasks`, :mod:`.retrieval`): a grid of task x length x depth x trial, the baseline first; the
  cells it fails are kept but left out of the pass rate (:mod:`.result`).

Every case comes from ``config.seed`` alone, so a run is reproduced by its config.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvq_export.corpus import load_corpus, token_windows
from kvq_export.errors import KVQError
from kvq_export.measure.cpu import cpu_name
from kvq_export.progress import task as progress_task
from kvq_export.runtime.session import KVQSession
from kvq_export.validate.long_context.config import LongContextConfig
from kvq_export.validate.long_context.distance import group_scores, score_window
from kvq_export.validate.long_context.result import LongContextResult, RetrievalResult, TrialResult
from kvq_export.validate.long_context.retrieval import Outcome, TrialRunner, run_trials
from kvq_export.validate.long_context.tasks import Case, build_case, get_task, trial_rng
from kvq_export.validate.result import weights_label
from kvq_export.validate.runner import check_same_model, check_same_weights, export_weights, resolve_baseline

logger = logging.getLogger(__name__)


def make_cases(session: KVQSession, config: LongContextConfig) -> list[Case]:
    """The grid's prompts, tokenized with the export's tokenizer: task x length x trial x depth, from the seed."""
    tokenizer = session.tokenizer
    prefix = list(tokenizer("")["input_ids"])  # what the tokenizer puts before any text (a BOS, or nothing)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    cases = []
    for name in config.tasks:
        for length in config.lengths:
            for trial in range(config.trials):
                for depth in config.depth_values:
                    cases.append(build_case(get_task(name), encode, prefix, length=length, depth=depth, trial=trial,
                                            rng=trial_rng(config.seed, name, length, trial)))
    return cases


def validate_long_context(export_dir: str | os.PathLike[str], baseline_dir: str | os.PathLike[str] | None = None,
                          config: LongContextConfig | None = None, *, verify_weights: bool = True,
                          providers: Sequence[str] | None = None,
                          baseline_from: LongContextResult | None = None) -> LongContextResult:
    """Run the retrieval grid (the baseline first) and the distance windows; return every number.

    ``baseline_from``: an earlier result against the same baseline directory with the same config, whose baseline
    trials are taken instead of run again (several exports of one model against one baseline); anything else is
    refused. Progress is reported through :mod:`kvq_export.progress` (the CLI shows it as a bar).
    """
    start = time.perf_counter()
    open_args = dict(verify_weights=verify_weights, providers=providers)
    quant = KVQSession(export_dir, last_logits=True, **open_args)
    config = (config or LongContextConfig()).for_(quant.max_positions)
    weights = export_weights(export_dir)
    base_dir = resolve_baseline(quant.manifest, baseline_dir, weights)
    base = KVQSession(base_dir, last_logits=True, **open_args)
    check_same_model(quant.manifest, base.manifest, export_dir, base_dir)
    check_same_weights(weights, export_weights(base_dir), export_dir, base_dir)
    cases = make_cases(quant, config)
    outcomes = {}
    if baseline_from is not None:
        outcomes["baseline"] = _earlier_baseline(baseline_from, base_dir, config, cases)
    for name, session in (("baseline", base), ("export", quant)):  # the baseline first: its misses mark cells
        if name in outcomes:
            continue
        with progress_task(f"retrieval: {name}", total=sum(len(c.prompt) for c in cases)) as advance:
            runner = TrialRunner(session, chunk=config.chunk, decode=quant.decode, advance=advance)
            outcomes[name] = run_trials(runner, cases)
    trials = tuple(TrialResult(c.task, c.length, c.depth, c.trial, c.answer_text, b.hit, q.hit, b.logprob,
                               q.logprob, b.said, q.said)
                   for c, b, q in zip(cases, outcomes["baseline"], outcomes["export"]))
    manifest, base_manifest = quant.manifest, base.manifest
    del quant, base  # the distance windows need every position's logits: other sessions of the same graphs
    distance = _distance(Path(export_dir), Path(base_dir), config, providers)
    return LongContextResult(
        export=str(export_dir), baseline=str(base_dir), scheme=manifest.scheme, baseline_scheme=base_manifest.scheme,
        flavor=manifest.flavor, weights=weights_label(weights), cpu=cpu_name(), config=config, distance=distance,
        retrieval=RetrievalResult(trials), seconds=round(time.perf_counter() - start, 1))


def _earlier_baseline(earlier: LongContextResult, base_dir, config: LongContextConfig,
                      cases: Sequence[Case]) -> list[Outcome]:
    """The baseline's outcomes of ``earlier``, refused unless it ran this baseline on these very cases."""
    trials = earlier.retrieval.trials
    same = (Path(earlier.baseline).resolve() == Path(base_dir).resolve() and earlier.config == config
            and [(t.task, t.length, t.depth, t.trial, t.answer) for t in trials]
            == [(c.task, c.length, c.depth, c.trial, c.answer_text) for c in cases])
    if not same:
        raise KVQError(f"the earlier result ran baseline {earlier.baseline} on another grid or config; "
                       f"allowed: a result of {base_dir} with the same config")
    return [Outcome(t.baseline_hit, t.baseline_logprob, t.baseline_said) for t in trials]


def _distance(export_dir: Path, base_dir: Path, config: LongContextConfig, providers: Sequence[str] | None):
    """Perplexity, KL and top-1 by position over the corpus windows (consecutive, from ``config.offset``)."""
    quant = KVQSession(export_dir, verify_weights=False, providers=providers)  # both verified when first opened
    base = KVQSession(base_dir, verify_weights=False, providers=providers, tokenizer=False)
    ids = token_windows(quant.tokenizer, load_corpus(config.corpus), 1, sum(config.ppl_windows),
                        offset=config.offset)[0]
    scores, begin = [], 0
    with progress_task("perplexity by distance", total=2 * sum(n - 1 for n in config.ppl_windows)) as advance:
        for length in config.ppl_windows:
            window = np.asarray(ids[begin:begin + length], dtype=np.int64)[None]
            scores.append(score_window(quant, base, window, config.ppl_chunk, advance))
            begin += length
    # a group counts the windows that reach it: short windows add samples at short range
    return group_scores(scores, config.groups(max(config.ppl_windows)))
