"""The benchmarks: run each from the repository root as ``python -m bench.NAME`` (``--help`` for its options,
``--render`` to rewrite its report from the saved JSON); bench/harness.py records each run, ``python -m bench.stale``
lists the reports that no longer describe the code."""
