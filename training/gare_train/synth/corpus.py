"""The corpus: plan every video (scene, captions, rendering, split), render and write the mp4 files, and the
manifests (captions jsonl, MSR-VTT-style json/csv, corpus.json)."""

from __future__ import annotations

import copy
import csv
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from gare.atomic import atomic_write
from gare_train.synth.captions import make_captions
from gare_train.synth.corpus_config import CORPUS_VERSION, SynthConfig
from gare_train.synth.mp4 import write_video
from gare_train.synth.render import near_duplicate_render, random_render, render_scene
from gare_train.synth.scenes import (
    mutate_scene,
    random_scene,
    rng_choice,
    scene_key,
    scene_mutations,
    valid_scene,
)


def corpus_plan(cfg: SynthConfig) -> list[dict[str, Any]]:
    """Scenes, captions and rendering parameters for every video (no pixels yet)."""
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x5EED]))
    n = cfg.n_videos
    n_hard = int(round(n * cfg.hard_negative_rate))
    n_dup = int(round(n * cfg.near_duplicate_rate))
    n_fresh = max(1, n - n_hard - n_dup)
    n_dup = min(n_dup, n - n_fresh)
    n_hard = n - n_fresh - n_dup

    seen: set[tuple[Any, ...]] = set()
    plans: list[dict[str, Any]] = []
    for _ in range(n_fresh):
        for _attempt in range(1000):
            scene = random_scene(rng, cfg)
            if scene_key(scene) not in seen:
                break
        seen.add(scene_key(scene))
        plans.append({"scene": scene, "kind": "fresh", "source": None, "changed": None})

    for _ in range(n_hard):
        for _attempt in range(1000):
            src = int(rng.integers(n_fresh))
            what = rng_choice(rng, scene_mutations(plans[src]["scene"]))
            scene = mutate_scene(plans[src]["scene"], what, rng)
            if valid_scene(scene) and scene_key(scene) not in seen:
                break
        seen.add(scene_key(scene))
        plans.append({"scene": scene, "kind": "hard_negative", "source": src, "changed": what})

    for _ in range(n_dup):
        src = int(rng.integers(n_fresh))
        plans.append(
            {
                "scene": copy.deepcopy(plans[src]["scene"]),
                "kind": "near_duplicate",
                "source": src,
                "changed": None,
            }
        )

    for p in plans:
        if p["kind"] != "near_duplicate":
            p["render"] = random_render(p["scene"], cfg, rng)
    for p in plans:
        if p["kind"] == "near_duplicate":
            p["render"] = near_duplicate_render(plans[p["source"]]["render"], rng)
    for p in plans:
        p["captions"] = make_captions(p["scene"], cfg.captions_per_video, rng)

    # Shuffle so that derived videos are interleaved with fresh ones, then name them.
    order = rng.permutation(len(plans))
    vid_of = {int(old): f"video{new}" for new, old in enumerate(order)}
    for old, p in enumerate(plans):
        p["video_id"] = vid_of[old]
        p["source"] = None if p["source"] is None else vid_of[p["source"]]
    plans = [plans[int(i)] for i in order]

    # Split by groups (a fresh video with its hard negatives and near duplicates) so that the test
    # split contains the hard cases together with what they are confusable with.
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(plans):
        groups.setdefault(p["source"] or p["video_id"], []).append(i)
    n_test = 0 if n < 2 else min(n - 1, max(1, int(round(n * cfg.test_fraction))))
    test: set[int] = set()
    for g in rng.permutation(sorted(groups)):
        if len(test) >= n_test:
            break
        test.update(groups[str(g)])
    if n >= 2 and len(test) == n:  # keep at least one training video
        test.discard(max(test))
    for i, p in enumerate(plans):
        p["split"] = "test" if i in test else "train"
    return plans


def video_attributes(p: dict[str, Any]) -> dict[str, Any]:
    return {
        "video_id": p["video_id"],
        "background": p["scene"]["background"],
        "events": copy.deepcopy(p["scene"]["events"]),
        "kind": p["kind"],
        "source": p["source"],
        "changed": p["changed"],
        "split": p["split"],
    }


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=1, ensure_ascii=False), encoding="utf-8"))


