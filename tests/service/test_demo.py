"""The README demo (gare_demo.demo): every stage real (generated mp4 files, gare-cpu-demo trained here, a real
index), its run record, the second run reusing everything, and (slow) the held-out quality it promises."""

from __future__ import annotations

import json

import pytest

from gare_demo import demo


def test_demo_stages_then_a_second_run_reuses_them(tmp_path, monkeypatch):
    root = tmp_path / "demo"
    index, corpus, examples = demo.prepare(root, n_videos=24, epochs=1)
    rec = json.loads((root / demo.RUN_FILE).read_text())
    assert [s["name"] for s in rec["stages"]] == ["corpus", "training", "index", "held-out check"]
    assert not any(s["reused"] for s in rec["stages"])
    train = rec["stages"][1]
    assert train["model"] == demo.DEMO_MODEL == "gare-cpu-demo" and train["epochs_run"] == 1
    assert len(list((corpus / "videos").glob("*.mp4"))) == 24 and (index / "CURRENT").is_file()
    held = [c for c, _ in demo.heldout_captions(corpus)]
    assert examples == held[:4]
    q = rec["heldout"]
    assert q["queries"] == len(held) > 0 and 0 <= q["hits"] <= q["queries"] and q["k"] == 10
    # the held-out check is the served search: recomputing it gives the same count
    again = demo.heldout_quality(index, corpus, root / "model" / "best.safetensors")
    assert again["hits"] == q["hits"]

    # nothing is rebuilt: generating, training, indexing or the held-out search would fail the second run
    def rebuilt(*args, **kwargs):
        raise AssertionError("the second run rebuilt a stage")

    for name in ("generate_corpus", "Trainer", "index_main", "heldout_quality"):
        monkeypatch.setattr(demo, name, rebuilt)
    outputs = [root / "model" / "best.safetensors", index / "CURRENT", root / demo.QUALITY_FILE]
    before = [(p.stat().st_mtime_ns, p.read_bytes()) for p in outputs]
    demo.prepare(root, n_videos=24, epochs=1)
    assert [(p.stat().st_mtime_ns, p.read_bytes()) for p in outputs] == before
    rec2 = json.loads((root / demo.RUN_FILE).read_text())
    assert all(s["reused"] for s in rec2["stages"]) and rec2["heldout"] == q


@pytest.mark.slow
def test_demo_model_finds_held_out_captions(tmp_path):
    """The README demo as it runs (200 videos, at most 30 epochs): the right video in the top 10 for at least 16
    of the 40 held-out captions (the old 40-epoch gare-cpu-small demo's 16; measured 36 for gare-cpu-demo)."""
    root = tmp_path / "demo"
    demo.prepare(root, n_videos=200, epochs=30)
    q = json.loads((root / demo.RUN_FILE).read_text())["heldout"]
    assert q["queries"] == 40 and q["hits"] >= 16, q
