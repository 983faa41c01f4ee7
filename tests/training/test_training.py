"""Datasets, the training loop (resume, distributed, bad files) and the evaluation report, end to end on CPU."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gare.annotations import carve_validation, load_dataset, load_manifest, load_msrvtt
from gare.checkpoint import CheckpointError, read_checkpoint
from gare_train.cli import main as train_cli

REPO = Path(__file__).resolve().parents[2]
# The real annotation files ship in shared/ beside the checkout (CI lays a copy there too).
MSRVTT = Path(os.environ.get("GARE_MSRVTT_ANNO", REPO.parent / "shared" / "data" / "msrvtt"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from gare_train.synth import SynthConfig, generate_corpus

    root = tmp_path_factory.mktemp("synth")
    generate_corpus(root, SynthConfig(n_videos=30, seed=3, width=64, height=64, duration=2.0, fps=6), progress=False)
    return root


def _fit(out: Path, corpus: Path, *extra: str) -> int:
    return train_cli(["fit", "--model", "gare-test-tiny", "--synth", str(corpus), "--out", str(out), "--epochs", "2",
                      "--batch-size", "4", "--num-workers", "0", "--lr", "1e-3", "--no-progress", *extra])


@pytest.fixture(scope="module")
def plain3(corpus, tmp_path_factory) -> Path:
    """One plain 3-step run saved at step 3, read-only, shared by the tests that need such a run: the NCL test's
    plain baseline, the single-process side of the gloo test (its first step), the first half of the resume
    test (which resumes a copy) and the checkpoint the refused resume names."""
    out = tmp_path_factory.mktemp("plain3") / "run"
    assert _fit(out, corpus, "--max-steps", "3", "--save-every", "3") == 0
    return out


# ---------------------------------------------------------------- datasets
def test_msrvtt_real_annotation_files(tmp_path):
    assert MSRVTT.is_dir(), f"the real MSR-VTT annotation files are expected at {MSRVTT}"
    test = load_msrvtt(MSRVTT, tmp_path / "videos", "test")
    assert len(test.captions) == 1000 and len(test.clips) == 1000
    assert test.clips[0].key == "video9770" and test.captions[0] == "a person is connecting something to system"
    assert test.clips[0].path == str(tmp_path / "videos" / "video9770.mp4")
    # MSRVTT_data.json in the distributed format, with two captions for each training video
    ids = [line.strip() for line in open(MSRVTT / "MSRVTT_train.9k.csv")][1:]
    sentences = [{"video_id": v, "caption": f"caption {k} of {v}", "sen_id": 2 * n + k} for n, v in enumerate(ids) for k in range(2)]
    data = {"videos": [{"video_id": v} for v in ids], "sentences": sentences[:-2]}  # the last video lacks captions
    shutil.copy(MSRVTT / "MSRVTT_train.9k.csv", tmp_path)
    (tmp_path / "MSRVTT_data.json").write_text(json.dumps(data))
    train = load_msrvtt(tmp_path, tmp_path / "videos", "train")
    assert len(train.clips) == 8999 and len(train.captions) == 2 * 8999
    assert train.skipped == [(ids[-1], "no caption in MSRVTT_data.json")]
    tr, val = carve_validation(train, 0.1, seed=0)
    assert len(val.clips) == 900 and len(tr.clips) == 8099
    assert not {c.key for c in tr.clips} & {c.key for c in val.clips}
    assert len(tr.captions) + len(val.captions) == len(train.captions)


def test_own_manifests_csv_and_jsonl(tmp_path):
    (tmp_path / "a.csv").write_text("video,caption,start,end\nclips/x.mp4,a dog runs,0,5\nclips/x.mp4,a running dog,0,5\n"
                                    "clips/x.mp4,later the dog sleeps,5,10\n/abs/y.mkv,a cat,,\n")
    rs = load_manifest(tmp_path / "a.csv")
    assert len(rs.clips) == 3 and len(rs.captions) == 4
    assert rs.clips[0].path == str(tmp_path / "clips/x.mp4") and (rs.clips[0].start, rs.clips[0].end) == (0.0, 5.0)
    assert rs.captions_of() == [[0, 1], [2], [3]]
    (tmp_path / "b.jsonl").write_text('{"video": "v.mp4", "captions": ["one", "two"]}\n\n{"video": "w.mp4", "caption": "three"}\n')
    rs = load_manifest(tmp_path / "b.jsonl")
    assert rs.captions == ["one", "two", "three"] and rs.caption_clip.tolist() == [0, 0, 1]
    (tmp_path / "bad.csv").write_text("path,text\nx,y\n")
    with pytest.raises(ValueError, match="video and caption"):
        load_manifest(tmp_path / "bad.csv")


# ---------------------------------------------------------------- training
def test_fit_then_eval_end_to_end(corpus, tmp_path):
    out = tmp_path / "run"
    assert _fit(out, corpus, "--epochs", "3") == 0
    summary = json.loads((out / "summary.json").read_text())
    history = json.loads((out / "history.json").read_text())
    assert summary["steps"] == len(history) > 0
    first = np.mean([h["info"] for h in history[:3]])
    last = np.mean([h["info"] for h in history[-3:]])
    assert last < first, (first, last)  # the contrastive loss falls
    assert {"info", "ib", "dir", "eps", "total", "logit_scale"} <= set(history[0])
    assert all(h["logit_scale"] <= 100.0 + 1e-3 for h in history)
    ck = read_checkpoint(out / "last.safetensors")
    assert ck.queues["text"].shape[1] == 64 and ck.queues["text"].shape[0] == min(16384, 4 * summary["steps"])
    assert (out / "config.yaml").exists()

    ev = tmp_path / "eval"
    assert train_cli(["eval", str(out / "best.safetensors"), "--synth", str(corpus), "--out", str(ev), "--num-workers", "0"]) == 0
    res = json.loads((ev / "result.json").read_text())
    assert set(res["rows"]) == {"dual-tower", "+ psi", "+ NCL", "+ psi + NCL(dual)", "+ psi + NCL(served)"}
    for row in res["rows"].values():
        assert set(row["t2v"]) == {"R1", "R5", "R10", "R50", "MdR", "MnR"} and set(row["v2t"]) == set(row["t2v"])
    assert res["ncl"]["norm_err_queue_after"] < res["ncl"]["norm_err_queue_before"]
    assert 0 <= res["deviation"]["mean_abs"] <= res["deviation"]["p95_abs"]
    cov = res["coverage_top10_in_dual_topK"]
    assert list(cov) == ["16", "32", "64", "128", "256", "512", "1024"] and all(0 <= v <= 1 for v in cov.values())
    assert (ev / "coverage.png").stat().st_size > 1000 and "| dual-tower |" in (ev / "result.md").read_text()


def test_resume_equals_uninterrupted_run(corpus, plain3, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _fit(a, corpus, "--max-steps", "6") == 0
    shutil.copytree(plain3, b)  # "--max-steps 3 --save-every 3", then resumed here to step 6
    assert _fit(b, corpus, "--max-steps", "6", "--resume", str(b / "last.safetensors")) == 0
    wa, wb = read_checkpoint(a / "last.safetensors"), read_checkpoint(b / "last.safetensors")
    assert wa.info["step"] == wb.info["step"] == 6
    for k, v in wa.state_dict.items():
        torch.testing.assert_close(wb.state_dict[k], v, atol=1e-6, rtol=0, msg=k)
    torch.testing.assert_close(wb.queues["text"], wa.queues["text"], atol=1e-6, rtol=0)
    ha, hb = json.loads((a / "history.json").read_text()), json.loads((b / "history.json").read_text())
    assert [h["step"] for h in hb] == list(range(1, 7))
    np.testing.assert_allclose([h["total"] for h in hb], [h["total"] for h in ha], atol=1e-5)


def test_resume_refuses_a_different_configuration(corpus, plain3, tmp_path):
    with pytest.raises(CheckpointError, match="different configuration.*lr"):
        from gare_train.fit import TrainConfig, Trainer

        cfg = TrainConfig(model="gare-test-tiny", data={"kind": "synth", "root": str(corpus)},
                          out_dir=str(tmp_path / "r"), epochs=2, batch_size=4, num_workers=0, lr=5e-4)
        Trainer(cfg, resume=str(plain3 / "last.safetensors"), progress=False)


def test_bad_video_files_are_skipped_and_counted(corpus, tmp_path):
    from tests.badfiles import write_bad_videos

    bad_corpus = tmp_path / "corpus"
    shutil.copytree(corpus, bad_corpus)
    train_ids = [line.strip() for line in open(bad_corpus / "train.csv")][1:]
    bad = write_bad_videos(tmp_path / "bad")
    for vid, kind in zip(train_ids[:4], ["empty", "truncated", "random", "no_moov"], strict=True):
        shutil.copy(bad[kind], bad_corpus / "videos" / f"{vid}.mp4")
    (bad_corpus / "videos" / f"{train_ids[4]}.mp4").unlink()  # missing file
    out = tmp_path / "run"
    assert _fit(out, bad_corpus, "--epochs", "1") == 0
    summary = json.loads((out / "summary.json").read_text())
    train_skipped = {k for k, _ in summary["skipped"]}
    assert len(summary["skipped"]) >= 1 and all(isinstance(r, str) and r for _, r in summary["skipped"])
    assert summary["steps"] > 0 and train_skipped  # the run went on


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_gloo_scores_the_global_batch(corpus, plain3, tmp_path):
    """torchrun with 2 CPU processes on 127.0.0.1: each rank encodes half the batch, gathers the features
    and scores the global batch, so its first-step loss equals the single-process loss on the same batch
    (the single-process run: `plain3`; its first step is the same whatever the step budget)."""
    single, multi = plain3, tmp_path / "multi"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "gare_train.cli", "fit", "--model", "gare-test-tiny", "--synth", str(corpus),
           "--out", str(multi), "--epochs", "2", "--batch-size", "4", "--num-workers", "0", "--lr", "1e-3",
           "--no-progress", "--max-steps", "2", "--device", "cpu"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hs = json.loads((single / "history.json").read_text())
    hm = json.loads((multi / "history.json").read_text())
    assert len(hm) == 2
    assert abs(hm[0]["total"] - hs[0]["total"]) < 1e-4, (hm[0], hs[0])
    assert abs(hm[0]["info"] - hs[0]["info"]) < 1e-4


def test_dataset_kinds(corpus):
    rs = load_dataset({"kind": "synth", "root": str(corpus)}, "test")
    assert len(rs.clips) == len(rs.captions) > 0
    with pytest.raises(ValueError, match="unknown dataset kind"):
        load_dataset({"kind": "webvid"}, "train")


def test_ncl_adjusted_training_logits(corpus, plain3, tmp_path):
    plain, ncl, batch = plain3, tmp_path / "ncl", tmp_path / "batch"
    assert _fit(ncl, corpus, "--max-steps", "3", "--ncl-train", "--ncl-train-mode", "queue") == 0
    assert _fit(batch, corpus, "--max-steps", "3", "--ncl-train") == 0  # the paper's per-batch biases (default)
    hp, hn = json.loads((plain / "history.json").read_text()), json.loads((ncl / "history.json").read_text())
    hb = json.loads((batch / "history.json").read_text())
    assert hp[0]["info"] == pytest.approx(hn[0]["info"], abs=1e-6)  # queue mode, empty queue at step 1: no adjustment
    assert abs(hp[2]["info"] - hn[2]["info"]) > 1e-5  # then the Sinkhorn biases change the logits
    assert abs(hp[0]["info"] - hb[0]["info"]) > 1e-5  # batch mode adjusts from the first step
    assert read_checkpoint(ncl / "last.safetensors").queues["text"].shape[0] == 12


# ---------------------------------------------------------------- frame cache and early stopping (issue 16)
def test_cached_frames_train_exactly_like_decoding_every_epoch(corpus, tmp_path):
    """cache_frames only changes where the frames come from: same batches, same losses, same weights."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert _fit(a, corpus, "--max-steps", "6", "--preset", "scratch", "--batch-size", "4") == 0
    assert _fit(b, corpus, "--max-steps", "6", "--preset", "scratch", "--batch-size", "4", "--cache-frames") == 0
    ha, hb = json.loads((a / "history.json").read_text()), json.loads((b / "history.json").read_text())
    assert len(ha) == len(hb) == 6
    np.testing.assert_allclose([h["total"] for h in hb], [h["total"] for h in ha], atol=1e-5)
    wa, wb = read_checkpoint(a / "last.safetensors"), read_checkpoint(b / "last.safetensors")
    for k, v in wa.state_dict.items():
        torch.testing.assert_close(wb.state_dict[k], v, atol=1e-5, rtol=0, msg=k)


