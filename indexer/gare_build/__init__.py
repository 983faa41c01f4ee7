"""The index builder (`gare-index`): discover, encode and write index versions; tune stage 1; fit NCL biases and
InvGC; compare configurations.

Commands: ``cli`` (and its parser ``cli_parser``) -> ``build`` (build/add/remove/biases, stages in ``pipeline``),
``tuning`` (stage-1 tuning; ``gare-index tune``), ``upgrade``, ``compare`` (+ ``compare_report``). Concepts:
``discover`` (clips), ``work`` (resumable shards), ``distributed`` (the Dask cluster), ``invgc`` (InvGC),
``query_bank`` (served-query banks), ``served_biases`` (biases fitted to the served score).
"""
