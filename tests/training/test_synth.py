"""gare_train.synth: a deterministic corpus of real mp4 files with consistent captions and hard cases."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest

from gare.video import probe_video
from gare_train import synth
from gare_train.synth import SynthConfig, captions, generate_corpus, scenes, write_video
from gare_train.synth import corpus as synth_corpus

CFG = SynthConfig(
    n_videos=20,
    seed=7,
    duration=2.0,
    captions_per_video=3,
    hard_negative_rate=0.25,
    near_duplicate_rate=0.15,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "corpus"
    summary = generate_corpus(out, CFG, progress=False)
    rows = [json.loads(line) for line in (out / "captions.jsonl").read_text().splitlines()]
    return out, summary, rows


def _decode_all(path: Path) -> np.ndarray:
    import decord

    vr = decord.VideoReader(str(path), num_threads=1)
    return vr.get_batch(list(range(len(vr)))).asnumpy()


# --------------------------------------------------------------------------------------------------


def test_files_and_counts(corpus):
    out, summary, rows = corpus
    videos = sorted((out / "videos").glob("*.mp4"))
    assert len(videos) == len(rows) == summary["n_videos"] == CFG.n_videos
    assert not list((out / "videos").glob(".*"))  # no temporary files left behind
    assert all(len(r["captions"]) == CFG.captions_per_video for r in rows)
    assert all(len(set(r["captions"])) == len(r["captions"]) for r in rows)  # paraphrases are distinct
    kinds = [r["attributes"]["kind"] for r in rows]
    assert kinds.count("hard_negative") == round(CFG.n_videos * CFG.hard_negative_rate)
    assert kinds.count("near_duplicate") == round(CFG.n_videos * CFG.near_duplicate_rate)
    for name in (
        "captions.jsonl",
        "captions_train.jsonl",
        "captions_test.jsonl",
        "MSRVTT_data.json",
        "train.csv",
        "test.csv",
        "corpus.json",
    ):
        assert (out / name).is_file(), name
    assert Path(summary["manifest"]) == out / "captions.jsonl"


def test_videos_decode_with_decord(corpus):
    out, _, rows = corpus
    for r in rows:
        path = out / r["video"]  # relative to the manifest
        info = probe_video(path)
        assert info.num_frames == CFG.num_frames == 16
        assert info.fps == pytest.approx(CFG.fps)
        assert (info.width, info.height) == (CFG.width, CFG.height)


def test_deterministic(corpus, tmp_path):
    out, _, _ = corpus
    again = tmp_path / "again"
    generate_corpus(again, CFG, progress=False)
    for name in ("captions.jsonl", "MSRVTT_data.json", "train.csv", "test.csv", "corpus.json"):
        assert (out / name).read_text() == (again / name).read_text(), name
    for vid in (f"video{i}" for i in range(CFG.n_videos)):
        a, b = _decode_all(out / "videos" / f"{vid}.mp4"), _decode_all(again / "videos" / f"{vid}.mp4")
        assert np.array_equal(a, b), vid
    # and the scene generator itself is a pure function of the config
    p1, p2 = synth_corpus.corpus_plan(CFG), synth_corpus.corpus_plan(CFG)
    assert np.array_equal(
        synth.render_scene(p1[3]["scene"], p1[3]["render"], CFG),
        synth.render_scene(p2[3]["scene"], p2[3]["render"], CFG),
    )


def test_different_seed_differs():
    a = synth_corpus.corpus_plan(CFG)
    b = synth_corpus.corpus_plan(SynthConfig(**{**CFG.to_dict(), "seed": CFG.seed + 1}))
    assert [p["captions"] for p in a] != [p["captions"] for p in b]


def test_encoded_video_is_close_to_rendered(corpus):
    out, _, _ = corpus
    plans = {p["video_id"]: p for p in synth_corpus.corpus_plan(CFG)}
    p = plans["video5"]
    rendered = synth.render_scene(p["scene"], p["render"], CFG).astype(np.float32)
    decoded = _decode_all(out / "videos" / "video5.mp4").astype(np.float32)
    assert decoded.shape == rendered.shape
    assert np.abs(decoded - rendered).mean() < 4.0  # lossy, but the same pictures


# --------------------------------------------------------------------------------------------------
# captions vs attributes


def _has_any(text: str, phrases) -> bool:
    return any(re.search(rf"\b{re.escape(p)}\b", text) for p in phrases)


def _first_pos(text: str, phrases) -> int:
    hits = [m.start() for p in phrases for m in re.finditer(rf"\b{re.escape(p)}\b", text)]
    return min(hits) if hits else -1


def test_captions_describe_attributes(corpus):
    _, _, rows = corpus
    n_two = 0
    for r in rows:
        a = r["attributes"]
        events = a["events"]
        assert a["background"] in synth.BACKGROUNDS and 1 <= len(events) <= 2
        for cap in r["captions"]:
            assert cap == cap.lower() and "  " not in cap
            assert _has_any(cap, captions.BG_WORDS[a["background"]]), cap
            for e in events:
                assert set(e) == set(synth.EVENT_FIELDS)
                assert _has_any(cap, captions.COLOR_WORDS[e["color"]]), (cap, e)
                nouns = [s if e["count"] == 1 else p for s, p in captions.SHAPE_WORDS[e["shape"]]]
                assert _has_any(cap, nouns), (cap, e)
                verbs = [s if e["count"] == 1 else p for s, p in captions.MOTION_WORDS[e["motion"]]]
                assert _has_any(cap, verbs), (cap, e)
                if e["count"] > 1:
                    assert _has_any(cap, captions.COUNT_WORDS[e["count"]]), (cap, e)
                if e["motion"] != "still":
                    assert _has_any(cap, captions.SPEED_PRE[e["speed"]] + captions.SPEED_POST[e["speed"]]), (
                        cap,
                        e,
                    )
            if len(events) == 2 and events[0]["color"] != events[1]["color"]:
                # Time order is stated: "A, then B" / "A before B" / "after A, B" name A first; "B after A" not.
                n_two += 1
                first = _first_pos(cap, captions.COLOR_WORDS[events[0]["color"]])
                second = _first_pos(cap, captions.COLOR_WORDS[events[1]["color"]])
                reversed_text = re.search(r"\w after (?!that)", cap) is not None
                assert (first < second) != reversed_text, cap
    assert n_two > 0


def test_hard_negatives_differ_in_exactly_one_attribute(corpus):
    _, _, rows = corpus
    by_id = {r["attributes"]["video_id"]: r["attributes"] for r in rows}
    hard = [a for a in by_id.values() if a["kind"] == "hard_negative"]
    assert hard
    for a in hard:
        src = by_id[a["source"]]
        assert src["kind"] == "fresh" and src["split"] == a["split"]
        fa = synth.flatten_scene(a)
        fs = synth.flatten_scene(src)
        if a["changed"] == "order":
            assert a["background"] == src["background"] and a["events"] == src["events"][::-1]
            assert a["events"] != src["events"]
        else:
            diff = {k for k in fa if fa[k] != fs.get(k)}
            assert diff == {a["changed"]}, (a, src)
        assert synth.scene_key(a) != synth.scene_key(src)  # a visible change
    # every scene that is not a near duplicate is unique
    keys = [synth.scene_key(a) for a in by_id.values() if a["kind"] != "near_duplicate"]
    assert len(keys) == len(set(keys))


def test_mutations_cover_every_attribute():
    rng = np.random.default_rng(0)
    scene = {
        "background": "black",
        "events": [
            {"shape": "circle", "color": "red", "count": 1, "motion": "up", "speed": "slow"},
            {"shape": "square", "color": "blue", "count": 2, "motion": "still", "speed": "fast"},
        ],
    }
    whats = scenes.scene_mutations(scene)
    assert "order" in whats and "event1.speed" not in whats  # speed of a still event is invisible
    for what in whats:
        new = synth.mutate_scene(scene, what, rng)
        if what != "order":
            f0, f1 = synth.flatten_scene(scene), synth.flatten_scene(new)
            assert {k for k in f0 if f0[k] != f1[k]} == {what}


def test_near_duplicates(corpus):
    out, _, rows = corpus
    by_id = {r["attributes"]["video_id"]: r for r in rows}
    dups = [r for r in rows if r["attributes"]["kind"] == "near_duplicate"]
    assert dups
    frames = {vid: _decode_all(out / r["video"]).astype(np.float32) for vid, r in by_id.items()}
    for r in dups:
        a = r["attributes"]
        src = by_id[a["source"]]["attributes"]
        assert synth.scene_key(a) == synth.scene_key(src) and a["split"] == src["split"]
        d_src = np.abs(frames[a["video_id"]] - frames[a["source"]]).mean()
        d_other = min(
            np.abs(frames[a["video_id"]] - frames[v]).mean()
            for v in frames
            if v not in (a["video_id"], a["source"])
        )
        assert 0 < d_src < d_other


# --------------------------------------------------------------------------------------------------
# annotation files


def test_msrvtt_files(corpus):
    out, summary, rows = corpus
    data = json.loads((out / "MSRVTT_data.json").read_text())
    ids = {r["attributes"]["video_id"] for r in rows}
    assert {v["video_id"] for v in data["videos"]} == ids
    assert len(data["sentences"]) == CFG.n_videos * CFG.captions_per_video
    assert [s["sen_id"] for s in data["sentences"]] == list(range(len(data["sentences"])))
    caps = {r["attributes"]["video_id"]: r["captions"] for r in rows}
    for s in data["sentences"]:
        assert s["caption"] in caps[s["video_id"]]

    with open(out / "train.csv", newline="") as f:
        train = list(csv.DictReader(f))
    with open(out / "test.csv", newline="") as f:
        reader = csv.DictReader(f)
        test = list(reader)
    assert reader.fieldnames == ["key", "vid_key", "video_id", "sentence"]
    assert (out / "train.csv").read_text().splitlines()[0] == "video_id"
    train_ids = [r["video_id"] for r in train]
    test_ids = [r["video_id"] for r in test]
    assert train_ids == summary["train"] and test_ids == summary["test"]
    assert set(train_ids).isdisjoint(test_ids) and set(train_ids) | set(test_ids) == ids
    assert len(test_ids) == len(set(test_ids)) == round(CFG.n_videos * CFG.test_fraction)
    for i, r in enumerate(test):
        assert r["key"] == f"ret{i}" and r["vid_key"] == "msr" + r["video_id"][len("video") :]
        assert r["sentence"] in caps[r["video_id"]]
    split = {v["video_id"]: v["split"] for v in data["videos"]}
    assert all(split[v] == "test" for v in test_ids) and all(split[v] == "train" for v in train_ids)


def test_manifests_and_corpus_json(corpus):
    out, summary, rows = corpus
    for r in rows:
        assert set(r) == {"video", "captions", "attributes"}
        assert r["video"].startswith("videos/") and (out / r["video"]).is_file()
        assert all(isinstance(c, str) and c for c in r["captions"])
    train = [json.loads(x) for x in (out / "captions_train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (out / "captions_test.jsonl").read_text().splitlines()]
    assert len(train) + len(test) == len(rows)
    assert {r["attributes"]["video_id"] for r in test} == set(summary["test"])
    c = json.loads((out / "corpus.json").read_text())
    assert SynthConfig.from_dict(c["config"]) == CFG
    assert [v["video_id"] for v in c["videos"]] == [f"video{i}" for i in range(CFG.n_videos)]
    assert c["train"] == summary["train"] and c["test"] == summary["test"]


# --------------------------------------------------------------------------------------------------
# config, presets, write_video


def test_config_validation_and_presets():
    assert set(synth.presets) >= {"tiny", "bench"}
    assert all(isinstance(p, SynthConfig) for p in synth.presets.values())
    assert synth.presets["bench"].n_videos > synth.presets["tiny"].n_videos
    assert SynthConfig().width % 2 == 0 and SynthConfig().num_frames == 32
    for bad in (
        {"width": 95},
        {"n_videos": 0},
        {"hard_negative_rate": 1.5},
        {"fps": 0},
        {"hard_negative_rate": 0.6, "near_duplicate_rate": 0.4},
        {"width": 48},
    ):
        with pytest.raises(ValueError):
            SynthConfig(**bad)
    with pytest.raises(ValueError):
        SynthConfig.from_dict({"nope": 1})


def test_tiny_corpus_edge_cases(tmp_path):
    generate_corpus(tmp_path / "one", SynthConfig(n_videos=3, seed=1, duration=1.0), progress=False)
    s = generate_corpus(tmp_path / "one", SynthConfig(n_videos=1, seed=1, duration=1.0), progress=False)
    assert s["n_videos"] == 1 and s["test"] == [] and len(s["train"]) == 1
    assert [p.name for p in (tmp_path / "one" / "videos").iterdir()] == ["video0.mp4"]  # stale ones removed
    s = generate_corpus(
        tmp_path / "two",
        SynthConfig(n_videos=2, seed=1, duration=1.0, hard_negative_rate=0.5),
        progress=False,
    )
    assert len(s["train"]) >= 1 and len(s["test"]) >= 1


def test_write_video_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    frames = np.repeat(rng.integers(0, 256, size=(5, 1, 1, 3), dtype=np.uint8), 32, axis=1).repeat(64, axis=2)
    path = write_video(tmp_path / "sub" / "v.mp4", frames, 12.5)
    info = probe_video(path)
    assert (info.num_frames, info.width, info.height) == (5, 64, 32)
    assert info.fps == pytest.approx(12.5)
    decoded = _decode_all(path).astype(np.float32)
    assert np.abs(decoded - frames.astype(np.float32)).mean() < 6  # flat colours survive yuv420p
    with pytest.raises(ValueError):
        write_video(tmp_path / "odd.mp4", np.zeros((2, 31, 48, 3), np.uint8), 8)
    with pytest.raises(ValueError):
        write_video(tmp_path / "float.mp4", np.zeros((2, 32, 48, 3), np.float32), 8)
