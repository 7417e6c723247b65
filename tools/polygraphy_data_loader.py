"""Polygraphy data loader for a kvq export directory.

Usage (the export directory comes from the environment, since Polygraphy passes no arguments)::

    KVQ_EXPORT=out/smollm2-kivi4 polygraphy run out/smollm2-kivi4/model.onnx --onnxrt \\
        --data-loader-script tools/polygraphy_data_loader.py --save-inputs in.json --save-outputs a.json

It yields two feeds, both built from the manifest (names, dtypes and shapes of every cache tensor):

1. prefill: ``KVQ_PROMPT_LEN`` prompt tokens (default 48) for ``KVQ_BATCH`` rows (default 2, the
   second left-padded by a quarter of the length) with an empty cache;
2. decode: one new token per row with the cache this export itself produced for that prompt
   (prefilled here on ONNX Runtime), so each export is fed its own stored cache.

Token ids are drawn from a fixed seed (``KVQ_SEED``, default 0), so two exports of the same model get the
same tokens and their ``logits`` outputs can be compared. Float8 caches cannot be fed through
ONNX Runtime's numpy path that ``polygraphy run`` uses; compare those with ``kvq compare``.
"""

from __future__ import annotations

import os


def load_data():
    """Yield the prefill and decode feeds for ``$KVQ_EXPORT``."""
    from kvq_export.validate.feeds import polygraphy_feeds  # lazy: kvq loads only when Polygraphy asks for data

    directory = os.environ.get("KVQ_EXPORT")
    if not directory:
        raise SystemExit("set KVQ_EXPORT to the kvq export directory whose model.onnx is being run")
    yield from polygraphy_feeds(
        directory,
        prompt_len=int(os.environ.get("KVQ_PROMPT_LEN", "48")),
        batch=int(os.environ.get("KVQ_BATCH", "2")),
        seed=int(os.environ.get("KVQ_SEED", "0")),
    )
