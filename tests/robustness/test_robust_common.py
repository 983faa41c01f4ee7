"""Shared helpers for the robustness tests (tests/robustness/test_robust_*.py); holds no tests itself.

The fixtures are made the real way (a tiny GARE checkpoint saved with ``save_checkpoint``, real H.264 mp4
files from ``gare_train.synth``, indexes written by ``gare_build.build``) once per test run, by the session fixtures
``robust_env`` (:func:`make_robust_env`) and ``live_env`` (:func:`start_live_server`) of
tests/robustness/conftest.py; the helpers below take that ``env`` dict. Tests that
produce a figure for docs/robustness.md call :func:`record`; ``bench/robustness.py`` sets
``GARE_ROBUST_RESULTS`` to a folder and collects the files written there (without it, nothing is written).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from tests.checkout import CHECKOUT_PATH

REPO = Path(__file__).resolve().parents[2]
RESULTS_ENV = "GARE_ROBUST_RESULTS"
N_CORPUS = 48  # videos generated once; tests take libraries from them
N_BASE = 12  # videos in the shared base index
LIVE_KEY = "robust-live-admin-key"  # GARE_API_KEYS of the shared live server


def record(name: str, data: dict[str, Any]) -> None:
    """Store a figure for bench/robustness.py (a no-op unless GARE_ROBUST_RESULTS names a folder)."""
    out = os.environ.get(RESULTS_ENV)
    if not out:
        return
    p = Path(out)
    p.mkdir(parents=True, exist_ok=True)
    (p / f"{name}.json").write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")


@contextlib.contextmanager
def recording(name: str, **initial: Any):
    """Collect a figure while the test runs and record it even when the test fails: ``with recording("x") as
    fig: fig["rows"].append(...)``. A failure adds ``error`` (the exception), so the report shows what was
    observed up to the failure and why it stopped, never a figure that only exists when everything passed."""
    fig: dict[str, Any] = dict(initial)
    try:
        yield fig
    except BaseException as e:
        fig["error"] = f"{type(e).__name__}: {e}"[:600]
        raise
    finally:
        record(name, fig)


def make_robust_env(root: Path, checkpoint: Path) -> dict[str, Any]:
    """{root, checkpoint, videos (N_CORPUS mp4 files), base_lib (N_BASE of them), base_index} under `root`;
    read-only for tests (copy what you change). The session fixture ``robust_env`` builds it once."""
    from gare_build.build import BuildOptions, build
    from tests.indexer.support import make_corpus

    videos = make_corpus(root / "corpus", n=N_CORPUS)
    base_lib = root / "base_lib"
    base_lib.mkdir()
    for i in range(N_BASE):
        shutil.copy2(videos / f"video{i}.mp4", base_lib / f"video{i}.mp4")
    base_index = root / "base_index"
    build(str(checkpoint), str(base_lib), str(base_index), BuildOptions(workers=0, progress=False))
    return dict(root=root, checkpoint=checkpoint, videos=videos, base_lib=base_lib, base_index=base_index)


def start_live_server(env: dict[str, Any], root: Path) -> dict[str, Any]:
    """{srv, index, lib, key}: a `gare-serve` process on 127.0.0.1 over a private copy of the base index, under
    `root` (the session fixture ``live_env`` starts one per test run and stops it at the end). Tests may change
    the index and the library (adding versions, reloading) but leave CURRENT a good version holding the library."""
    from tests.service.support import UvicornProcess

    idx, lib = private_index(env, root)
    # result cache off: the load checks replay a fixed set of queries, and every request must run the search
    # (encoder, ANN, rerank) rather than a cache lookup; the result cache has its own tests (tests/service)
    srv = UvicornProcess(["--index", str(idx), "--log-level", "warning", "--batch-max-wait-ms", "2",
                          "--result-cache-entries", "0"], env={"GARE_API_KEYS": LIVE_KEY})
    srv.__enter__()
    return dict(srv=srv, index=idx, lib=lib, key=LIVE_KEY)


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def copy_index(env: dict[str, Any], dst: Path) -> Path:
    """A private copy of the shared base index (its work/ cache and locks included)."""
    return copy_tree(env["base_index"], dst)


def private_index(env: dict[str, Any], dst: Path) -> tuple[Path, Path]:
    """(index, library) under `dst`: a copy of the base library and an index of exactly it (the base index
    copied, then `gare-index build` over the copy: every feature is reused, nothing is encoded)."""
    lib = copy_lib(env, dst / "lib")
    idx = copy_index(env, dst / "index")
    rc, out, err = index_cli("build", "--checkpoint", str(env["checkpoint"]), "--videos", str(lib), "--out",
                             str(idx), "--workers", "0", "--no-progress")
    assert rc == 0, (out, err)
    return idx, lib


def copy_lib(env: dict[str, Any], dst: Path, names: list[str] | None = None) -> Path:
    """A private copy of the base library (or of the named corpus videos)."""
    sh = env
    dst.mkdir(parents=True, exist_ok=True)
    if names is None:
        for p in sorted(sh["base_lib"].glob("*.mp4")):
            shutil.copy2(p, dst / p.name)
    else:
        for n in names:
            shutil.copy2(sh["videos"] / n, dst / n)
    return dst


def running_app(app):
    """The app's lifespan + an in-process client that sees a 500 as a 500 (not as the app's exception)."""
    from tests.service.support import running_app as in_process

    return in_process(app, raise_app_exceptions=False)


def index_cli(*args: str) -> tuple[int, str, str]:
    """`gare-index ARGS` in this process (gare_build.cli.main): (exit code, stdout, stderr)."""
    from gare_build.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


_WORKER_SRC = r"""
import contextlib, io, json, sys
from gare_build.cli import main
for line in sys.stdin:
    args = json.loads(line)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(args)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 2
    sys.__stdout__.write(json.dumps({"rc": rc, "out": out.getvalue(), "err": err.getvalue()}) + "\n")
    sys.__stdout__.flush()
"""


class IndexWorker:
    """`gare-index` commands run one after another in a child process that stays up (no start-up cost per
    command) and is replaced when a command kills it: a crash (e.g. SIGBUS) cannot take the tests down.

    ``run(*args)`` -> {"rc", "out", "err", "signal"}: rc is None and signal the signal number after a crash."""

    def __init__(self) -> None:
        self.proc: Any = None
        self.starts = 0

    def _start(self) -> None:
        import subprocess

        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=CHECKOUT_PATH + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("GARE_INDEX_TEST_PAUSE", None)
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_SRC], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.starts += 1

    def run(self, *args: str, timeout: float = 300.0) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        p = self.proc
        p.stdin.write(json.dumps(list(args)) + "\n")
        p.stdin.flush()
        line = p.stdout.readline()  # the answer, or "" when the child died
        if line:
            return {**json.loads(line), "signal": None}
        p.wait(timeout=timeout)
        err = p.stderr.read()
        self.proc = None
        return {"rc": None, "out": "", "err": err[-4000:], "signal": -p.returncode if p.returncode < 0 else None,
                "exit": p.returncode}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> IndexWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def index_contents(index: Path) -> dict[str, Any]:
    """What the current version holds: {version, n, ids, paths (sorted), checksums by path}."""
    from gare_index.store import open_index

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
    from gare_index.store import file_sha256

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