def generate_corpus(
    out_dir: str | os.PathLike[str], cfg: SynthConfig | None = None, progress: bool = True
) -> dict[str, Any]:
    """Write the corpus described by ``cfg`` under ``out_dir`` (see module docstring).

    Returns a summary: ``out_dir``, ``n_videos``, ``train``/``test`` (video ids), and the paths of
    ``videos_dir``, ``manifest`` (captions.jsonl), ``manifest_train``, ``manifest_test``,
    ``msrvtt_data``, ``train_csv``, ``test_csv`` and ``corpus_json``.
    """
    from tqdm import tqdm

    cfg = cfg or SynthConfig()
    out = Path(out_dir)
    videos_dir = out / "videos"
    videos_dir.mkdir(parents=True, exist_ok=True)
    plans = corpus_plan(cfg)
    # Remove videos of an earlier, larger corpus written to the same place (our naming scheme only).
    current = {f"{p['video_id']}.mp4" for p in plans}
    for stale in videos_dir.glob("video*.mp4"):
        if stale.name not in current and stale.name[len("video") : -len(".mp4")].isdigit():
            stale.unlink()

    for p in tqdm(plans, desc="synth videos", unit="video", disable=not progress):
        frames = render_scene(p["scene"], p["render"], cfg)
        final = videos_dir / f"{p['video_id']}.mp4"
        tmp = videos_dir / f".{p['video_id']}.tmp.mp4"
        write_video(tmp, frames, cfg.fps, crf=cfg.crf)
        os.replace(tmp, final)

    rows = [
        {
            "video": f"videos/{p['video_id']}.mp4",
            "captions": list(p["captions"]),
            "attributes": video_attributes(p),
        }
        for p in plans
    ]
    _write_jsonl(out / "captions.jsonl", rows)
    _write_jsonl(
        out / "captions_train.jsonl", [r for r, p in zip(rows, plans, strict=True) if p["split"] == "train"]
    )
    _write_jsonl(
        out / "captions_test.jsonl", [r for r, p in zip(rows, plans, strict=True) if p["split"] == "test"]
    )

    # MSR-VTT layout
    ids_sorted = sorted(plans, key=lambda p: int(p["video_id"][len("video") :]))
    msr_videos = [
        {
            "category": 0,
            "url": "",
            "video_id": p["video_id"],
            "start time": 0.0,
            "end time": cfg.num_frames / cfg.fps,
            "split": "train" if p["split"] == "train" else "test",
            "id": int(p["video_id"][len("video") :]),
        }
        for p in ids_sorted
    ]
    sentences = []
    for p in ids_sorted:
        for c in p["captions"]:
            sentences.append({"caption": c, "video_id": p["video_id"], "sen_id": len(sentences)})
    _write_json(
        out / "MSRVTT_data.json", {"info": {"synthetic": True}, "videos": msr_videos, "sentences": sentences}
    )
    train_ids = [p["video_id"] for p in ids_sorted if p["split"] == "train"]
    test_plans = [p for p in ids_sorted if p["split"] == "test"]
    with open(out / "train.csv", "w", newline="", encoding="utf-8") as f:
        wr = csv.writer(f)
        wr.writerow(["video_id"])
        wr.writerows([[v] for v in train_ids])
    with open(out / "test.csv", "w", newline="", encoding="utf-8") as f:
        wr = csv.writer(f)
        wr.writerow(["key", "vid_key", "video_id", "sentence"])
        for i, p in enumerate(test_plans):
            num = p["video_id"][len("video") :]
            wr.writerow([f"ret{i}", f"msr{num}", p["video_id"], p["captions"][0]])

    corpus = {
        "version": CORPUS_VERSION,
        "config": cfg.to_dict(),
        "train": train_ids,
        "test": [p["video_id"] for p in test_plans],
        "videos": [
            {
                "video_id": p["video_id"],
                "path": f"videos/{p['video_id']}.mp4",
                "split": p["split"],
                "captions": list(p["captions"]),
                "attributes": video_attributes(p),
                "render": p["render"],
            }
            for p in ids_sorted
        ],
    }
    _write_json(out / "corpus.json", corpus)
    return {
        "out_dir": str(out),
        "n_videos": len(plans),
        "train": train_ids,
        "test": corpus["test"],
        "videos_dir": str(videos_dir),
        "manifest": str(out / "captions.jsonl"),
        "manifest_train": str(out / "captions_train.jsonl"),
        "manifest_test": str(out / "captions_test.jsonl"),
        "msrvtt_data": str(out / "MSRVTT_data.json"),
        "train_csv": str(out / "train.csv"),
        "test_csv": str(out / "test.csv"),
        "corpus_json": str(out / "corpus.json"),
    }
