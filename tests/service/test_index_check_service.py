"""The service serves no index file that differs from its manifest (gare_serve.engine.index_check).

Each file of a new version altered in place at the same size (one byte flipped, its own inode) is refused by
``POST /v1/admin/reload`` (503, the old version keeps serving, ``gare_index_checks_total{phase="reload",
result="mismatch"}``) and by the start (StartupError naming the file); with ``index_check`` off the same
alteration of ann.faiss, units.npy or frames.npy is served (the finding); a file changed under the running server
is caught by the next periodic re-check; a version written before fast hashes and seals is served. manifest.json is
held to its seal (manifest.json.xxh3): a hex digit of a file's sha256 record, which no other check at open reads, or
any byte of the seal changed is refused like a bad file."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gare_index.store import SEAL_FILE
from gare_serve.app import create_app
from gare_serve.engine.startup import StartupError
from gare_serve.settings import Settings
from tests.indexer.test_index_check import flip_in_place
from tests.service.support import copy_index, settings

KEY = "admin-key-for-the-index-check-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUERY = {"query": "a green cross falls", "k": 3}


def _checks(app, phase: str, result: str) -> float:
    return app.state.metrics.registry.get_sample_value("gare_index_checks_total", {"phase": phase, "result": result}) or 0.0


def _files(vdir: Path) -> list[Path]:
    """Every file of a version (fields/*.npy too)."""
    return sorted(p for p in vdir.rglob("*") if p.is_file())


def _manifest_at(vdir: Path) -> int:
    """Where manifest.json is altered: a hex digit of units.npy's sha256 record, which the fast check at open or
    reload does not read (`gare-index verify` does): only the manifest's seal catches it there."""
    data = (vdir / "manifest.json").read_bytes()
    return data.index(b'"sha256": "', data.index(b'"units.npy": {')) + len(b'"sha256": "') + 3


def _new_version_own_inodes(idx: Path) -> str:
    """A new version (recomputed biases: its other files hard-link the served version's), every file then given
    its own inode, so that an in-place change touches this version only."""
    from gare_build.build import recompute_biases

    name = recompute_biases(str(idx)).version
    for p in _files(idx / "versions" / name):
        tmp = p.with_name(p.name + ".copy")
        shutil.copy2(p, tmp)
        os.replace(tmp, p)
    return name


def test_reload_refuses_every_file_altered_in_place(service_env, tmp_path):
    idx = copy_index(service_env["index"], tmp_path / "index")
    app = create_app(settings(idx, admin_keys=KEY, index_poll_s=0, index_recheck_s=0))
    with TestClient(app) as c:
        served = c.get("/v1/index").json()["version"]
        assert _checks(app, "open", "ok") == 1
        name = _new_version_own_inodes(idx)
        vdir = idx / "versions" / name
        fnames = sorted(p.relative_to(vdir).as_posix() for p in _files(vdir))
        assert {"ann.faiss", "units.npy", "frames.npy", "manifest.json", SEAL_FILE, "meta.sqlite"} <= set(fnames)
        accepted, mismatches = [], 0
        for fname in fnames:
            at = flip_in_place(vdir / fname, _manifest_at(vdir) if fname == "manifest.json" else None)
            r = c.post("/v1/admin/reload", headers=AUTH)
            if r.status_code == 200:
                accepted.append(fname)
                break
            assert r.status_code == 503, (fname, r.text)
            assert f"still serving {served}" in r.json()["detail"], (fname, r.text)
            mismatches += "failed its file check" in r.json()["detail"]
            assert _checks(app, "reload", "mismatch") == mismatches  # every check failure counted
            named = "manifest.json" if fname == SEAL_FILE else fname  # the seal: the manifest no longer matches it
            assert named in r.json()["detail"] and str(tmp_path) not in r.json()["detail"], r.text
            s = c.post("/v1/search", json=QUERY)
            assert s.status_code == 200 and s.json()["index_version"] == served, (fname, s.text)
            flip_in_place(vdir / fname, at)  # restored, byte for byte
        assert accepted == [], f"altered in place and served: {accepted}"
        r = c.post("/v1/admin/reload", headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == name, r.text
        assert _checks(app, "reload", "ok") == 1
        assert c.post("/v1/search", json=QUERY).json()["index_version"] == name


@pytest.mark.parametrize("fname", ["ann.faiss", "units.npy", "frames.npy"])
def test_off_switch_serves_what_the_check_refuses(service_env, tmp_path, monkeypatch, fname):
    """GARE_INDEX_CHECK=off: the version with the altered file is served (the check really is skipped)."""
    monkeypatch.setenv("GARE_INDEX_CHECK", "off")
    assert Settings().index_check is False
    idx = copy_index(service_env["index"], tmp_path / "index")
    app = create_app(settings(idx, admin_keys=KEY, index_poll_s=0, index_check=Settings().index_check))
    with TestClient(app) as c:
        name = _new_version_own_inodes(idx)
        flip_in_place(idx / "versions" / name / fname)
        r = c.post("/v1/admin/reload", headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == name, r.text
        assert _checks(app, "open", "ok") == _checks(app, "reload", "ok") == _checks(app, "reload", "mismatch") == 0


def test_start_refuses_an_altered_version_naming_the_file(service_env, tmp_path):
    idx = copy_index(service_env["index"], tmp_path / "index")
    cur = (idx / "CURRENT").read_text().strip()
    flip_in_place(idx / "versions" / cur / "frames.npy")
    with pytest.raises(StartupError) as e, TestClient(create_app(settings(idx, index_poll_s=0))):
        pass
    assert "failed its file check" in str(e.value) and f"{cur}/frames.npy" in str(e.value)


def test_file_changed_under_the_running_server_is_caught_by_the_recheck(service_env, tmp_path):
    idx = copy_index(service_env["index"], tmp_path / "index")
    app = create_app(settings(idx, index_poll_s=0, index_recheck_s=0.2))
    with TestClient(app) as c:
        state = app.state.gare
        served = c.get("/v1/index").json()["version"]
        deadline = time.monotonic() + 60  # hang guard: the re-check runs every 0.2 s
        while _checks(app, "recheck", "ok") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _checks(app, "recheck", "ok") >= 1 and state.index_problems == []
        at = flip_in_place(idx / "versions" / served / "units.npy")  # the memory-mapped file the server reads
        while _checks(app, "recheck", "mismatch") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _checks(app, "recheck", "mismatch") >= 1
        assert any(f"{served}/units.npy" in p for p in state.index_problems), state.index_problems
        assert "gare_index_checks_total" in c.get("/metrics").text
        flip_in_place(idx / "versions" / served / "units.npy", at)
        ok = _checks(app, "recheck", "ok")
        while _checks(app, "recheck", "ok") <= ok and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state.index_problems == []
        vdir = idx / "versions" / served
        at = flip_in_place(vdir / "manifest.json", _manifest_at(vdir))  # a sha256 record: only the seal tells
        bad = _checks(app, "recheck", "mismatch")
        while _checks(app, "recheck", "mismatch") <= bad and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p.split(": ", 1)[0] for p in state.index_problems] == [str(vdir / "manifest.json")], state.index_problems
        flip_in_place(vdir / "manifest.json", at)


def test_version_without_fast_hashes_is_served(service_env, tmp_path, caplog):
    """A version written before fast hashes and seals were recorded: served, checked with sha256 (one WARNING),
    with one WARNING that it is unsealed (not repeated by the re-checks), naming the way to seal it."""
    idx = copy_index(service_env["index"], tmp_path / "index")
    cur = (idx / "CURRENT").read_text().strip()
    mpath = idx / "versions" / cur / "manifest.json"
    m = json.loads(mpath.read_text())
    for e in m["files"].values():
        e.pop("fast_hash")
    mpath.write_text(json.dumps(m, indent=1, sort_keys=True))
    (mpath.parent / SEAL_FILE).unlink()
    app = create_app(settings(idx, index_poll_s=0, index_recheck_s=0.2))
    with caplog.at_level("WARNING", logger="gare_index.store.file_check"), TestClient(app) as c:
        assert c.post("/v1/search", json=QUERY).status_code == 200
        assert _checks(app, "open", "ok") == 1
        deadline = time.monotonic() + 60  # hang guard: the re-check runs every 0.2 s
        while _checks(app, "recheck", "ok") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _checks(app, "recheck", "ok") >= 2
    assert any("checked with sha256" in r.getMessage() for r in caplog.records)
    unsealed = [r.getMessage() for r in caplog.records if f"has no {SEAL_FILE}" in r.getMessage()]
    assert len(unsealed) == 1 and f"index version {cur}" in unsealed[0] and "gare-index seal" in unsealed[0], unsealed


def test_start_refuses_a_changed_sha256_record_in_the_manifest(service_env, tmp_path):
    """A hex digit of a file's sha256 record changed in manifest.json (every file still matches its fast hash): the
    start is refused naming manifest.json (the seal), and the same index starts once the digit is restored."""
    idx = copy_index(service_env["index"], tmp_path / "index")
    cur = (idx / "CURRENT").read_text().strip()
    vdir = idx / "versions" / cur
    at = flip_in_place(vdir / "manifest.json", _manifest_at(vdir))
    with pytest.raises(StartupError) as e, TestClient(create_app(settings(idx, index_poll_s=0))):
        pass
    assert "failed its file check" in str(e.value), e.value
    assert f"{cur}/manifest.json: does not match its seal {SEAL_FILE}" in str(e.value), e.value
    flip_in_place(vdir / "manifest.json", at)
    with TestClient(create_app(settings(idx, index_poll_s=0))) as c:
        assert c.post("/v1/search", json=QUERY).status_code == 200
