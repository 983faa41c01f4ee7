"""Shared helpers for the robustness tests (tests/test_robust_*.py); holds no tests itself.

The fixtures are made the real way (a tiny GARE checkpoint saved with ``save_checkpoint``, real H.264 mp4
files from ``training.synth``, indexes written by ``indexer.build``) once per test process. Tests that
produce a figure for docs/robustness.md call :func:`record`; ``bench/robustness.py`` sets
``GARE_ROBUST_RESULTS`` to a folder and collects the files written there (without it, nothing is written).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS_ENV = "GARE_ROBUST_RESULTS"
N_CORPUS = 24  # videos generated once; tests take libraries from them
N_BASE = 12  # videos in the shared base index
_LOCK = threading.Lock()
_SHARED: dict[str, Any] = {}


def record(name: str, data: dict[str, Any]) -> None:
    """Store a figure for bench/robustness.py (a no-op unless GARE_ROBUST_RESULTS names a folder)."""
    out = os.environ.get(RESULTS_ENV)
    if not out:
        return
    p = Path(out)
    p.mkdir(parents=True, exist_ok=True)
    (p / f"{name}.json").write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")


def load_bench_module(name: str):
    """Import bench/<name>.py (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"gare_bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def shared() -> dict[str, Any]:
    """{root, checkpoint, videos (N_CORPUS mp4 files), base_lib (N_BASE of them), base_index}; built once per
    process, read-only for tests (copy what you change)."""
    with _LOCK:
        if not _SHARED:
            from test_index_common import make_checkpoint, make_corpus

            from indexer.build import BuildOptions, build

            root = Path(tempfile.mkdtemp(prefix="gare-robust-"))
            import atexit

            atexit.register(shutil.rmtree, root, True)
            ckpt = make_checkpoint(root / "tiny.safetensors")
            videos = make_corpus(root / "corpus", n=N_CORPUS)
            base_lib = root / "base_lib"
            base_lib.mkdir()
            for i in range(N_BASE):
                shutil.copy2(videos / f"video{i}.mp4", base_lib / f"video{i}.mp4")
            base_index = root / "base_index"
            build(str(ckpt), str(base_lib), str(base_index), BuildOptions(workers=0, progress=False))
            _SHARED.update(root=root, checkpoint=ckpt, videos=videos, base_lib=base_lib, base_index=base_index)
        return dict(_SHARED)


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def copy_index(dst: Path) -> Path:
    """A private copy of the shared base index (its work/ cache and locks included)."""
    return copy_tree(shared()["base_index"], dst)


def copy_lib(dst: Path, names: list[str] | None = None) -> Path:
    """A private copy of the base library (or of the named corpus videos)."""
    sh = shared()
    dst.mkdir(parents=True, exist_ok=True)
    if names is None:
        for p in sorted(sh["base_lib"].glob("*.mp4")):
            shutil.copy2(p, dst / p.name)
    else:
        for n in names:
            shutil.copy2(sh["videos"] / n, dst / n)
    return dst


def index_cli(*args: str) -> tuple[int, str, str]:
    """`gare-index ARGS` in this process (indexer.cli.main): (exit code, stdout, stderr)."""
    from indexer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def index_contents(index: Path) -> dict[str, Any]:
    """What the current version holds: {version, n, ids, paths (sorted), checksums by path}."""
    from indexer.store import open_index

    v = open_index(index, use_gpu=False)
    try:
        rows = v.all_metadata()
        return {
            "version": v.name,
            "n": v.n,
            "ids": sorted(int(r["id"]) for r in rows),
            "paths": sorted(r["path"] for r in rows),
            "checksums": {r["path"]: r["checksum"] for r in rows},
        }
    finally:
        v.close()


def lib_files(lib: Path) -> list[str]:
    return sorted(str(p.absolute()) for p in lib.glob("*.mp4"))


def assert_exactly_once(index: Path, lib: Path) -> dict[str, Any]:
    """The current version holds every video of `lib` exactly once (paths and ids unique) and nothing else."""
    c = index_contents(index)
    want = lib_files(lib)
    assert len(set(c["paths"])) == len(c["paths"]), f"a path is indexed twice: {c['paths']}"
    assert len(set(c["ids"])) == len(c["ids"]) == c["n"]
    assert c["paths"] == want, f"index {c['version']} holds {c['paths']}, the library {want}"
    from indexer.store import file_sha256

    for p in want:  # and each entry is the file's current content
        assert c["checksums"][p] == file_sha256(p), f"{p}: stale entry"
    return c


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Stopwatch:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    @property
    def s(self) -> float:
        return round(time.perf_counter() - self.t0, 2)
