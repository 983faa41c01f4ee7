"""Issue 28, must-have 4: a decision per index. With validation captions (`--ncl-val`), the build compares psi vs
psi + biases on them through the served search and records in the manifest (biases.default) whether the biases
are on by default for this index, why, and the numbers; stage 1's K is tuned for the score served by default.

The validation sets are built so that the biases lose or win for a known reason (tests/indexer/ncl_support.py):
every caption's true video is its psi top-1 (the biases move it away: they lose) or its psi + b top-1 (they win)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from gare.retrieval_metrics import ranks_t2v
from gare_build.cli import main
from gare_build.pipeline.biases import validation_set
from gare_build.served_biases import ncl_decision, validation_ranks
from gare_index.describe import index_ncl_default
from gare_index.store import open_index
from tests.indexer.ncl_support import caption_pool, flip_manifests, served_scores


def _build(out: Path, ckpt: Path, corpus: Path, *extra: str) -> int:
    return main(["build", "--checkpoint", str(ckpt), "--videos", str(corpus), "--out", str(out), "--batch-size", "4",
                 "--workers", "0", "--no-progress", *extra])


@pytest.fixture(scope="module")
def env(tmp_path_factory, ckpt, corpus):
    root = tmp_path_factory.mktemp("decision")
    assert _build(root / "PLAIN", ckpt, corpus, "--no-tune") == 0
    lose, win, n = flip_manifests(ckpt, root / "PLAIN", root / "val")
    return {"root": root, "plain": root / "PLAIN", "lose": lose, "win": win, "n": n}


def test_decision_rule():
    """On only when the captions can tell: not lower in R@1 and R@5, no interval reaching below 0, one above 0."""
    r_psi, r_b = np.array([1, 1, 3, 7, 20]), np.array([1, 2, 1, 4, 20])
    d = ncl_decision(r_psi, r_b, "v")
    assert d["psi"] == {"R1": 40.0, "R5": 60.0, "R10": 80.0} and d["psi_biases"] == {"R1": 40.0, "R5": 80.0, "R10": 80.0}
    # R@1 equal and R@5 higher, but one caption lost its first place: the R@1 interval includes a loss -> off
    assert d["intervals"]["dR1"][0] < 0 and d["on"] is False and "cannot tell" in d["reason"]
    assert d["n_captions"] == 5 and "R@5 80.0 vs 60.0" in d["reason"]
    d = ncl_decision(r_psi, np.array([2, 2, 3, 7, 20]), "v")  # R@1 lower -> off, said as lowered
    assert d["on"] is False and "lowered" in d["reason"]
    assert ncl_decision(np.zeros(0), np.zeros(0), "v")["on"] is False
    # paired bootstrap, hand-checkable: every caption loses its first place -> the change is exactly -100
    d = ncl_decision(np.array([1, 1, 1, 1]), np.array([2, 2, 2, 2]), "v")
    assert d["intervals"]["dR1"] == [-100.0, -100.0] and d["on"] is False
    # every caption gains its first place (R@5 the same): dR1 = [+100, +100], dR5 = [0, 0] -> on
    d = ncl_decision(np.full(8, 2), np.ones(8, np.int64), "v")
    assert d["intervals"] == {"dR1": [100.0, 100.0], "dR5": [0.0, 0.0]} and d["on"] is True
    assert "on by default" in d["reason"]
    # the case: a gain whose interval starts at +0.0 and nothing else -> the captions cannot tell -> off
    d = ncl_decision(np.array([1, 2, 1, 2, 1]), np.array([1, 1, 1, 2, 1]), "v")
    lo, hi = d["intervals"]["dR1"]
    assert lo == 0.0 and hi > 0 and d["on"] is False and "[+0.0, +" in d["reason"] and "cannot tell" in d["reason"]
    # identical ranks: both intervals [0, 0], nothing to tell -> off
    assert ncl_decision(np.arange(1, 11), np.arange(1, 11), "v")["on"] is False


def test_validation_ranks_equal_the_exhaustive_ranks(env, ckpt):
    """K >= n: the served ranks are the exhaustive ones (model.score, gare.retrieval_metrics); a small K caps them at K + 1."""
    from gare.checkpoint import load_model
    from gare_build.tuning.version_tuning import encode_captions

    v = open_index(env["plain"])
    caps = caption_pool()[:40]
    S, b, _ = served_scores(ckpt, env["plain"], caps)
    true = np.arange(40) % v.n
    model, _ = load_model(ckpt, "cpu")
    args = dict(units=v.units, norms=np.asarray(v.norms), frames=v.frames, masks=np.asarray(v.masks))
    r_psi, r_b = validation_ranks(model, encode_captions(model, caps), true, b, k=256, **args)
    np.testing.assert_array_equal(r_psi, ranks_t2v(S, true))
    np.testing.assert_array_equal(r_b, ranks_t2v(S + b[None, :], true))
    r_psi4, _ = validation_ranks(model, encode_captions(model, caps), true, b, k=4, **args)
    cos = (np.asarray(v.units) @ (lambda t: (t / np.linalg.norm(t, axis=1, keepdims=True)).T)(encode_captions(model, caps)))
    in_top4 = (np.argsort(-cos, axis=0)[:4] == true[None, :]).any(axis=0)
    assert np.all(r_psi4[~in_top4] == 5) and np.all(r_psi4[in_top4] <= 4)


def test_validation_set_matches_indexed_videos(env, tmp_path):
    v = open_index(env["plain"])
    metas = v.metadata(np.asarray(v.ids))
    man = tmp_path / "val.csv"
    with open(man, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["video", "caption"])
        w.writerow([metas[3]["path"], "a red circle"])
        w.writerow(["/nowhere/x.mp4", "a blue square"])
    caps, rows, desc = validation_set(man, metas)
    assert caps == ["a red circle"] and rows.tolist() == [3] and "1 captions of videos not in the index left out" in desc
    with pytest.raises(ValueError, match="--ncl-val"):
        validation_set(tmp_path, metas)


def test_build_where_the_biases_lose_records_off_and_tunes_K_for_psi(env, ckpt, corpus, capsys):
    out = env["root"] / "LOSE"
    # the checkpoint's gamma (--ncl-gammas 1): the captions were built against the plain build's biases
    assert _build(out, ckpt, corpus, "--ncl-val", str(env["lose"]), "--ncl-gammas", "1") == 0
    m = open_index(out).manifest
    d = m["biases"]["default"]
    assert d["on"] is False and d["n_captions"] == env["n"] and d["source"] == str(env["lose"])
    assert d["gamma"]["chosen"] == d["gamma"]["checkpoint_gamma"] == m["biases"]["gamma"]
    # every caption's true video is its psi top-1, which the biases move: psi R@1 100, psi + b R@1 0
    assert d["psi"]["R1"] == 100.0 and d["psi_biases"]["R1"] == 0.0
    assert index_ncl_default(m) == (False, d["reason"]) and "off by default" in d["reason"]
    assert "off by default" in capsys.readouterr().out
    # the biases are the plain build's (the decision does not change them)
    np.testing.assert_allclose(np.asarray(open_index(out).biases), np.asarray(open_index(env["plain"]).biases), atol=1e-6)
    assert m["stage1"]["ncl_default"] is False  # K was chosen for psi alone, the score served by default
    # remove decides again on the same captions, over the videos left (captions of the removed one drop out)
    v = open_index(out)
    gone = v.metadata(np.asarray(v.ids[:1]))[0]["path"]
    n_gone = sum(1 for row in csv.DictReader(open(env["lose"])) if row["video"] == gone)
    assert main(["remove", "--out", str(out), gone]) == 0
    d2 = open_index(out).manifest["biases"]["default"]
    assert d2["n_captions"] == env["n"] - n_gone and d2["source"] == str(env["lose"])
    assert "left out" in d2["validation"] or n_gone == 0


def test_biases_command_where_they_win_records_on(env, ckpt, corpus):
    out = env["root"] / "WIN"
    assert _build(out, ckpt, corpus, "--ncl-val", str(env["win"]), "--ncl-gammas", "1") == 0
    m = open_index(out).manifest
    d = m["biases"]["default"]
    assert d["on"] is True and d["psi_biases"]["R1"] == 100.0 and d["psi"]["R1"] == 0.0
    assert m["stage1"]["ncl_default"] is True
    # `gare-index biases` decides again on the version's captions (and gamma factors), or on new ones
    assert main(["biases", "--out", str(out)]) == 0
    assert open_index(out).manifest["biases"]["default"]["on"] is True
    assert main(["biases", "--out", str(out), "--ncl-val", str(env["lose"])]) == 0
    d = open_index(out).manifest["biases"]["default"]
    assert d["on"] is False and d["source"] == str(env["lose"])
    report = json.loads((out / "report.json").read_text())
    assert report["biases"]["default"]["on"] is False
    # the stage-1 entry still says what K was tuned for; `gare-index tune` tunes it again for the new default
    assert open_index(out).manifest["stage1"]["ncl_default"] is True
    assert main(["tune", "--out", str(out)]) == 0
    assert open_index(out).manifest["stage1"]["ncl_default"] is False


def test_gamma_is_chosen_on_the_even_captions_and_the_default_decided_on_the_odd(env, ckpt, corpus):
    out = env["root"] / "GAMMA"
    assert _build(out, ckpt, corpus, "--ncl-val", str(env["lose"]), "--ncl-gammas", "0.5,1,2") == 0
    m = open_index(out).manifest
    d, g = m["biases"]["default"], m["biases"]["default"]["gamma"]
    g0 = g["checkpoint_gamma"]
    assert [t["factor"] for t in g["tried"]] == [0.5, 1.0, 2.0] and g["n_captions"] == (env["n"] + 1) // 2
    assert d["n_captions"] == env["n"] // 2  # decided only on the captions that did not pick gamma
    best = max(g["tried"], key=lambda t: (t["R1"], t["R5"], -abs(np.log(t["factor"]))))
    assert g["chosen"] == best["gamma"] == m["biases"]["gamma"] and best["gamma"] == g0 * best["factor"]
    # the index's biases are the chosen gamma's: fitting again at exactly that gamma gives the same vector
    kept = np.asarray(open_index(out).biases).copy()
    assert main(["biases", "--out", str(out), "--ncl-gammas", repr(best["factor"])]) == 0
    m2 = open_index(out).manifest
    assert m2["biases"]["gamma"] == g["chosen"] and m2["biases"]["default"]["n_captions"] == env["n"]
    np.testing.assert_allclose(np.asarray(open_index(out).biases), kept, atol=1e-6)


def test_no_validation_captions_no_decision(env):
    m = open_index(env["plain"]).manifest
    assert "default" not in m["biases"] and index_ncl_default(m) is None
