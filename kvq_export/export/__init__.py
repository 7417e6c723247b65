"""The export pipeline: an :class:`~kvq_export.request.ExportRequest` -> a deployable export directory.

* :mod:`kvq_export.export.exporter` -- ``export()`` and the other entry points; the directory it writes;
* :mod:`kvq_export.export.stages` -- the stages, from loading the model to packaging its files;
* :mod:`kvq_export.export.budget` -- the scheme planned under a bit budget (``kvq export --budget``);
* :mod:`kvq_export.export.decoder` -- the model body; the flavour's KV cache is plugged in through ``CacheGraph``.

The graph toolkit is :mod:`kvq_export.graph`, the flavours :mod:`kvq_export.flavors`, the architectures
:mod:`kvq_export.arch`.
"""
