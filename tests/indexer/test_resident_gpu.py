"""The device-resident index on CUDA: the exact stage 1 against a numpy brute force (the gallery on one GPU, and
split in two ranges on it), the search over a ResidentVersion against the plain version's with the model on the
GPU (every per-row host array unreadable after the copy), the gathered constants bitwise equal to the host
gather, and a measured stage-1 choice against the version's faiss index (on the GPU where faiss-gpu is).

Skipped without CUDA ("needs CUDA"); the CPU versions of these checks are tests/indexer/test_resident.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gare_index import psi_consts
from gare_index.resident_version import STAGE1_METHODS, decide, load_resident
from gare_index.store import open_index
from gare_search.search import SearchOptions, search_batch
from tests.indexer.resident_support import (
    N,
    boundary_tie,
    brute_force,
    make_unreadable,
    queries,
    tie_rows,
    tiny_model,
    write_gallery,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE_SETS = [["cuda:0"], ["cuda:0", "cuda:0"]]


@pytest.fixture(scope="module")
def gallery(tmp_path_factory):
    model = tiny_model()
    root = write_gallery(tmp_path_factory.mktemp("resident_gpu"), model)
    return model.to("cuda"), root


@pytest.mark.parametrize("devices", DEVICE_SETS, ids=["one", "split"])
@pytest.mark.parametrize("ncl", [False, True], ids=["cos", "cos+b"])
def test_exact_stage1_on_cuda_equals_a_numpy_brute_force(gallery, devices, ncl):
    model, root = gallery
    with open_index(root) as v:
        rv = load_resident(v, model, k=5, devices=devices, method="exact")
        assert all(sh.stage1.is_cuda and sh.packed.is_cuda and sh.frames.is_cuda for sh in rv.resident.shards)
        q = queries()
        assert boundary_tie(v.stage1_units, v.biases, q, 5, ncl=ncl)
        for k in (5, 17, N + 7):
            want_s, want_i = brute_force(v.stage1_units, v.biases, v.ids, q, k, ncl=ncl)
            got_s, got_i = rv.search(q, k, ncl_stage1=ncl)
            np.testing.assert_array_equal(got_i, want_i)
            np.testing.assert_allclose(got_s, want_s, atol=1e-5, rtol=0)
        _, top = rv.search(q[-3:-2], 5, ncl_stage1=ncl)
        assert top[0].tolist() == v.ids[tie_rows()[::3][:5]].tolist()


@pytest.mark.parametrize("devices", DEVICE_SETS, ids=["one", "split"])
@pytest.mark.parametrize("method", STAGE1_METHODS)
def test_search_on_cuda_over_a_resident_version_equals_the_plain_one_and_reads_no_host_row(gallery, devices, method):
    model, root = gallery
    t = torch.from_numpy(queries(seed=11, n=6)[:6]).cuda() * 3.0  # (6, d) on the model's device
    t[:, :3] = 0.0  # the tied one-hot rows far from the K-th place
    texts = [f"q{i}" for i in range(t.shape[0])]
    opts = [SearchOptions(k=8, candidates=40, rerank=rr, ncl=ncl, ncl_stage1=s1)
            for rr, ncl, s1 in [(True, False, False), (True, True, False), (True, True, True), (False, True, False)]]
    with open_index(root) as plain:
        want = {i: search_batch(model, plain, texts, o, encoder=lambda _: t) for i, o in enumerate(opts)}
    v = open_index(root)
    rv = load_resident(v, model, k=40, devices=devices, method=method)
    make_unreadable(v)
    for i, o in enumerate(opts):
        got = search_batch(model, rv, texts, o, encoder=lambda _: t)
        for g, w in zip(got, want[i], strict=True):
            assert [h.id for h in g.hits] == [h.id for h in w.hits]
            for hg, hw in zip(g.hits, w.hits, strict=True):
                assert abs(hg.ann_score - hw.ann_score) <= 1e-5 and hg.bias == hw.bias
                if o.rerank:
                    assert abs(hg.psi_score - hw.psi_score) <= 1e-5 and abs(hg.score - hw.score) <= 1e-5
    rv.close()


@pytest.mark.parametrize("devices", DEVICE_SETS, ids=["one", "split"])
def test_gather_on_cuda_is_the_host_gather_bitwise(gallery, devices):
    model, root = gallery
    fold = psi_consts.fold_of(model)
    rows = np.array([0, 3, 119, 120, 121, 200, N - 1])
    with open_index(root) as v:
        rv = load_resident(v, model, k=10, devices=devices, method="exact")
        got = rv.resident.gather(rows, "cuda:0")
        want = psi_consts.gather(v, rows, fold, "cuda:0")
        for name in ("frames", "packed", "vbar"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.is_cuda and a.dtype == b.dtype and torch.equal(a, b), name


def test_a_measured_choice_on_cuda_is_recorded(gallery):
    model, root = gallery
    with open_index(root) as v:
        rv = load_resident(v, model, k=40, devices=["cuda:0"], sample=16)
        d = rv.decision
        assert d.sample == 16 and d.k == 40 and d.devices == ("cuda:0",) and d.exact_p50_ms > 0 and d.ann_p50_ms > 0
        assert d == decide(d.exact_p50_ms, d.ann_p50_ms, sample=16, k=40, devices=d.devices, ann=d.ann)
        assert ("GPU" if v.ann.on_gpu else "CPU") in d.ann
        print(d.as_dict())  # the measured numbers, for the GPU report (pytest -s)
