"""Shared helpers for the Ray Serve tests (no tests here): a sharded index next to a single one over the same
videos, and the answers compared by video file (the two number their videos differently)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from gare_index.shards import shard_of, shard_root, write_generation
from gare_index.store import current_version_name, open_index
from tests.service.support import build_index


def build_sharded_by_hand(ckpt: Path, videos: Path, checksums: dict[str, str], root: Path, n: int) -> Path:
    """A sharded root built as N normal flat indexes over the partition by shard_of(file sha256, N), then one
    generation naming their versions (what `gare-index build --shards N` writes, NCL biases fitted per shard)."""
    parts: dict[int, list[str]] = {}
    for name, sha in checksums.items():
        parts.setdefault(shard_of(sha, n), []).append(name)
    assert sorted(parts) == list(range(n)), f"an empty shard for n={n}: {parts}"
    versions = []
    for s in range(n):
        src = root / "videos" / f"s{s}"
        src.mkdir(parents=True)
        for name in parts[s]:
            shutil.copy2(videos / name, src / name)
        build_index(ckpt, src, shard_root(root, s), index_type="flat")
        versions.append(current_version_name(shard_root(root, s)))
    write_generation(root, versions)
    return root


def make_sharded_env(service_env: dict[str, Any], base: Path, counts: tuple[int, ...]) -> dict[str, Any]:
    """{single: a flat index over the service corpus, sharded: {n: root}, checkpoint, captions}."""
    ckpt, videos = service_env["checkpoint"], service_env["videos"]
    single = build_index(ckpt, videos, base / "single", index_type="flat")
    with open_index(single) as v:
        checksums = {Path(r["path"]).name: r["checksum"] for r in v.all_metadata()}
    sharded = {n: build_sharded_by_hand(ckpt, videos, checksums, base / f"n{n}", n) for n in counts}
    return dict(single=single, sharded=sharded, checkpoint=ckpt, captions=service_env["captions"], videos=videos)


def by_name(results: list[dict[str, Any]]) -> list[tuple[str, float, float, float | None, float]]:
    """A response's hits as (file name, score, ann_score, psi_score, bias): comparable across numberings."""
    return [(h["metadata"]["name"], h["score"], h["ann_score"], h["psi_score"], h["bias"]) for h in results]


def assert_same(want: list[dict[str, Any]], got: list[dict[str, Any]], *, bias: bool = False, tol: float = 1e-5) -> None:
    """Same videos in the same order with the same scores; ``bias``: the NCL biases too (hand-built shards fit
    their biases per shard, the builder over the whole gallery)."""
    a, b = by_name(want), by_name(got)
    assert [x[0] for x in a] == [x[0] for x in b], (a, b)
    for x, y in zip(a, b, strict=True):
        for i in (1, 2, 4) if bias else (1, 2):
            assert abs(x[i] - y[i]) <= tol, (x, y)
        assert (x[3] is None) == (y[3] is None) and (x[3] is None or abs(x[3] - y[3]) <= tol), (x, y)
