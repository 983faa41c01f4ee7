"""The adaptive query bank: bounded, embeddings only, persisted without pickle, fed by real searches."""

from __future__ import annotations

import os

import numpy as np
import pytest
from fastapi.testclient import TestClient

from gare_serve.app import create_app
from gare_serve.engine.traffic_bank import QueryBank
from tests.service.support import settings


def test_bank_is_a_bounded_fifo_and_round_trips(tmp_path):
    bank = QueryBank(5, 3, tmp_path / "bank.npy", flush_every=100)
    rows = np.arange(24, dtype=np.float32).reshape(8, 3)
    bank.push(rows[:3])
    bank.push(rows[3:])
    np.testing.assert_array_equal(bank.snapshot(), rows[3:])  # the 5 newest, oldest first
    bank.flush()
    again = QueryBank(5, 3, tmp_path / "bank.npy")
    np.testing.assert_array_equal(again.snapshot(), rows[3:])
    with pytest.raises(ValueError):
        bank.push(np.zeros((2, 4), np.float32))


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):  # unpickling this runs `touch marker`
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_or_wrong_shape_bank_file_is_not_loaded(tmp_path):
    marker = tmp_path / "pwned"
    np.save(tmp_path / "bank.npy", np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    assert not marker.exists()
    assert len(QueryBank(4, 3, tmp_path / "bank.npy")) == 0
    assert not marker.exists()  # the payload was refused, never unpickled
    np.save(tmp_path / "b2.npy", np.zeros((2, 7), np.float32))
    assert len(QueryBank(4, 3, tmp_path / "b2.npy")) == 0


def test_service_banks_served_query_embeddings_only(service_env, tmp_path):
    sh = service_env
    path = tmp_path / "bank.npy"
    app = create_app(settings(sh["index"], query_bank_size=3, query_bank_path=path, query_bank_flush_every=2))
    queries = ["a red circle moves left", "two blue squares", "a green triangle", "a yellow star spins"]
    with TestClient(app) as c:
        for q in queries:
            assert c.post("/v1/search", json={"query": q, "k": 2}).status_code == 200
    bank = np.load(path, allow_pickle=False)  # written at shutdown
    assert bank.shape == (3, 64) and bank.dtype == np.float32
    # the newest three queries as the rerank scored them: the tower's raw t, |t| kept (psi is not scale-invariant,
    # and the tuner and the biases score these rows with psi); and no text anywhere in the file
    from gare.checkpoint import load_model
    from gare_search.search import encode_queries

    model, _ = load_model(sh["checkpoint"])
    want = encode_queries(model, queries[1:]).numpy()
    assert np.all(np.abs(np.linalg.norm(want, axis=1) - 1.0) > 0.05)  # unit rows would fail the next line
    np.testing.assert_allclose(bank, want, rtol=1e-5, atol=1e-5)
    assert b"squares" not in path.read_bytes()


def test_bank_without_a_path_refuses_to_start(service_env, tmp_path):
    app = create_app(settings(service_env["index"], query_bank_size=10))
    with pytest.raises(Exception, match="query_bank_path"), TestClient(app):
        pass