def test_cache_frames_refuses_augmentation(corpus, tmp_path):
    from gare_train.fit import TrainConfig

    with pytest.raises(ValueError, match="cache_frames needs augment 'none'.*randaugment"):
        TrainConfig(model="gare-test-tiny", data={"kind": "synth", "root": str(corpus)}, cache_frames=True)
    with pytest.raises(ValueError, match="early_stop_patience must be >= 0"):
        TrainConfig(early_stop_patience=-1)


def test_early_stopping_stops_after_patience_epochs_without_improvement(corpus, tmp_path, monkeypatch):
    """Validation R@1 scripted as 10, 30, 20, 30, 5, ...: best at epoch 2, no improvement in epochs 3-4 (30 is not
    better than 30), so patience 2 stops after epoch 4; best.safetensors is epoch 2's, last is epoch 4's."""
    from gare_train.fit import TrainConfig, Trainer

    scripted = iter([10.0, 30.0, 20.0, 30.0, 5.0, 99.0, 99.0, 99.0])

    def fake_validate(self):
        r1 = next(scripted)
        return {"rows": {"+ psi": {"t2v": {"R1": r1}}, "dual-tower": {"t2v": {"R1": r1}}}}

    monkeypatch.setattr(Trainer, "validate", fake_validate)
    out = tmp_path / "es"
    # epochs of one example per clip over frames decoded once: a few steps each (what is counted here is epochs)
    cfg = TrainConfig(model="gare-test-tiny", data={"kind": "synth", "root": str(corpus)}, out_dir=str(out), epochs=8,
                      batch_size=8, num_workers=0, lr=1e-3, early_stop_patience=2, preset="scratch", epoch="clips",
                      augment="none", cache_frames=True)
    cfg = TrainConfig.from_sources(None, {k: v for k, v in cfg.__dict__.items()})
    tr = Trainer(cfg, progress=False)
    summary = tr.fit()
    spe = tr.steps_per_epoch
    assert summary["stopped_early_after_epoch"] == 4 and summary["steps"] == 4 * spe and summary["epochs_run"] == 4
    assert summary["best_val_r1"] == 30.0
    assert read_checkpoint(out / "best.safetensors").info["step"] == 2 * spe
    assert read_checkpoint(out / "last.safetensors").info["step"] == 4 * spe
    # without patience the same script runs every epoch
    scripted = iter([10.0, 30.0, 20.0, 30.0, 5.0, 99.0, 99.0, 99.0])
    cfg0 = TrainConfig.from_sources(None, {**cfg.__dict__, "early_stop_patience": 0, "epochs": 5, "out_dir": str(tmp_path / "no")})
    s0 = Trainer(cfg0, progress=False).fit()
    assert s0["stopped_early_after_epoch"] is None and s0["epochs_run"] == 5
