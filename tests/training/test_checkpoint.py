"""Checkpoints: self-describing, atomic, pickle-free, and exact on round trip."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from safetensors import safe_open

from gare.checkpoint import (
    CheckpointError,
    load_model,
    load_tree,
    read_checkpoint,
    save_checkpoint,
    save_tree,
)


def test_round_trip_gives_identical_scores(tiny_model, tmp_path):
    path = tmp_path / "ckpt.safetensors"
    queues = {"text": torch.randn(10, 64), "video": torch.randn(10, 64)}
    save_checkpoint(path, tiny_model, queues=queues, train_args={"lr": 1e-4, "epochs": 5}, info={"step": 7})
    model2, ckpt = load_model(path)
    cfg = tiny_model.cfg
    frames = torch.randn(3, cfg.max_frames, 3, cfg.image_size, cfg.image_size)
    mask = torch.ones(3, cfg.max_frames, dtype=torch.long)
    with torch.no_grad():
        outs = []
        for m in (tiny_model, model2):
            t = m.encode_text(m.tokenize(["a red ball", "a dog"]))
            Fv, _ = m.encode_video(frames, mask)
            outs.append(m.score(t, Fv, mask))
    assert torch.equal(outs[0], outs[1])
    assert ckpt.config == cfg
    assert ckpt.train_args == {"lr": 1e-4, "epochs": 5} and ckpt.info == {"step": 7}
    assert torch.equal(ckpt.queues["text"], queues["text"])
    # the header is readable by any safetensors reader: config, version, sizes
    with safe_open(str(path), "pt") as f:
        header = json.loads(f.metadata()["gare"])
    assert header["version"] == 1 and header["model_config"]["embed_dim"] == 64
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_pickle_payload_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "evil.safetensors"
    bad.write_bytes(pickle.dumps({"model": Evil()}))
    with pytest.raises(CheckpointError):
        read_checkpoint(bad)
    assert not marker.exists()
    # and a torch.save'd pickle given to the official importer is refused by weights_only loading
    from gare_train.authors_checkpoint import load_official_state_dict

    torch.save({"x": Evil()}, tmp_path / "evil.bin")
    with pytest.raises(pickle.UnpicklingError):
        load_official_state_dict(tmp_path / "evil.bin")
    assert not marker.exists()


def test_truncated_checkpoint_is_refused(tiny_model, tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, tiny_model)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        read_checkpoint(path)


def test_failed_write_keeps_previous_file(tiny_model, tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, tiny_model, info={"v": 1})
    before = path.read_bytes()
    import gare.checkpoint as ck

    def boom(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(OSError):
        save_checkpoint(path, tiny_model, info={"v": 2})
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt.safetensors"]


def test_tree_round_trip_optimizer_state(tiny_model, tmp_path):
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    tiny_model.train()
    loss = tiny_model.encode_text(tiny_model.tokenize(["x"])).sum()
    loss.backward()
    opt.step()
    tree = {"optimizer": opt.state_dict(), "step": 3, "rng": torch.get_rng_state(), "names": ("a", "b"), "none": None}
    save_tree(tmp_path / "state.safetensors", tree)
    back = load_tree(tmp_path / "state.safetensors")
    assert back["step"] == 3 and back["names"] == ("a", "b") and back["none"] is None
    assert torch.equal(back["rng"], tree["rng"])
    opt2 = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])
    for k, st in opt.state_dict()["state"].items():
        assert torch.equal(opt2.state_dict()["state"][k]["exp_avg"], st["exp_avg"])
    with pytest.raises(TypeError):
        save_tree(tmp_path / "bad.safetensors", {"x": object()})


def test_checkpoint_file_mode_follows_umask(tiny_model, tmp_path):
    old = os.umask(0o022)
    try:
        save_checkpoint(tmp_path / "c.safetensors", tiny_model)
    finally:
        os.umask(old)
    assert (tmp_path / "c.safetensors").stat().st_mode & 0o777 == 0o644
