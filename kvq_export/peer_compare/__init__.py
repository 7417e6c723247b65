"""kvq beside its peers on the same token ids, scored on protocol P and timed in one interleaved loop.

The peers: llama.cpp's cache types, transformers' quantized caches and onnxruntime-genai's model builder;
``tools/peer_compare.py`` is the command line.

It sits above :mod:`kvq_export.measure` (the runners, the timing loop and the synthetic cache it uses) and
:mod:`kvq_export.bench` (whose runs it compares): :mod:`~kvq_export.peer_compare.compare` (settings, the run and its
tables), :mod:`~kvq_export.peer_compare.runs` (kvq's and transformers' rows), :mod:`~kvq_export.peer_compare.llama`
(llama.cpp), :mod:`~kvq_export.peer_compare.genai` (the builder's exports), :mod:`~kvq_export.peer_compare.deploy`
(the deployer's comparison) and :mod:`~kvq_export.peer_compare.rows` (one row of results).
"""
