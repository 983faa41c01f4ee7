"""A query's answer has the same bits alone as in a batch, and whatever batch first met it.

The service folds a micro-batch's queries together and keeps each query's fold (gare.psi_fold_queries.QueryFoldCache);
a fold that rounded a row by its batch would give a query other psi scores after a batch met it than in a fresh
process that meets it alone (the engine-versus-in-process comparisons of test_serve_engine and test_shared_engine
failed in CI that way, in a score's last bit). Each side runs in a fresh interpreter at one thread count.
"""

from __future__ import annotations

from tests.service.support import answers_in_a_fresh_process, settings

HANG_S = 600  # a fresh interpreter loads torch, the model and the kernels on a busy 2-core machine


def _hits(body: dict) -> list[tuple]:
    return [(h["id"], h["score"], h["ann_score"], h["psi_score"], h["bias"]) for h in body["results"]]


def test_a_query_scores_the_same_bits_alone_or_in_a_batch(service_env):
    s = settings(service_env["index"], device="cpu", index_poll_s=0, recall_sample_rate=0, torch_threads=1)
    texts = service_env["captions"][:6]
    alone = [("/v1/search", {"json": {"query": q, "k": 5}}) for q in texts]
    batch = [("/v1/search/batch", {"json": {"queries": texts, "k": 5}})]
    fresh = answers_in_a_fresh_process(s, alone, HANG_S)  # each query met alone first
    after = answers_in_a_fresh_process(s, batch + alone, HANG_S)  # each query met in a batch of 6 first
    in_batch, again = after[0]["results"], after[1:]
    assert [r["batch_size"] for r in in_batch] == [6] * 6
    for want, b, a in zip(fresh, in_batch, again, strict=True):
        assert len(_hits(want)) == 5
        assert _hits(b) == _hits(want)  # in the batch: the bits it has alone
        assert _hits(a) == _hits(want)  # alone after the batch (its fold kept from the batch): the same bits
