"""The device-resident index (gare_index.resident, gare_index.resident_version) on the CPU: the exact stage 1
against a numpy brute force (one device and the gallery split over two), the search over a ResidentVersion
against the plain version's, a rerank that reads no host row, the memory cap and the measured choice of stage 1.
The same equalities on CUDA: tests/indexer/test_resident_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gare_index import psi_consts
from gare_index.resident import ResidentTooLarge, check_fits, estimate, split_rows
from gare_index.resident_version import STAGE1_METHODS, ResidentVersion, decide, load_resident
from gare_index.store import open_index
from gare_search import rerank as R
from gare_search.search import SearchOptions, search_batch
from tests.indexer.resident_support import (
    D,
    N,
    boundary_tie,
    brute_force,
    make_unreadable,
    queries,
    tie_rows,
    tiny_model,
    write_gallery,
)

DEVICE_SETS = [["cpu"], ["cpu", "cpu"]]


@pytest.fixture(autouse=True)
def torch_pair_stage(monkeypatch):
    """Both paths score pairs with the torch ops the CUDA rerank runs (not the compiled CPU kernel, whose first
    compile per frame dtype takes tens of seconds; tests/indexer/test_psi_consts.py compares the two)."""
    from gare import psi_fold_cpu

    monkeypatch.setattr(psi_fold_cpu, "_AVAILABLE", False)


@pytest.fixture(scope="module")
def gallery(tmp_path_factory):
    model = tiny_model()
    root = write_gallery(tmp_path_factory.mktemp("resident"), model)
    return model, root


@pytest.fixture(scope="module")
def int8_gallery(tmp_path_factory, gallery):
    model, _ = gallery
    return write_gallery(tmp_path_factory.mktemp("resident8"), model, frame_dtype="int8")


def test_split_rows_is_contiguous_and_even():
    assert split_rows(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert split_rows(2, 3) == [(0, 0), (0, 1), (1, 2)]
    with pytest.raises(ValueError, match="parts must be >= 1, got 0"):
        split_rows(5, 0)


@pytest.mark.parametrize("devices", DEVICE_SETS, ids=["one", "split"])
@pytest.mark.parametrize("ncl", [False, True], ids=["cos", "cos+b"])
def test_exact_stage1_equals_a_numpy_brute_force(gallery, devices, ncl):
    model, root = gallery
    with open_index(root) as v:
        rv = load_resident(v, model, k=5, devices=devices, method="exact")
        assert [str(d) for d in rv.resident.devices] == devices
        if len(devices) == 2:  # the tied rows of one axis lie in both halves: the merge decides between devices
            assert rv.resident.shards[0].stop == N // 2 and tie_rows()[0] < N // 2 < tie_rows()[-1]
        q = queries()
        for k in (5, 17, N + 7):
            if k == 5:  # the data holds a tie across the k-th place (else the tie rule is untested)
                assert boundary_tie(v.stage1_units, v.biases, q, k, ncl=ncl)
            want_s, want_i = brute_force(v.stage1_units, v.biases, v.ids, q, k, ncl=ncl)
            got_s, got_i = rv.search(q, k, ncl_stage1=ncl)
            assert got_s.dtype == np.float32 and got_i.dtype == np.int64 and got_i.shape == (q.shape[0], k)
            np.testing.assert_array_equal(got_i, want_i)
            np.testing.assert_allclose(got_s, want_s, atol=1e-6, rtol=0)
        # ties by id: the query near e_0 gets the smallest ids of its tied rows, in id order
        _, top = rv.search(q[-3:-2], 5, ncl_stage1=ncl)
        assert top[0].tolist() == v.ids[tie_rows()[::3][:5]].tolist()
        # the cosines of the NCL stage 1 are the plain ones (rank() adds b once)
        s_ncl, i_ncl = rv.search(q, 17, ncl_stage1=True)
        np.testing.assert_allclose(s_ncl, np.einsum("qkd,qd->qk", np.asarray(v.stage1_units)[v.rows(i_ncl)], q), atol=1e-6)
        assert rv.search(np.zeros((0, D), np.float32), 4)[0].shape == (0, 4)
        with pytest.raises(ValueError, match="queries have d=3"):
            rv.search(np.ones((1, 3), np.float32), 4)


@pytest.mark.parametrize("devices", DEVICE_SETS, ids=["one", "split"])
@pytest.mark.parametrize("method", STAGE1_METHODS)
def test_search_over_a_resident_version_equals_the_plain_one_and_reads_no_host_row(gallery, devices, method):
    """search_batch over the ResidentVersion == over the plain flat version (ids, psi within 1e-5), with every
    per-row host array made unreadable after the copy: stage 1 and the rerank read the device copy only."""
    model, root = gallery
    t = torch.from_numpy(queries(seed=11, n=6)[:6]) * 3.0  # (6, d): random embeddings, not unit
    t[:, :3] = 0.0  # the tied one-hot rows score 0 (+ their bias): near the median, far from the K-th place
    texts = [f"q{i}" for i in range(t.shape[0])]
    opts = [SearchOptions(k=8, candidates=40, rerank=rr, ncl=ncl, ncl_stage1=s1)
            for rr, ncl, s1 in [(True, False, False), (True, True, False), (True, True, True), (False, True, False)]]
    with open_index(root) as plain:
        for ncl in (False, True):  # a tie at K would let faiss and the exact search keep different rows
            assert not boundary_tie(plain.stage1_units, plain.biases, (t / t.norm(dim=1, keepdim=True)).numpy(), 40,
                                    ncl=ncl)
        want = {i: search_batch(model, plain, texts, o, encoder=lambda _: t) for i, o in enumerate(opts)}
    v = open_index(root)
    rv = load_resident(v, model, k=40, devices=devices, method=method)
    assert isinstance(rv, ResidentVersion) and rv.decision.method == method
    make_unreadable(v)
    with pytest.raises(AssertionError, match="read at"):
        v.frames[[0]]  # the check is live
    for i, o in enumerate(opts):
        got = search_batch(model, rv, texts, o, encoder=lambda _: t)
        for g, w in zip(got, want[i], strict=True):
            assert [h.id for h in g.hits] == [h.id for h in w.hits]
            for hg, hw in zip(g.hits, w.hits, strict=True):
                assert abs(hg.ann_score - hw.ann_score) <= 1e-5 and hg.bias == hw.bias
                if o.rerank:
                    assert abs(hg.psi_score - hw.psi_score) <= 1e-5 and abs(hg.score - hw.score) <= 1e-5
    assert np.std([h.psi_score for h in want[0][0].hits]) > 1e-3  # psi is not trivial on this gallery
    # the wrapper delegates names, metadata and ids -> rows to the wrapped version
    assert rv.name == v.name and rv.n == N and rv.metadata([int(v.ids[3])])[0]["id"] == int(v.ids[3])
    np.testing.assert_array_equal(rv.rows(v.ids[[5, 2]]), [5, 2])
    rv.close()


@pytest.mark.parametrize("devices", DEVICE_SETS, ids=["one", "split"])
def test_gather_is_the_host_gather_bitwise(gallery, int8_gallery, devices):
    """The candidates' constants from the device copy == psi_consts.gather from the memory maps (float16 and int8
    frames), rows on both sides of the split; the psi scores of the rerank then agree with the host path."""
    model, root = gallery
    fold = psi_consts.fold_of(model)
    rows = np.array([0, 3, 119, 120, 121, 200, N - 1])
    for r in (root, int8_gallery):
        with open_index(r) as v:
            rv = load_resident(v, model, k=10, devices=devices, method="exact")
            got = rv.resident.gather(rows, "cpu")
            want = psi_consts.gather(v, rows, fold, "cpu")
            for name in ("frames", "packed", "vbar"):
                a, b = getattr(got, name), getattr(want, name)
                assert a.dtype == b.dtype and torch.equal(a, b), (r, name)
            assert got.fingerprint == want.fingerprint
            empty = rv.resident.gather(np.zeros(0, np.int64), "cpu")
            assert empty.packed.shape == (0, want.packed.shape[1]) and empty.frames.shape == (0, *want.frames.shape[1:])
            with pytest.raises(ValueError, match="ascending, unique"):
                rv.resident.gather(np.array([5, 3]), "cpu")
            cands = [v.ids[[1, 7, 130, 200]], v.ids[[239, 0]]]
            t = torch.from_numpy(queries(n=2)[:2]) * 2.0
            for a, b in zip(R.psi_scores(model, rv, t, cands), R.psi_scores(model, v, t, cands), strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_the_estimate_is_the_copy_and_the_cap_refuses_with_the_bytes(gallery):
    model, root = gallery
    with open_index(root) as v:
        consts = psi_consts.served(model, v)
        est = estimate(v, ["cpu", "cpu"], consts, workspace_queries=8)
        rv = load_resident(v, model, k=10, devices=["cpu", "cpu"], method="exact", workspace_queries=8)
        for sh, need, (a, b) in zip(rv.resident.shards, est.bytes, est.ranges, strict=True):
            tensors = {id(x): x for x in (sh.stage1, sh.ids, sh.biases, sh.units, sh.norms, sh.frames, sh.packed)}
            copied = sum(x.numel() * x.element_size() for x in tensors.values())
            assert copied + 8 * (b - a) * 12 == need  # the arrays copied + the workspace of 8 queries
        assert est.total == sum(est.bytes) > 0
        with pytest.raises(ResidentTooLarge) as e:
            load_resident(v, model, k=10, devices=["cpu"], cap_bytes=1000)
        msg = str(e.value)
        need = estimate(v, ["cpu"], consts).total
        assert f"needs {need:,} bytes" in msg and "the cap of 1,000 bytes" in msg and v.name in msg
        assert "CPU path" in msg and "on cpu" in msg
        # free memory below the need refuses too and names it; within both it passes
        with pytest.raises(ResidentTooLarge, match=f"over the 5,000 bytes free there .*{need:,}|needs {need:,} bytes.*5,000 bytes free"):
            check_fits(estimate(v, ["cpu"], consts), None, free={"cpu": 5000})
        check_fits(estimate(v, ["cpu"], consts), need, free={"cpu": need})
        # two shares on one device add up against its cap
        half = estimate(v, ["cpu", "cpu"], consts)
        with pytest.raises(ResidentTooLarge, match=f"needs {half.total:,} bytes"):
            check_fits(half, max(half.bytes), free={"cpu": None})


def test_the_choice_follows_the_two_p50s():
    common = dict(sample=64, k=256, devices=["cuda:0"], ann="ivf index on the GPU")
    assert decide(0.65, 0.95, **common).method == "exact"
    assert decide(0.95, 0.95, **common).method == "exact"  # as fast: exact (recall 1.0) wins
    d = decide(4.2, 0.95, **common)
    assert d.method == "ann" and "0.950" in d.reason and "4.200" in d.reason
    assert d.as_dict() == {"method": "ann", "exact_p50_ms": 4.2, "ann_p50_ms": 0.95, "sample": 64, "k": 256,
                           "devices": ["cuda:0"], "ann": "ivf index on the GPU", "reason": d.reason}
    f = decide(None, None, forced="ann", **common)
    assert f.method == "ann" and "forced" in f.reason
    with pytest.raises(ValueError, match="'gpu'"):
        decide(1.0, 2.0, forced="gpu", **common)
    with pytest.raises(ValueError, match="both p50s"):
        decide(1.0, None, **common)


def test_a_real_measurement_records_its_choice_and_search_follows_it(gallery):
    model, root = gallery
    with open_index(root) as v:
        rv = load_resident(v, model, k=20, devices=["cpu", "cpu"], sample=12)
        d = rv.decision
        assert d.method in STAGE1_METHODS and d.sample == 12 and d.k == 20 and d.devices == ("cpu", "cpu")
        assert d.exact_p50_ms > 0 and d.ann_p50_ms > 0 and "IndexFlatIP" in d.ann and "CPU" in d.ann
        assert d == decide(d.exact_p50_ms, d.ann_p50_ms, sample=12, k=20, devices=d.devices, ann=d.ann)
        q = queries(n=3)[:3]
        chosen = rv.resident.search(q, 20) if d.method == "exact" else v.search(q, 20)
        for a, b in zip(rv.search(q, 20), chosen, strict=True):
            np.testing.assert_array_equal(a, b)
        with pytest.raises(ValueError, match="'fast'"):
            load_resident(v, model, k=20, devices=["cpu"], method="fast")
