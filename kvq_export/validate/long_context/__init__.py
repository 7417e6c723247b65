"""``kvq validate --long-context``: an export against its fp16-cache baseline where a quantized cache matters most.

:mod:`.tasks` (the registered retrieval generators), :mod:`.retrieval` (running trials, sharing a prefill),
:mod:`.distance` (perplexity by position), :mod:`.result` and :mod:`.gates` (what is read from them), :mod:`.report`
(tables, heat map, HTML) and :mod:`.runner` (:func:`~.runner.validate_long_context`, which composes them).
"""
