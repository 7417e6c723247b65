#!/usr/bin/env python
"""Peers side by side: llama.cpp's quantized KV cache and Hugging Face ``QuantizedCache`` next to kvq's presets.

Same model (SmolLM2-135M: kvq and transformers run its fp32 weights; llama.cpp runs the GGUF file they come
from, whose *weights* are Q4_1), same text (``ppl_windows`` windows of ``ppl_tokens`` tokens of the
britannica corpus from token ``kvq_export.bench.PPL_OFFSET`` on, tokenized once with the model's tokenizer
and fed to every engine as token ids), same protocol:

* **perplexity**, strict decode: every token is fed alone, so every prediction reads the stored cache;
* **decode speed**: median time of a single-token step with ``--context`` tokens in the cache, batch 1.

Each engine is compared with *its own* unquantized cache (llama.cpp f16, transformers ``DynamicCache``,
kvq ``fp16``): ``ppl_delta`` and ``speed_ratio`` (step time / baseline step time) are what line up across
engines; absolute perplexities differ because llama.cpp runs 4-bit weights. ``--llama-weights fp32`` gives llama.cpp
the same weights as the others (the GGUF with every tensor dequantized to F32,
:func:`kvq_export.peer_compare.llama.dequantized_gguf`): then its
cache types compare with kvq's like for like, and ``--ppl-windows 8 --ppl-tokens 512 --ppl-offset 0`` is
protocol P (llama.cpp rows also report KL and top-1 agreement with its own f16 cache).

Peers and the kvq preset each one lines up with:

======================  ==================================  =====================================
engine                  cache                               kvq preset
======================  ==================================  =====================================
llama.cpp (flash attn)  f16 / q8_0 / q4_0 / q4_1 (rotated)  fp16 / q8_0-rot / q4_0-rot / q4_1-rot
                        also q5_0, K q8_0 + V q4_0          q5_0-rot, k-q8_0-v-q4_0-rot
transformers            QuantizedCache quanto int4 / int2   kivi-4 / kivi-2 (per-channel, R=128)
transformers            QuantizedCache hqq int4 / int2      kivi-4 / kivi-2
transformers            QuantizedCache fp8 (per tensor)     fp8
onnxruntime-genai       builder int8/int4_per_channel       ort-int8 / ort-int4 (--flavor ort-gqa)
======================  ==================================  =====================================

The onnxruntime-genai peer (``--peers genai``, :func:`kvq_export.peer_compare.genai.run_genai`) runs the same fp32
weights in both runtimes' own loops, on protocol P (8 x 512 britannica tokens from token 0) and at several
contexts, with the builder's scales from kvq's calibration and from its own calibrator.

The deployer's comparison (``--peers deploy``, :func:`kvq_export.peer_compare.deploy.run_deploy`) puts each
runtime's 4-bit weights side by side:
kvq ``--flavor ort-gqa`` with int4 weights (unquantized buffer, ``ort-int8`` and ``ort-int8-asymv``, the ≤ 5-bit plan
``models/smollm2-plan-gqa-5-hc.json``; scales measured on the int4 weights it runs), the builder at ``-p int4`` (fp32
cache, ``int8_per_channel`` on kvq's scale file of the same int4-weight calibration) and llama.cpp on the GGUF (f16,
q8_0, q4_0 caches): decode step per context and prefill, interleaved in one process at batch 1, file and cache
bytes, and Δppl on protocol P against each engine's own unquantized cache, with the accuracy targets met or missed
(:func:`~kvq_export.peer_compare.deploy.deploy_targets`); ``--markdown`` writes the table as it fills.

Optional dependencies, none needed by kvq itself (install them in a throwaway venv, see tools/README.md):
``llama-cpp-python`` (llama.cpp), ``optimum-quanto`` (quanto backend), ``hqq`` (hqq backend). A missing
one is reported as ``unavailable`` with the reason and the rest still runs.

The comparison itself is :mod:`kvq_export.peer_compare.compare` (:func:`~kvq_export.peer_compare.compare.run_peers`);
this file is its command line.

    python tools/peer_compare.py --json peers.json          # everything available
    python tools/peer_compare.py --peers llama.cpp,kvq --context 1024 --ppl-tokens 256
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Sequence

from kvq_export.errors import KVQError
from kvq_export.peer_compare.compare import (
    PEERS,
    PeerSettings,
    deploy_rich_table,
    genai_table,
    peers_table,
    run_peers,
)
from kvq_export.peer_compare.deploy import DEPLOY_INT8, deploy_targets
from kvq_export.peer_compare.llama import LLAMA_CPP_TYPES, LLAMA_WEIGHTS

DEFAULTS = PeerSettings()


def parser() -> argparse.ArgumentParser:
    """The options, by :class:`PeerSettings`' names and defaults."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = DEFAULTS
    p.add_argument("--model", default=d.model)
    p.add_argument("--peers", default=d.peers, help=f"comma list of {', '.join(PEERS)} (default: {d.peers})")
    p.add_argument("--ppl-windows", type=int, default=d.ppl_windows)
    p.add_argument("--ppl-tokens", type=int, default=d.ppl_tokens)
    p.add_argument("--ppl-offset", type=int, default=d.ppl_offset,
                   help="corpus token the perplexity windows start at (default: kvq_export.bench.PPL_OFFSET; "
                        "0 with 8 x 512 is protocol P)")
    p.add_argument("--context", type=int, default=d.context, help="tokens in the cache for decode timing")
    p.add_argument("--steps", type=int, default=d.steps, help="timed decode steps")
    p.add_argument("--kvq-flavor", default=d.kvq_flavor)
    p.add_argument("--threads", type=int, default=d.threads, help="llama.cpp threads (deploy peer: 2 unless given)")
    p.add_argument("--llama-caches", default=d.llama_caches,
                   help=f"llama.cpp caches, comma list of {', '.join(LLAMA_CPP_TYPES)} (f16 always runs)")
    p.add_argument("--llama-weights", choices=LLAMA_WEIGHTS, default=d.llama_weights,
                   help="llama.cpp weights: the GGUF's own, or fp32 (the GGUF dequantized, the weights kvq runs; "
                        "written once to --work-dir)")
    p.add_argument("--no-ppl", action="store_true", help="decode speed only (peers' perplexity skipped)")
    p.add_argument("--json", dest="json_out", default=d.json_out, help="write the rows as JSON here")
    _genai_options(p)
    _deploy_options(p)
    return p


