"""`gare-index biases --from-traffic BANK.npy`: the mixed queue, what the manifest records, input validation
(a bad file is a clear error, exit 1, nothing changed), and what add / plain `biases` do afterwards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gare.checkpoint import load_model, read_checkpoint
from gare.sinkhorn import sinkhorn_biases_naive
from gare_build.cli import main
from gare_build.ncl_queues import mix_queues
from gare_index.store import current_version_name, list_versions, open_index, verify_index
from tests.indexer.postprocess_support import D, copy_index, unit


def _bank(path, n=50, seed=0):
    np.save(path, unit(np.random.default_rng(seed).standard_normal((n, D))))
    return path


def test_mix_queues_fraction_and_determinism():
    rng = np.random.default_rng(0)
    train = rng.standard_normal((1000, 8)).astype(np.float32)
    bank = rng.standard_normal((700, 8)).astype(np.float32) + 100  # recognisable rows
    mixed, info = mix_queues(train, bank, 0.3)
    assert mixed.shape == (1000, 8) and (info["traffic_queries"], info["train_queries"]) == (300, 700)
    assert int((mixed[:, 0] > 50).sum()) == 300 and info["weight_effective"] == 0.3
    np.testing.assert_array_equal(mix_queues(train, bank, 0.3)[0], mixed)  # deterministic
    assert mix_queues(train, bank, 0.3, seed=1)[0].tobytes() != mixed.tobytes()
    # rows come from the inputs, without repetition
    assert len({r.tobytes() for r in mixed}) == 1000
    # a small bank: all of it, and the training part shrinks so the fraction holds
    m, info = mix_queues(train, bank[:100], 0.5)
    assert (info["traffic_queries"], info["train_queries"]) == (100, 100) and m.shape[0] == 200
    m, info = mix_queues(train, bank[:100], 0.2)
    assert (info["traffic_queries"], info["train_queries"]) == (100, 400)
    assert mix_queues(train, bank, 0.0)[1]["traffic_queries"] == 0
    m, info = mix_queues(train, bank, 1.0)
    assert (info["traffic_queries"], info["train_queries"]) == (700, 0) and (m[:, 0] > 50).all()
    m, info = mix_queues(None, bank, 0.5)
    assert m.shape[0] == 700 and "traffic queries only" in info["note"]
    with pytest.raises(ValueError, match="traffic-weight"):
        mix_queues(train, bank, 1.5)


def test_biases_from_traffic_end_to_end(postprocess_env, tmp_path, capsys):
    sh = postprocess_env
    out = copy_index(sh["index"], tmp_path / "INDEX")
    bank = _bank(tmp_path / "bank.npy")
    before = open_index(out)
    rc = main(["biases", "--out", str(out), "--from-traffic", str(bank), "--traffic-weight", "0.5"])
    assert rc == 0
    assert "50 traffic + 50 training queries" in capsys.readouterr().out
    v = open_index(out)
    b = v.manifest["biases"]
    assert b["source"] == "checkpoint-queue+traffic" and b["n_queries"] == 100
    t = b["traffic"]
    assert (t["file"], t["rows"], t["traffic_queries"], t["train_queries"], t["traffic_weight"]) == (str(bank), 50, 50, 50, 0.5)
    assert len(t["sha256"]) == 64 and set(t) <= {"file", "sha256", "rows", "non_unit_rows", "traffic_weight", "traffic_queries",
                                                 "train_queries", "weight_effective", "seed", "note", "bank_scale",
                                                 "bank_scale_from", "unit_rows"}  # no content
    # the biases are Sinkhorn's against the mixed queue, fitted to the served psi score (issue 17): the raw
    # training queue texts and the bank's unit rows scaled to the queue's mean |t| (psi needs |t|)
    ck = read_checkpoint(sh["checkpoint"])
    raw = ck.queues["text"].float().numpy()
    scale = float(np.linalg.norm(raw, axis=1).mean())
    assert t["bank_scale"] == pytest.approx(scale, rel=1e-5) and b["score"] == "served"
    assert t["unit_rows"] == 50 and t["bank_scale_from"] == "the mean |t| of the checkpoint's training queue"
    mixed, _ = mix_queues(raw, np.load(bank) * np.float32(scale), 0.5)
    gamma = float(1 / torch.exp(ck.state_dict["clip.logit_scale"]))
    assert b["served"]["form"] == "dense"  # the gallery is smaller than K: every entry is an exact psi score
    model, _ = load_model(sh["checkpoint"])
    with torch.no_grad():
        S = model.score(torch.from_numpy(mixed), torch.from_numpy(np.asarray(v.frames, np.float32)),
                        torch.from_numpy(np.asarray(v.masks)), vbar=torch.from_numpy(v.vbar(np.arange(v.n))))
    _, want = sinkhorn_biases_naive(S.double(), gamma, 4)
    np.testing.assert_allclose(v.biases, want.numpy(), atol=2e-4)
    assert not np.allclose(v.biases, before.biases)
    # every other file is linked; the folded stage-1 index follows the new biases
    assert all(v.manifest["files"][f] == before.manifest["files"][f] for f in ("units.npy", "frames.npy", "ann.faiss"))
    assert v.manifest["files"]["ann_ncl.faiss"] != before.manifest["files"]["ann_ncl.faiss"]
    assert verify_index(out) == []

    # add / remove recompute the biases with the same bank while it is there
    assert main(["remove", "--out", str(out), str(int(v.ids[0]))]) == 0
    v2 = open_index(out)
    assert v2.manifest["biases"]["source"] == "checkpoint-queue+traffic" and v2.manifest["biases"]["traffic"]["rows"] == 50
    # ... and fall back to the checkpoint's queue, saying so, when it is gone
    bank.unlink()
    assert main(["remove", "--out", str(out), str(int(v2.ids[0]))]) == 0
    v3 = open_index(out)
    assert v3.manifest["biases"]["source"] == "checkpoint-queue" and "traffic" not in v3.manifest["biases"]
    assert any("run `gare-index biases --from-traffic` again" in n for n in json.loads((out / "report.json").read_text())["notes"])

    # W = 1: traffic only
    bank2 = _bank(tmp_path / "bank2.npy", n=30, seed=1)
    assert main(["biases", "--out", str(out), "--from-traffic", str(bank2), "--traffic-weight", "1"]) == 0
    b4 = open_index(out).manifest["biases"]
    assert b4["source"] == "traffic" and b4["n_queries"] == 30
    # a plain `biases` goes back to the checkpoint's queue
    assert main(["biases", "--out", str(out)]) == 0
    assert open_index(out).manifest["biases"]["source"] == "checkpoint-queue"


def _bad_files(tmp_path):
    good = unit(np.random.default_rng(0).standard_normal((20, D)))
    files = {}
    files["pickle"] = tmp_path / "pickle.npy"
    np.save(files["pickle"], np.array([{"text": "a secret query"}] * 3, dtype=object), allow_pickle=True)
    files["float64"] = tmp_path / "f64.npy"
    np.save(files["float64"], good.astype(np.float64))
    files["wrong d"] = tmp_path / "d.npy"
    np.save(files["wrong d"], good[:, :32].copy())
    files["1-d"] = tmp_path / "1d.npy"
    np.save(files["1-d"], good[0])
    nan = good.copy()
    nan[3, 5] = np.nan
    files["nan"] = tmp_path / "nan.npy"
    np.save(files["nan"], nan)
    zero = good.copy()
    zero[7] = 0
    files["zero"] = tmp_path / "zero.npy"
    np.save(files["zero"], zero)
    files["empty"] = tmp_path / "empty.npy"
    np.save(files["empty"], np.zeros((0, D), np.float32))
    files["text"] = tmp_path / "text.npy"
    files["text"].write_text("a dog on a beach\n")
    files["npz"] = tmp_path / "bank.npz"
    np.savez(files["npz"], bank=good)
    files["missing"] = tmp_path / "nope.npy"
    return files


EXPECT = {"pickle": "not a plain numeric", "float64": "dtype float64, expected float32", "wrong d": "expected (n, 64)",
          "1-d": "expected (n, 64)", "nan": "NaN or infinite", "zero": "zero vectors", "empty": "empty",
          "text": "not a plain numeric", "npz": "not an .npz", "missing": "no such file"}


def test_bad_banks_fail_cleanly_and_change_nothing(postprocess_env, tmp_path, capsys):
    sh = postprocess_env
    out = copy_index(sh["index"], tmp_path / "INDEX")
    name, versions = current_version_name(out), list_versions(out)
    for kind, path in _bad_files(tmp_path).items():
        rc = main(["biases", "--out", str(out), "--from-traffic", str(path)])
        err = capsys.readouterr().err
        assert rc == 1, kind
        assert "gare-index biases: error:" in err and EXPECT[kind] in err, (kind, err)
        assert current_version_name(out) == name and list_versions(out) == versions
        assert json.loads((out / "report.json").read_text())["status"] == "failed"
    for w in ("1.5", "-0.1", "x"):
        with pytest.raises(SystemExit) as e:
            main(["biases", "--out", str(out), "--from-traffic", str(tmp_path / "f64.npy"), "--traffic-weight", w])
        assert e.value.code == 2
    assert verify_index(out) == []


def test_served_norms_keep_served_rows_and_give_unit_rows_a_norm():
    """psi scores bank rows at their |t|: rows of raw t (banks the service writes now) stay as they are; unit rows
    (banks written before the service kept |t|) take the mean |t| of the bank's own raw rows, else the reference."""
    from gare_build.ncl_queues import served_norms

    rng = np.random.default_rng(3)
    raw = rng.standard_normal((6, D)).astype(np.float32) * 3.0  # |t| about 3 sqrt(D)
    units = unit(rng.standard_normal((4, D)))
    out, rec = served_norms(raw, 10.0)
    assert out is raw and rec == {"unit_rows": 0}
    out, rec = served_norms(units, 10.0)  # an old bank: the reference norm
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 10.0, rtol=1e-6)
    np.testing.assert_allclose(out / 10.0, units, rtol=1e-6)  # same directions
    assert rec["unit_rows"] == 4 and rec["bank_scale"] == 10.0 and "training queue" in rec["bank_scale_from"]
    mixed = np.concatenate([units, raw])  # an old bank the upgraded service went on writing
    out, rec = served_norms(mixed, 10.0)
    want = float(np.linalg.norm(raw, axis=1).mean())
    np.testing.assert_allclose(np.linalg.norm(out[:4], axis=1), want, rtol=1e-5)
    np.testing.assert_array_equal(out[4:], raw)
    assert rec["bank_scale"] == pytest.approx(want, rel=1e-6) and "served rows" in rec["bank_scale_from"]
    out, rec = served_norms(units, None)  # nothing gives a norm: left at |t| = 1, and the record says so
    np.testing.assert_array_equal(out, units)
    assert rec["bank_scale"] == 1.0 and "|t| = 1" in rec["bank_scale_from"]
