"""Faults: SIGKILL of `gare-index` at random points, tampered index files, a full disk, reload of a bad version.

* Kill: for each seed the library changes (videos added, deleted, rewritten), a random `gare-index`
  command (build / add / remove) is started as a subprocess and SIGKILLed (with its decode workers) at a
  random offset from a random anchor (process start, encoder start, version write, CURRENT switch). After
  every kill `gare-index verify` passes, CURRENT names a complete version, a live `gare-serve` keeps
  answering (a prober sends searches all along) and serves CURRENT after a reload, and a resumed
  `gare-index build` ends with every video of the library exactly once. Fast: 3 seeds; slow: 24.
* Tampering: every file of a version truncated or altered (same size) is reported by `gare-index verify`
  (exit 1, naming the file); `POST /v1/admin/reload` refuses a version with a truncated file (503, "still
  serving ...") and the service keeps answering from the previous one; with `verify_index` it also refuses
  same-size alterations.
* Disk full: a small tmpfs (mounted by the test, unmounted in a finally) filled to leave 0..N KiB free;
  `gare-index build` either succeeds or fails with exit 1 and a "No space left" / "disk is full" message,
  CURRENT untouched, verify passing, nothing left behind; after space is freed the same command succeeds.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from indexer.store import current_version_name, list_versions, verify_index
from tests.indexer.support import cli_env
from tests.robustness.test_robust_common import (
    LIVE_KEY,
    IndexWorker,
    Stopwatch,
    assert_exactly_once,
    copy_index,
    index_cli,
    index_contents,
    live_server,
    private_index,
    record,
    shared,
)
from tests.service.support import running_app
from tests.service.support import settings as svc_settings

KEY = LIVE_KEY
ANCHORS = ("start", "encode", "write", "switch")
PAUSE_S = 0.3  # how long the process is held at the write / switch anchor


# ------------------------------------------------------------------------------------------ live server
class Prober:
    """Sends a search every `period` seconds in a thread; every answer must be a 200."""

    def __init__(self, base_url: str, period: float = 0.1) -> None:
        self.base_url, self.period = base_url, period
        self.status: dict[str, int] = {}
        self.versions: set[str] = set()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30) as c:
            while not self._stop.is_set():
                try:
                    r = c.post("/v1/search", json={"query": "a red circle rises", "k": 3})
                    self.status[str(r.status_code)] = self.status.get(str(r.status_code), 0) + 1
                    if r.status_code == 200:
                        self.versions.add(r.json()["index_version"])
                except httpx.HTTPError as e:
                    self.errors.append(f"{type(e).__name__}: {e}")
                self._stop.wait(self.period)

    def __enter__(self) -> Prober:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(timeout=30)

    @property
    def total(self) -> int:
        return sum(self.status.values())


@pytest.fixture(scope="module")
def live():
    live = live_server()  # gare-serve on 127.0.0.1, shared with the other robustness tests of this process
    yield live["srv"], live["index"], live["lib"]


def _reload(srv) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/admin/reload", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _search(srv) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/search", json={"query": "two blue squares", "k": 3}, timeout=60)


# ------------------------------------------------------------------------------------------ kill
def _work_shards(idx: Path) -> int:
    return len(list((idx / "work").glob("*/shard-*.npz")))


def _mutate_library(rng: random.Random, lib: Path, pool: list[str]) -> list[str]:
    """Add 1-3 corpus videos, maybe delete one, maybe rewrite one with other content; returns what was done."""
    videos = shared()["videos"]
    done = []
    present = sorted(p.name for p in lib.glob("*.mp4"))
    for name in rng.sample(pool, min(len(pool), rng.choice((1, 2, 3)))):
        shutil.copy2(videos / name, lib / name)
        pool.remove(name)
        done.append(f"+{name}")
    if len(present) > 6 and rng.random() < 0.3:
        name = rng.choice(present)
        (lib / name).unlink()
        pool.append(name)
        present.remove(name)
        done.append(f"-{name}")
    if present and rng.random() < 0.5:
        name, src = rng.choice(present), rng.choice(sorted(p.name for p in videos.glob("*.mp4")))
        if name != src:
            shutil.copyfile(videos / src, lib / name)  # same path, new content (and a new mtime)
            done.append(f"~{name}<-{src}")
    return done


def _kill_run(args: list[str], anchor: str, delay: float, tmp: Path, timeout: float = 120.0) -> dict:
    """Start `gare-index ARGS`, SIGKILL its process group `delay` s after `anchor`; what happened."""
    env = cli_env()
    marker = tmp / "pause-marker"
    marker.unlink(missing_ok=True)
    if anchor in ("write", "switch"):
        env.update(GARE_INDEX_TEST_PAUSE=anchor, GARE_INDEX_TEST_PAUSE_FILE=str(marker),
                   GARE_INDEX_TEST_PAUSE_SECONDS=str(PAUSE_S))
    proc = subprocess.Popen([sys.executable, "-m", "indexer.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    encoding = threading.Event()

    def read_err() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if "clips to index" in line:
                encoding.set()

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    t0 = time.monotonic()
    deadline = t0 + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if anchor == "start" or (anchor == "encode" and encoding.is_set()) or marker.exists():
            break
        time.sleep(0.01)
    t_anchor = time.monotonic()
    while proc.poll() is None and time.monotonic() < t_anchor + delay:
        time.sleep(0.005)
    killed = proc.poll() is None
    if killed:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the command and its decode workers (its own session)
    out = proc.stdout.read() if proc.stdout else ""  # type: ignore[union-attr]
    proc.wait(timeout=60)
    reader.join(timeout=10)
    return {"killed": killed, "rc": proc.returncode, "after_s": round(time.monotonic() - t0, 2),
            "stdout": out, "stderr": "".join(lines)}


def _landing(before: dict, idx: Path, run: dict) -> str:
    if not run["killed"]:
        return "completed before the kill"
    now = current_version_name(idx) if (idx / "CURRENT").exists() else None
    vdir = idx / "versions"
    if any(p.name.startswith(".tmp-") for p in vdir.iterdir()):
        return "inside the version write"
    if now != before["current"]:
        return "after the CURRENT switch"
    if set(list_versions(idx)) - set(before["versions"]):
        return "after the rename, before the switch"
    if _work_shards(idx) > before["shards"]:
        return "while encoding (work cache committed)"
    return "start-up, scan or encode (nothing committed)"


def run_kill_seeds(live, tmp_path: Path, seeds: list[int], name: str) -> dict:
    srv, idx, lib = live
    ckpt = str(shared()["checkpoint"])
    all_videos = sorted(p.name for p in shared()["videos"].glob("*.mp4"))
    pool = [n for n in all_videos if not (lib / n).exists()]
    rounds = []
    sw = Stopwatch()
    with Prober(srv.base_url) as prober:
        for seed in seeds:
            rng = random.Random(seed)
            changes = _mutate_library(rng, lib, pool)
            cmd = rng.choices(("build", "add", "remove"), weights=(5, 3, 2))[0]
            anchor = ANCHORS[seed % len(ANCHORS)]
            if cmd == "remove":
                victim = rng.choice(index_contents(idx)["paths"])
                args = ["remove", "--out", str(idx), victim]
                anchor = "start" if anchor == "encode" else anchor
            else:
                args = [cmd, "--videos", str(lib), "--out", str(idx), "--no-progress",
                        "--workers", str(rng.choice((0, 1, 2))), "--batch-size", str(rng.choice((1, 2, 4)))]
                if cmd == "build":
                    args[1:1] = ["--checkpoint", ckpt]
            # offsets spread over what follows each anchor: start-up (~2-4 s), encoding (a few videos, well under
            # a second), and the version write / the CURRENT switch, where the process is held for PAUSE_S by
            # GARE_INDEX_TEST_PAUSE (they last milliseconds), so the kill lands there or anywhere after them
            delay = {"start": rng.uniform(0.0, 3.0), "encode": rng.uniform(0.0, 0.8), "write": rng.uniform(0.0, 0.6),
                     "switch": rng.uniform(0.0, 0.6)}[anchor]
            before = {"current": current_version_name(idx), "versions": list_versions(idx), "shards": _work_shards(idx)}
            run = _kill_run(args, anchor, delay, tmp_path)
            assert run["killed"] or run["rc"] in (0, 3), run
            landing = _landing(before, idx, run)

            # the index verifies, CURRENT names a complete version, and no entry is there twice
            rc, out, err = index_cli("verify", "--out", str(idx))
            assert rc == 0, (seed, landing, out, err, run["stderr"][-2000:])
            cur = current_version_name(idx)
            assert cur in list_versions(idx)
            c = index_contents(idx)
            assert len(set(c["paths"])) == c["n"] == len(set(c["ids"]))
            # the service kept serving, and serves CURRENT after a reload
            r = _reload(srv)
            assert r.status_code == 200, r.text
            s = _search(srv)
            assert s.status_code == 200 and s.json()["index_version"] == cur, s.text

            # a resumed run ends with every video exactly once
            rc, out, err = index_cli("build", "--checkpoint", ckpt, "--videos", str(lib), "--out", str(idx),
                                     "--workers", "0", "--no-progress")
            assert rc == 0, (seed, out, err)
            report = json.loads((idx / "report.json").read_text())
            final = assert_exactly_once(idx, lib)
            assert _reload(srv).status_code == 200
            s = _search(srv)
            assert s.status_code == 200 and s.json()["index_version"] == final["version"]
            rounds.append({
                "seed": seed, "changes": changes, "command": cmd, "anchor": anchor, "delay_s": round(delay, 3),
                "killed_after_s": run["after_s"], "landing": landing, "verify_ok": True,
                "served_version": cur, "resumed": {k: report.get(k) for k in ("encoded", "from_cache", "from_index")},
                "n_after_resume": final["n"], "exactly_once": True,
            })
    assert not prober.errors, prober.errors
    assert prober.total > 0 and set(prober.status) == {"200"}, prober.status
    landings: dict[str, int] = {}
    for r in rounds:
        landings[r["landing"]] = landings.get(r["landing"], 0) + 1
    fig = {
        "seeds": len(seeds), "killed": sum(r["landing"] != "completed before the kill" for r in rounds),
        "verify_ok": sum(r["verify_ok"] for r in rounds), "exactly_once_after_resume": sum(r["exactly_once"] for r in rounds),
        "landings": landings, "prober_requests": prober.total, "prober_status": prober.status,
        "prober_errors": len(prober.errors), "versions_served": sorted(prober.versions), "seconds": sw.s, "rounds": rounds,
    }
    record(name, fig)
    return fig


def test_sigkill_at_random_points(live, tmp_path):
    fig = run_kill_seeds(live, tmp_path, [0, 1, 2], "kill_fast")
    assert fig["killed"] >= 1  # the checks hold wherever the kill lands (or if the run ends first)


@pytest.mark.slow
def test_sigkill_at_random_points_many_seeds(live, tmp_path):
    seeds = list(range(100, 100 + int(os.environ.get("GARE_ROBUST_KILL_SEEDS", "24"))))
    fig = run_kill_seeds(live, tmp_path, seeds, "kill_full")
    assert fig["killed"] >= len(seeds) // 2


# ------------------------------------------------------------------------------------------ tampering
VERSION_FILES = ("ann.faiss", "ids.npy", "norms.npy", "units.npy", "frames.npy", "masks.npy", "biases.npy",
                 "meta.sqlite", "manifest.json")


def _replace(path: Path, data: bytes) -> None:
    """Write a new inode (files of consecutive versions are hard links: never modify one in place)."""
    tmp = path.with_name(path.name + ".tamper")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _tamper(path: Path, how: str) -> bytes:
    data = path.read_bytes()
    if how == "truncated":
        _replace(path, data[: len(data) // 2])
    else:  # altered: same size, bytes flipped in the payload (past any header)
        b = bytearray(data)
        start = len(b) // 2
        for i in range(start, min(len(b), start + 8)):
            b[i] ^= 0x5A
        _replace(path, bytes(b))
    return data


def _new_version(idx: Path) -> str:
    from indexer.build import recompute_biases

    return recompute_biases(str(idx)).version


def test_tampered_files_are_detected_and_refused(tmp_path):
    """Every file x {truncated, altered}: verify fails naming it; reload refuses it (truncated: always;
    altered: with verify_index) and the service keeps answering from the version it had."""
    import asyncio

    from service.app import create_app

    idx = copy_index(tmp_path / "index")
    rows = []

    async def go(rehash: bool, how: str) -> None:
        app = create_app(svc_settings(idx, api_keys=KEY, verify_index=rehash))
        async with running_app(app) as c:
            auth = {"Authorization": f"Bearer {KEY}"}
            for fname in VERSION_FILES:
                served = (await c.get("/v1/index")).json()["version"]
                name = _new_version(idx)
                target = idx / "versions" / name / fname
                original = _tamper(target, how)
                rc, out, err = index_cli("verify", "--out", str(idx))
                r = await c.post("/v1/admin/reload", headers=auth)
                s = await c.post("/v1/search", json={"query": "a green cross falls", "k": 3})
                row = {"file": fname, "how": how, "verify_index": rehash, "verify_rc": rc,
                       "verify_names_file": fname in err, "reload_status": r.status_code,
                       "reload_detail": r.json().get("detail"), "search_status": s.status_code,
                       "served_after": s.json().get("index_version") if s.status_code == 200 else None}
                rows.append(row)
                # (an altered manifest.json is caught by what it no longer matches, e.g. a file hash)
                assert rc == 1 and (fname in err or fname == "manifest.json"), row
                assert s.status_code == 200, row
                refused = r.status_code != 200
                if how == "truncated" or rehash:
                    assert refused and r.status_code in (409, 503), row
                    assert f"still serving {served}" in row["reload_detail"], row
                    assert row["served_after"] == served, row
                _replace(target, original)  # repair, and the service takes the version now
                r2 = await c.post("/v1/admin/reload", headers=auth)
                assert r2.status_code == 200 and r2.json()["version"] == name, r2.text
                assert index_cli("verify", "--out", str(idx))[0] == 0

    for rehash, how in ((False, "truncated"), (True, "altered"), (False, "altered")):
        asyncio.run(go(rehash, how))
    detected = [r for r in rows if r["verify_rc"] == 1]
    refused = [r for r in rows if r["reload_status"] != 200]
    default_altered_served = [r["file"] for r in rows if r["how"] == "altered" and not r["verify_index"]
                              and r["reload_status"] == 200]
    record("tamper", {
        "cases": len(rows), "verify_detected": len(detected), "reload_refused": len(refused),
        "truncated_refused": sum(r["reload_status"] != 200 for r in rows if r["how"] == "truncated"),
        "altered_refused_with_verify_index": sum(r["reload_status"] != 200 for r in rows
                                                 if r["how"] == "altered" and r["verify_index"]),
        "altered_served_by_default": default_altered_served, "search_failures": sum(r["search_status"] != 200 for r in rows),
        "rows": rows,
    })


def test_live_server_refuses_a_truncated_version(live):
    srv, idx, _ = live
    assert _reload(srv).status_code == 200
    served = _search(srv).json()["index_version"]
    name = _new_version(idx)
    target = idx / "versions" / name / "frames.npy"
    original = _tamper(target, "truncated")
    try:
        r = _reload(srv)
        assert r.status_code == 503, r.text
        assert f"index version {name} could not be opened; still serving {served}" in r.json()["detail"]
        s = _search(srv)
        assert s.status_code == 200 and s.json()["index_version"] == served
        assert httpx.get(srv.base_url + "/readyz", timeout=10).json()["index_version"] == served
    finally:
        _replace(target, original)
    r = _reload(srv)
    assert r.status_code == 200 and r.json()["version"] == name
    record("tamper_live", {"reload_status": 503, "served_after": served, "repaired_reload": 200})


# ------------------------------------------------------------------------------------------ disk full
@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "3m"):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _free_kib(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // 1024


def _fill(path: Path, leave_kib: int) -> Path:
    filler = path / "filler.bin"
    want = max(0, _free_kib(path) - leave_kib) * 1024
    with open(filler, "wb") as fh, contextlib.suppress(OSError):
        fh.write(b"\0" * want)
        fh.flush()
        os.fsync(fh.fileno())
    return filler


def run_disk_full(tmp_path: Path, levels: list[int], name: str, commands=("build",)) -> dict:
    """For each command and level: a fresh copy of the base index on the tmpfs, the disk filled to leave
    `level` KiB, the command run in a separate process (a crash by signal must not take the tests down: it
    is recorded and fails the test), then the checks, then the same command again with the space freed."""
    sh = shared()
    ckpt = str(sh["checkpoint"])
    base, lib = private_index(tmp_path)  # an index of the base library, which then gets 4 more videos
    for i in range(12, 16):
        shutil.copy2(sh["videos"] / f"video{i}.mp4", lib / f"video{i}.mp4")
    rows = []
    with small_tmpfs(tmp_path / "tmpfs") as mnt, IndexWorker() as worker:
        for cmd in commands:
            for leave in levels:
                for p in mnt.iterdir():
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
                idx = shutil.copytree(base, mnt / "index", symlinks=True)
                before = index_contents(idx)
                filler = _fill(mnt, leave)
                free = _free_kib(mnt)
                if cmd == "build":
                    args = ["build", "--checkpoint", ckpt, "--videos", str(lib), "--out", str(idx), "--workers", "0", "--no-progress"]
                elif cmd == "add":
                    args = ["add", "--videos", str(lib), "--out", str(idx), "--workers", "0", "--no-progress"]
                else:
                    args = ["remove", "--out", str(idx), before["paths"][0]]
                res = worker.run(*args)
                rc, err = res["rc"], res["err"]
                row = {"command": cmd, "free_kib": free, "rc": rc, "signal": res["signal"],
                       "error": (err.strip().splitlines() or [""])[-1][:200]}
                rows.append(row)
                assert res["signal"] is None, f"gare-index {cmd} was killed by signal {res['signal']} on a full disk: {row}"
                assert rc in (0, 1), row
                assert verify_index(idx) == [], row
                assert not [p.name for p in (idx / "versions").iterdir() if p.name.startswith(".tmp-")], row
                if rc == 1:
                    assert "No space left on device" in err or "disk is full" in err, row
                    after = index_contents(idx)
                    assert after == before, row  # nothing changed, nothing lost
                    row["outcome"] = "failed cleanly"
                else:
                    row["outcome"] = "fitted"
                # with the space back, the same command completes and nothing is missing or twice
                filler.unlink()
                if cmd == "remove":
                    if rc == 1:
                        res2 = worker.run(*args)
                        assert res2["rc"] == 0, (row, res2)
                    after = index_contents(idx)
                    assert after["paths"] == before["paths"][1:] and after["n"] == before["n"] - 1, row
                else:
                    res2 = worker.run(*args)
                    assert res2["rc"] == 0, (row, res2)
                    assert_exactly_once(idx, lib)
                assert not list((idx / "work").glob(".staging-*")), row
    fig = {"levels_kib": levels, "commands": list(commands), "runs": len(rows),
           "failed_cleanly": sum(r.get("outcome") == "failed cleanly" for r in rows),
           "fitted": sum(r.get("outcome") == "fitted" for r in rows),
           "crashed": sum(r["signal"] is not None for r in rows), "data_lost": 0,
           "messages": sorted({r["error"].split(": error: ")[-1][:80] for r in rows if r["rc"] == 1}), "rows": rows}
    record(name, fig)
    return fig


def test_disk_full_fails_cleanly(tmp_path):
    fig = run_disk_full(tmp_path, [0, 16, 48, 2048], "disk_full_fast")
    assert fig["failed_cleanly"] >= 2 and fig["fitted"] >= 1


@pytest.mark.slow
def test_disk_full_sweep(tmp_path):
    levels = list(range(0, 160, 4)) + [2048]
    fig = run_disk_full(tmp_path, levels, "disk_full_full", commands=("build", "add", "remove"))
    assert fig["failed_cleanly"] >= 10


# Regression: report.json is written after CURRENT is switched; a failed write there (disk full right after
# the switch, a 4 KiB window the tmpfs sweep rarely hits) must not turn the run into "exit 1, nothing changed".
def test_failed_report_write_after_switch_does_not_claim_failure(tmp_path, monkeypatch):
    import indexer.build as B

    idx, lib = private_index(tmp_path)
    shutil.copy2(shared()["videos"] / "video20.mp4", lib / "video20.mp4")
    before = current_version_name(idx)

    def no_space(root, report):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(root) / "report.json"))

    monkeypatch.setattr(B, "write_report", no_space)
    rc, out, err = index_cli("build", "--checkpoint", str(shared()["checkpoint"]), "--videos", str(lib),
                             "--out", str(idx), "--workers", "0", "--no-progress")
    after = current_version_name(idx)
    # the contract (gare-index --help): exit 1 = failed, nothing was changed
    assert (rc == 1 and after == before) or (rc == 0 and after != before), (rc, before, after, err)
    assert rc == 0  # the run succeeded; the failed report write is only logged
    record("report_write_failure", {"rc": rc, "switched": after != before})