def _genai_options(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--genai-contexts", default=d.genai_contexts, help="genai peer: decode-step contexts")
    p.add_argument("--genai-ppl-windows", type=int, default=d.genai_ppl_windows,
                   help="genai peer: protocol P windows (britannica from token 0)")
    p.add_argument("--genai-ppl-tokens", type=int, default=d.genai_ppl_tokens)
    p.add_argument("--work-dir", default=d.work_dir,
                   help="genai exports and builds, and llama.cpp's fp32 weights, are kept here")
    p.add_argument("--genai-ppl-engines", default=None, help="genai and deploy peers: comma list of engines to score")
    p.add_argument("--genai-timed-engines", default=None,
                   help="genai and deploy peers: comma list of engines to time")
    p.add_argument("--genai-int4-percentile", type=float, default=d.genai_int4_percentile,
                   help="genai peer: also int4 with kvq percentile scales (0: skip)")
    p.add_argument("--genai-precision", choices=("fp32", "int4"), default=d.genai_precision,
                   help="genai peer: the builder's -p (its CPU default is int4)")
    p.add_argument("--kvq-weights", choices=("fp32", "fp16", "int8", "int4"), default=d.kvq_weights,
                   help="genai peer: kvq exports' weight format (kvq_export.graph.weights)")
    p.add_argument("--kvq-accuracy-level", type=int, choices=(1, 2, 3, 4), default=None,
                   help="genai peer: MatMulNBits accuracy_level of kvq's int weights (4: int8 activations, the "
                        "builder's CPU default; kvq's default is 1)")
    p.add_argument("--genai-schemes", default=d.genai_schemes,
                   help="genai peer: comma list of builder cache schemes to build")
    p.add_argument("--genai-no-own-scales", action="store_true",
                   help="genai peer: skip the builder's own calibrator (builds with kvq's scales only)")
    p.add_argument("--genai-batches", default=d.genai_batches, help="genai peer: comma list of decode batch sizes")
    p.add_argument("--genai-batch-max-context", type=int, default=d.genai_batch_max_context,
                   help="genai peer: batches over one only up to this context (og prefills a batch in one call, "
                        "and its attention scores at 4 x 8000 tokens take about 9 GB)")


def _deploy_options(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--deploy-contexts", default=d.deploy_contexts, help="deploy peer: decode-step contexts")
    p.add_argument("--deploy-llama-caches", default=d.deploy_llama_caches,
                   help="deploy peer: llama.cpp caches beside its f16 one ('' for no llama.cpp rows)")
    p.add_argument("--deploy-plans", default=d.deploy_plans,
                   help=f"deploy peer: comma list of kvq schemes or plan files beside the int8 caches "
                        f"({', '.join(DEPLOY_INT8)})")
    p.add_argument("--deploy-merge", default=None, metavar="JSON,JSON",
                   help="deploy peer: measure nothing; one table from the --json files of runs that split its "
                        "work (--genai-ppl-engines / --genai-timed-engines)")
    p.add_argument("--markdown", default=None,
                   help="deploy peer: write its table and targets as markdown here (rewritten as rows come in)")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point: run the peers, print their tables."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = PeerSettings(**vars(args))
    try:
        settings.check()
    except KVQError as err:
        parser().error(str(err))
    command = shlex.join(["python", "tools/peer_compare.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        results = run_peers(settings, command)
    except KVQError as err:
        logging.getLogger("peer_compare").error("%s", err)
        return 1
    from rich.console import Console

    if results.rows:
        Console(width=200).print(peers_table(results.rows, settings))
    if results.genai:
        Console(width=200).print(genai_table(results.genai, settings))
    if results.deploy:
        Console(width=240).print(deploy_rich_table(results.deploy, settings))
        print("\n".join(deploy_targets(results.deploy)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
