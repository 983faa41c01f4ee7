"""Issue 28, must-have 2: the fresh NCL queue. At build time and in `gare-index biases` the training captions
are re-encoded with the checkpoint's (final) text tower instead of the embeddings pushed during training; the
stale queue stays available (`--bias-queue stale`), and the manifest records which was used."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gare.annotations import load_dataset
from gare.checkpoint import load_model, read_checkpoint, save_checkpoint
from gare_build.cli import main
from gare_build.ncl_queues import FreshQueueUnavailable, fresh_rows, training_captions
from gare_build.pipeline.biases import bias_queue, compute_biases, served_inputs
from gare_index.store import open_index


def _build(out: Path, ckpt: Path, corpus: Path, *extra: str) -> int:
    return main(["build", "--checkpoint", str(ckpt), "--videos", str(corpus), "--out", str(out), "--batch-size", "4",
                 "--workers", "0", "--no-progress", "--no-tune", *extra])


def _train_captions(synth: Path) -> list[str]:
    return list(load_dataset({"kind": "synth", "root": str(synth)}, "train").captions)


def _reference_biases(ckpt: Path, out: Path, captions: list[str]) -> np.ndarray:
    """The served biases of the built gallery against `captions` encoded here, one batch, by model.encode_text."""
    model, ck = load_model(ckpt, "cpu")
    with torch.inference_mode():
        q = model.encode_text(model.tokenize(captions)).float().numpy()
    v = open_index(out)
    arrays = {"units": v.units, "norms": v.norms, "frames": v.frames, "masks": v.masks, "ann_units": v.ann_units,
              "psi_consts": None}
    gamma = float(1.0 / torch.exp(ck.state_dict["clip.logit_scale"].float()))
    b, _ = compute_biases(np.asarray(v.units), gamma, q, 4, served=served_inputs(model, arrays, 256))
    return b


@pytest.fixture(scope="module")
def fresh_index(tmp_path_factory, ckpt, corpus):
    out = tmp_path_factory.mktemp("fresh") / "INDEX"
    assert _build(out, ckpt, corpus, "--bias-queue", "fresh", "--bias-captions", str(corpus.parent)) == 0
    return out


def test_fresh_queue_is_the_training_captions_encoded_by_the_final_tower(fresh_index, ckpt, corpus):
    m = open_index(fresh_index).manifest
    q = m["biases"]["queue"]
    caps = _train_captions(corpus.parent)
    assert q["kind"] == "fresh" and q["n"] == len(caps) == q["n_captions"] and m["biases"]["n_queries"] == len(caps)
    assert q["source"] == str(corpus.parent) and "training split" in q["captions"]
    b = np.asarray(open_index(fresh_index).biases)
    np.testing.assert_allclose(b, _reference_biases(ckpt, fresh_index, caps), atol=2e-5)


def test_stale_option_and_biases_command_switch_queues(fresh_index, tmp_path, ckpt, corpus):
    stale = tmp_path / "STALE"
    assert _build(stale, ckpt, corpus, "--bias-queue", "stale") == 0
    ms = open_index(stale).manifest["biases"]
    assert ms["queue"] == {"kind": "stale", "n": 256} and ms["n_queries"] == 256
    b_fresh, b_stale = np.asarray(open_index(fresh_index).biases), np.asarray(open_index(stale).biases)
    assert np.abs((b_fresh - b_fresh.mean()) - (b_stale - b_stale.mean())).max() > 1e-4  # the queue matters
    # `gare-index biases --bias-queue fresh` on the stale index gives the fresh index's biases, and back
    assert main(["biases", "--out", str(stale), "--bias-queue", "fresh", "--bias-captions", str(corpus.parent)]) == 0
    v = open_index(stale)
    assert v.manifest["biases"]["queue"]["kind"] == "fresh"
    np.testing.assert_allclose(np.asarray(v.biases), b_fresh, atol=2e-5)
    # with no option `biases` keeps the version's queue (fresh, same captions)
    assert main(["biases", "--out", str(stale)]) == 0
    assert open_index(stale).manifest["biases"]["queue"]["kind"] == "fresh"
    assert main(["biases", "--out", str(stale), "--bias-queue", "stale"]) == 0
    np.testing.assert_allclose(np.asarray(open_index(stale).biases), b_stale, atol=1e-6)


def test_default_without_training_captions_is_stale_and_says_why(tmp_path, ckpt, corpus):
    out = tmp_path / "INDEX"
    assert _build(out, ckpt, corpus) == 0  # the test checkpoint names no training data
    q = open_index(out).manifest["biases"]["queue"]
    assert q["kind"] == "stale" and "names no training data" in q["fresh_unavailable"]
    report = json.loads((out / "report.json").read_text())
    assert any("stale queue" in n for n in report["notes"])
    # asking for fresh explicitly without captions is an error naming the reason, and writes nothing new
    before = open_index(out).name
    assert _build(out, ckpt, corpus, "--bias-queue", "fresh") != 0
    assert open_index(out).name == before


def test_default_is_fresh_when_the_checkpoint_names_its_data(tmp_path, ckpt, corpus):
    """A checkpoint trained on the synth folder (train_args.data) needs no option; its validation part is left out."""
    model, ck = load_model(ckpt, "cpu")
    named = tmp_path / "named.safetensors"
    save_checkpoint(named, model, queues=ck.queues, train_args={"data": {"kind": "synth", "root": str(corpus.parent)},
                                                                 "val_fraction": 0.25, "seed": 3, "queue_size": 5})
    caps, info = training_captions(read_checkpoint(named))
    all_caps = _train_captions(corpus.parent)
    assert 0 < len(caps) < len(all_caps) and set(caps) < set(all_caps) and "validation part" in info["captions"]
    gamma, q, qinfo = bias_queue(read_checkpoint(named), model, None)
    assert qinfo["kind"] == "fresh" and q.shape == (5, 64) and qinfo["n_captions"] == len(caps)  # capped at queue_size
    rows = fresh_rows(len(caps), 5)
    with torch.inference_mode():
        want = model.encode_text(model.tokenize([caps[i] for i in rows])).float().numpy()
    np.testing.assert_allclose(q, want, atol=1e-5)
    out = tmp_path / "INDEX"
    assert _build(out, named, corpus) == 0
    assert open_index(out).manifest["biases"]["queue"]["kind"] == "fresh"


def test_bad_caption_sources_are_clear_errors(tmp_path, ckpt):
    ck = read_checkpoint(ckpt)
    with pytest.raises(FreshQueueUnavailable, match="not a caption manifest"):
        training_captions(ck, tmp_path)
    bad = tmp_path / "caps.csv"
    bad.write_text("file,text\na,b\n")
    with pytest.raises(FreshQueueUnavailable, match="columns video and caption"):
        training_captions(ck, bad)
    with pytest.raises(ValueError, match="--bias-queue must be one of"):
        bias_queue(ck, None, "newest")
