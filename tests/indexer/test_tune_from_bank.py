"""`gare-index tune --from-bank BANK.npy` (issue 29, must-have 3): stage 1 retuned on the queries the service
served (the query bank gare-serve writes, gare_serve/engine/traffic_bank.py) instead of the build's sample. The real service
test index (16 mp4 files, the tiny checkpoint with a 64-row NCL queue)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gare.checkpoint import file_sha256, load_model
from gare_build.cli import main
from gare_build.tuning.version_tuning import build_deviation
from gare_index import psi_consts
from gare_index.store import current_version_name, open_index
from gare_serve.engine.traffic_bank import QueryBank
from tests.service.support import copy_index


def _bank(path, version, rng, n_distinct=30, repeats=10):
    """A bank as the service writes it: unit query embeddings near gallery videos, some queries repeated."""
    u = np.asarray(version.units)
    q = u[rng.integers(0, len(u), n_distinct)] + 0.3 * rng.standard_normal((n_distinct, version.dim)).astype(np.float32)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    bank = QueryBank(1000, version.dim, path)
    bank.push(q)
    bank.push(q[:repeats])  # popular queries come back
    bank.flush()
    return q


def test_tune_from_bank_records_the_bank_as_the_query_source(service_env, tmp_path, capsys):
    idx = copy_index(service_env["index"], tmp_path / "index")
    v1 = open_index(idx)
    # the build's sample: the queue mixed with queries spread over the gallery
    assert v1.manifest["stage1"]["query_source"].startswith("ncl-queue (64 queries) + spread-gallery (500 queries")
    distinct = _bank(tmp_path / "bank.npy", v1, np.random.default_rng(0))
    v1.close()
    assert main(["tune", "--out", str(idx), "--from-bank", str(tmp_path / "bank.npy"), "--recall-target", "0.99"]) == 0
    printed = capsys.readouterr().out
    v2 = open_index(idx)
    st = v2.manifest["stage1"]
    assert v2.name == "v000002" and v2.manifest["builder"]["command"] == "tune"
    assert st["query_source"] == "query-bank (30 queries; 30 distinct of 40 served)" and st["n_queries"] == 30
    qb = st["query_bank"]
    assert qb["sha256"] == file_sha256(tmp_path / "bank.npy") and qb["rows"] == 40 and qb["distinct"] == qb["used"] == 30
    assert st["recall_target"] == 0.99 and st["met"] and "queries: query-bank" in printed
    assert "recall_parts" not in st and st["spread"] == 0.0  # served queries replace the mix
    # the tuning ran on the bank's rows: the deviation figure it records is the one of exactly these queries
    model, _ = load_model(service_env["checkpoint"], "cpu")
    dev = build_deviation(model, distinct, v2.frames, v2.masks, seed=0)
    assert dev["pairs"] == 30 * 16  # (the bank's rows are normalised once more when read: float rounding)
    assert dev["delta_mean_abs"] == pytest.approx(st["deviation"]["delta_mean_abs"], rel=1e-6)
    assert dev["delta_p95_abs"] == pytest.approx(st["deviation"]["delta_p95_abs"], rel=1e-6)
    old = json.loads((idx / "versions" / "v000001" / "manifest.json").read_text())["files"]
    assert "psi_consts.npy" in old
    for name in ("units.npy", "frames.npy", "biases.npy", "psi_consts.npy"):  # nothing re-encoded or re-folded
        assert v2.manifest["files"][name]["sha256"] == old[name]["sha256"]
    # psi's stored constants serve as they are: the tuned version's rerank folds nothing at load
    assert psi_consts.fold_status(v2, psi_consts.fold_of(model)) is None
    v2.close()
    # --tune-queries bounds the distinct rows used (a seeded sample)
    assert main(["tune", "--out", str(idx), "--from-bank", str(tmp_path / "bank.npy"), "--tune-queries", "10"]) == 0
    st = open_index(idx).manifest["stage1"]
    assert st["n_queries"] == 10 and st["query_bank"]["used"] == 10 and st["query_source"].startswith("query-bank (10 ")
    capsys.readouterr()


def test_bad_banks_change_nothing(service_env, tmp_path, capsys):
    idx = copy_index(service_env["index"], tmp_path / "index")
    np.save(tmp_path / "narrow.npy", np.ones((8, 5), np.float32))
    np.save(tmp_path / "one.npy", np.tile(np.eye(1, 64, dtype=np.float32), (5, 1)))  # 5 rows, 1 distinct query
    for bank, fragment in ((tmp_path / "missing.npy", "--from-bank"), (tmp_path / "narrow.npy", "expected (n, 64)"),
                           (tmp_path / "one.npy", "1 distinct queries")):
        assert main(["tune", "--out", str(idx), "--from-bank", str(bank)]) == 1
        err = capsys.readouterr().err
        assert fragment in err and "--from-traffic" not in err, err
    assert main(["tune", "--out", str(idx), "--from-bank", str(tmp_path / "one.npy"), "--tune-captions",
                 str(service_env["corpus"])]) == 1
    assert "give one" in capsys.readouterr().err
    assert current_version_name(idx) == "v000001"
