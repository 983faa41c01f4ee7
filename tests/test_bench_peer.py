"""bench.peer_clip_retrieval's recall matching: the exact top-10, recall@10, and the peer's matched efSearch.

The report's claims rest on these: each server is scored against its own exact answer, and the peer's matched
efSearch is the smallest that reaches gare-serve's recall, written into the copy of the index it then serves.
"""

from __future__ import annotations

import faiss
import numpy as np

from bench import peer_clip_retrieval as peer


def test_top10_is_the_ten_best_in_order():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((7, 500)).astype(np.float32)
    assert np.array_equal(peer.top10(s), np.argsort(-s, axis=1, kind="stable")[:, :10])


def test_recall_at_10_counts_the_exact_answers_found():
    exact = [list(range(10)), list(range(10, 20))]
    got = [[0, 1, 2, 3, 4, 5, 6, 7, 8, 99], list(range(20, 30))]  # 9 of 10, then 0 of 10
    assert peer.recall_at_10(got, exact) == 0.45
    assert peer.recall_at_10(exact, exact) == 1.0


def test_the_matched_ef_is_the_smallest_reaching_the_target_and_the_copy_serves_it(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3000, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = rng.standard_normal((40, 32)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    index = faiss.IndexHNSWFlat(32, 8, faiss.METRIC_INNER_PRODUCT)  # few links: recall rises visibly with efSearch
    index.add(x)
    index.hnsw.efSearch = 400  # the file's own ("autofaiss's") setting
    (tmp_path / "peer_index" / "metadata").mkdir(parents=True)
    faiss.write_index(index, str(tmp_path / "peer_index" / "image.index"))
    np.save(tmp_path / "peer_queries.npy", q)
    exact = peer.top10(q @ x.T).tolist()

    def recall(ef: int) -> float:
        index.hnsw.efSearch = ef
        return peer.recall_at_10(index.search(q, 10)[1].tolist(), exact)

    target = recall(24)
    assert target < recall(400)  # the test means something: a smaller efSearch loses recall here
    got = peer.choose_ef(tmp_path, exact, target)
    m = got["matched_ef"]
    assert got["reached"] and got["default_ef"] == 400 and got["default_recall"] == recall(400)
    assert got["matched_recall"] == recall(m) >= target
    assert m <= 24 and recall(m - 1) < target  # the smallest: one less misses the target
    served = faiss.read_index(str(tmp_path / "peer_index_matched" / "image.index"))
    assert faiss.downcast_index(served).hnsw.efSearch == m  # what clip-retrieval loads
    assert (tmp_path / "peer_index_matched" / "metadata").resolve() == (tmp_path / "peer_index" / "metadata").resolve()
