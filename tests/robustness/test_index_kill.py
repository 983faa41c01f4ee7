"""SIGKILL a real `gare-index` subprocess at several points: the previous version stays current and verifies,
and the next run resumes from INDEX/work/ without re-encoding finished videos (counted from report.json).

GARE_INDEX_TEST_PAUSE=<stage> makes the process write GARE_INDEX_TEST_PAUSE_FILE and sleep at that stage,
so the kill lands at a known point: after N clips are encoded and committed, inside the version write
(files in versions/.tmp-*), and after the rename but before CURRENT is switched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from indexer.build import BuildOptions, build
from indexer.store import current_version_name, list_versions, open_index, verify_index
from tests.indexer.support import cli_cmd, cli_env, copy_videos


def _run(args: list[str], *, pause: str | None = None, marker: Path | None = None, timeout: float = 120.0):
    """Run gare-index; with `pause`, wait for the pause marker, SIGKILL the process group and return None."""
    env = cli_env()
    if pause:
        env["GARE_INDEX_TEST_PAUSE"] = pause
        env["GARE_INDEX_TEST_PAUSE_FILE"] = str(marker)
    proc = subprocess.Popen(cli_cmd(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    if not pause:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    deadline = time.monotonic() + timeout
    try:
        while not marker.exists():
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"gare-index exited ({proc.returncode}) before reaching {pause}:\n{out}\n{err}")
            if time.monotonic() > deadline:
                raise AssertionError(f"gare-index did not reach {pause} in {timeout}s")
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the process and its decode workers, all started by this test
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    marker.unlink()
    return None


def _work_keys(out: Path) -> int:
    import numpy as np

    n = 0
    for p in (out / "work").glob("*/shard-*.npz"):
        with np.load(p) as z:
            n += len(z["keys"])
    return n


def _assert_intact(out: Path, name: str, n: int) -> None:
    assert current_version_name(out) == name
    assert verify_index(out) == []
    v = open_index(out, verify=True)
    assert v.n == n
    v.close()


def test_kill_and_resume(tmp_path, ckpt, corpus):
    lib = copy_videos(corpus, tmp_path / "lib", [f"video{i}.mp4" for i in range(4)])
    out = tmp_path / "INDEX"
    marker = tmp_path / "paused"
    v1 = build(ckpt, lib, out, BuildOptions(workers=0, progress=False)).version
    _assert_intact(out, v1, 4)
    copy_videos(corpus, lib, [f"video{i}.mp4" for i in range(4, 10)])  # 6 more
    args = ["build", "--checkpoint", str(ckpt), "--videos", str(lib), "--out", str(out), "--batch-size", "2",
            "--workers", "1", "--no-progress"]

    # 1. killed after 4 of the 6 new clips were encoded (two work batches committed)
    _run(args, pause="encoded:4", marker=marker)
    _assert_intact(out, v1, 4)
    assert _work_keys(out) == 4

    # 2. the resumed run encodes only the remaining 2: 4 clips come from work/, 4 from the previous version
    rc, out_text, err = _run(args)
    assert rc == 0, err
    assert "build: 10 videos in" in out_text
    report = json.loads((out / "report.json").read_text())
    assert (report["encoded"], report["from_cache"], report["from_index"]) == (2, 4, 4), report
    v2 = current_version_name(out)
    assert v2 != v1 and report["version"] == v2
    _assert_intact(out, v2, 10)
    assert _work_keys(out) == 0  # the cache is cleared once its features are in the current version

    # 3. killed inside the version write (files in versions/.tmp-*): not a version, v2 stays current
    copy_videos(corpus, lib, ["video10.mp4", "video11.mp4"])
    _run(args, pause="write", marker=marker)
    _assert_intact(out, v2, 10)
    assert any(p.name.startswith(".tmp-") for p in (out / "versions").iterdir())
    assert list_versions(out) == [v1, v2]

    # 4. the next run re-encodes nothing and every video is in the index exactly once
    rc, _, err = _run(args)
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    assert (report["encoded"], report["from_cache"], report["from_index"]) == (0, 2, 10), report
    _assert_intact(out, report["version"], 12)
    v = open_index(out)
    paths = [r["path"] for r in v.all_metadata()]
    assert sorted(paths) == sorted(str(p) for p in lib.glob("*.mp4")) and len(set(v.ids.tolist())) == 12
    assert not any(p.name.startswith(".tmp-") for p in (out / "versions").iterdir())


@pytest.mark.slow
def test_kill_before_the_first_version_and_before_the_switch(tmp_path, ckpt, corpus):
    lib = copy_videos(corpus, tmp_path / "lib", [f"video{i}.mp4" for i in range(8)])
    out = tmp_path / "INDEX"
    marker = tmp_path / "paused"
    args = ["build", "--checkpoint", str(ckpt), "--videos", str(lib), "--out", str(out), "--batch-size", "3",
            "--workers", "2", "--no-progress"]
    _run(args, pause="encoded:3", marker=marker)
    assert not (out / "CURRENT").exists() and list_versions(out) == []  # no version yet, nothing half-visible
    assert _work_keys(out) == 3
    # killed after the rename, before CURRENT exists: still no current version for readers
    _run(args, pause="switch", marker=marker)
    assert not (out / "CURRENT").exists()
    rc, _, err = _run(args)
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    assert (report["encoded"], report["from_cache"]) == (0, 8)
    _assert_intact(out, current_version_name(out), 8)
    # and once more with a previous version: a kill between rename and switch leaves it current
    (lib / "video0.mp4").unlink()
    prev = current_version_name(out)
    _run(args, pause="switch", marker=marker)
    _assert_intact(out, prev, 8)
    rc, _, err = _run(args)
    assert rc == 0, err
    _assert_intact(out, current_version_name(out), 7)
