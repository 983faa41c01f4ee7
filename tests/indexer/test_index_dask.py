"""`--engine dask` on a loopback-only LocalCluster (2 worker processes, 1 thread each): the merged index equals
the local engine's (same ids -> same vectors within 1e-5)."""

from __future__ import annotations

import numpy as np
import pytest

from gare_build.build import BuildOptions, build
from gare_index.store import open_index, verify_index

distributed = pytest.importorskip("dask.distributed")


def test_dask_engine_equals_local(tmp_path, ckpt, corpus):
    local = build(ckpt, corpus, tmp_path / "local", BuildOptions(batch_size=4, workers=0, progress=False))
    with distributed.LocalCluster(host="127.0.0.1", n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None, protocol="tcp") as cluster:
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
        with distributed.Client(cluster) as client:
            workers = client.scheduler_info()["workers"]
            assert len(workers) == 2 and all(a.startswith("tcp://127.0.0.1:") for a in workers)
        rep = build(ckpt, corpus, tmp_path / "dask", BuildOptions(
            batch_size=4, engine="dask", scheduler=cluster.scheduler_address, shard_size=5, progress=False))
    assert rep.encoded == local.encoded == 12 and rep.engine == "dask" and rep.exit_code == 0
    a, b = open_index(tmp_path / "local"), open_index(tmp_path / "dask")
    np.testing.assert_array_equal(a.ids, b.ids)
    assert [m["path"] for m in a.all_metadata()] == [m["path"] for m in b.all_metadata()]
    np.testing.assert_allclose(b.units, a.units, atol=1e-5)
    np.testing.assert_allclose(b.norms, a.norms, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(b.frames, np.float32), np.asarray(a.frames, np.float32), atol=1e-5, rtol=1e-3)
    np.testing.assert_array_equal(b.masks, a.masks)
    np.testing.assert_allclose(b.biases, a.biases, atol=1e-5)
    assert b.manifest["builder"]["engine"] == "dask" and verify_index(tmp_path / "dask") == []


@pytest.mark.slow
def test_dask_engine_starts_its_own_loopback_cluster(tmp_path, ckpt, corpus):
    from gare_build.cli import main

    rc = main(["build", "--checkpoint", str(ckpt), "--videos", str(corpus), "--out", str(tmp_path / "INDEX"),
               "--engine", "dask", "--dask-workers", "2", "--shard-size", "4", "--no-progress"])
    assert rc == 0
    v = open_index(tmp_path / "INDEX")
    assert v.n == 12 and v.manifest["builder"]["engine"] == "dask" and verify_index(tmp_path / "INDEX") == []
