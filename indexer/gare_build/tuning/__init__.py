"""Stage-1 tuning of an index: one module per concept, from the measurements up to a version's tuning.

* ``measure``  what is measured: the exact top-k (ground truth), recall of a top-K, single-query latency;
* ``queries``  the sample queries (NCL queue, manifest captions, perturbed gallery, or a served-query bank);
* ``ladder``   what the ANN tuner tries: its configuration, the index types in order and each one's knobs;
* ``recall``   the recall-target search over that ladder (``tune_ann``) and its result;
* ``coverage`` the share of the exhaustive psi top-10 inside the ANN top-K, and the default K chosen from it;
* ``version_tuning`` the tuning of an index version (recall, coverage, deviation): the manifest's ``stage1``
  entry, run by ``gare-index build`` / ``add`` (``gare_build.pipeline.finish``) and by ``gare-index tune``
  (``gare_build.retune``, a command above this package and the pipeline: it imports them, never the reverse).

Each step is done in one place (the seeded subsampling of sample queries, once written three times, is
``queries.pick_rows``); every module imports only the ones above it in this list, and nothing here imports the
build pipeline or its commands.
"""
