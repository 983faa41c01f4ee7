"""Damaged metadata (meta.sqlite) is refused where a version is opened: `open_index`, `gare-index verify`,
service start, `gare-serve --check` and `POST /v1/admin/reload` (503 "... still serving vN"), never a 500.

Each damage is written as a new inode (versions share unchanged files through hard links): junk of the same
size, truncated, flipped bytes (same size, the manifest's hash no longer matches), a valid database with a
row missing / with other ids / with another schema (the manifest re-hashed to match it: only the content
checks stand in the way). A meta.sqlite damaged in place after the version was opened answers 503, not 500.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from gare_index.store import META_FILE, SEAL_FILE, IndexFormatError, open_index, verify_index
from tests.indexer.support import reseal
from tests.robustness.test_robust_common import copy_index, index_cli, recording, running_app
from tests.service.support import settings as svc_settings

KEY = "robust-metadata-admin-key"


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".damage")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _rehash(vdir: Path) -> None:
    m = json.loads((vdir / "manifest.json").read_text())
    data = (vdir / META_FILE).read_bytes()
    m["files"][META_FILE] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (vdir / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True))
    reseal(vdir)


def _edit_db(vdir: Path, *sql: str) -> None:
    """A valid database that differs from the written one (a copy edited with `sql`), manifest re-hashed."""
    db = vdir / META_FILE
    work = db.with_name("edit.sqlite")
    shutil.copyfile(db, work)
    conn = sqlite3.connect(work)
    for q in sql:
        conn.execute(q)
    conn.commit()
    conn.execute("VACUUM")
    conn.close()
    os.replace(work, db)
    _rehash(vdir)


def damage(vdir: Path, kind: str) -> None:
    db = vdir / META_FILE
    data = db.read_bytes()
    if kind == "junk_same_size":
        _replace(db, np.random.default_rng(1).bytes(len(data)))
    elif kind == "junk_rehashed":  # the manifest agrees with the junk: the header check refuses it
        _replace(db, b"not a database " * (len(data) // 15))
        _rehash(vdir)
    elif kind == "truncated":
        _replace(db, data[: len(data) // 2])
    elif kind == "flipped_bytes":  # the last page (row data), same size: readable by SQLite, caught by the hash
        b = bytearray(data)
        for i in range(len(b) - 64, len(b) - 56):
            b[i] ^= 0x5A
        _replace(db, bytes(b))
    elif kind == "row_missing":
        _edit_db(vdir, "DELETE FROM videos WHERE id = (SELECT max(id) FROM videos)")
    elif kind == "other_ids":
        _edit_db(vdir, "UPDATE videos SET id = id + 1000 WHERE id = (SELECT max(id) FROM videos)")
    elif kind == "wrong_schema":
        _edit_db(vdir, 'ALTER TABLE videos RENAME COLUMN "path" TO "file"')
    elif kind == "no_table":
        _edit_db(vdir, "DROP TABLE videos", "CREATE TABLE other (x)")
    else:
        raise ValueError(kind)


KINDS = ("junk_same_size", "junk_rehashed", "truncated", "flipped_bytes", "row_missing", "other_ids", "wrong_schema",
         "no_table")


def _new_version(idx: Path) -> str:
    from gare_build.build import recompute_biases

    return recompute_biases(str(idx)).version


def test_damaged_metadata_is_refused_everywhere(robust_env, tmp_path):
    """Every kind of damage: open/verify/--check refuse the version naming meta.sqlite, the service does not
    start on it, a running service refuses to reload it (503, still serving the previous version) and
    keeps answering 200; the repaired version is then taken."""
    from gare_serve.app import create_app
    from gare_serve.cli import main as serve_main
    from gare_serve.engine.startup import StartupError

    with recording("metadata_damage", kinds=list(KINDS), rows=[]) as fig:
        for kind in KINDS:
            idx = copy_index(robust_env, tmp_path / kind)
            row: dict = {"kind": kind}
            fig["rows"].append(row)
            app = create_app(svc_settings(idx, api_keys=KEY))

            async def go(app=app, idx=idx, row=row, kind=kind) -> None:
                async with running_app(app) as c:
                    served = (await c.get("/v1/index")).json()["version"]
                    name = _new_version(idx)
                    vdir = idx / "versions" / name
                    original = [(vdir / f).read_bytes() for f in (META_FILE, "manifest.json", SEAL_FILE)]
                    damage(vdir, kind)
                    try:
                        open_index(idx, use_gpu=False).close()
                        row["open"] = "accepted"
                    except IndexFormatError as e:
                        row["open"] = "refused: " + str(e)[-160:]
                    row["verify_problems"] = verify_index(idx)
                    rc, _, err = index_cli("verify", "--out", str(idx))
                    row["verify_rc"], row["verify_names_file"] = rc, META_FILE in err
                    row["serve_check_rc"] = serve_main(["--index", str(idx), "--check"])
                    try:
                        async with running_app(create_app(svc_settings(idx))):
                            row["service_start"] = "started"
                    except StartupError as e:
                        row["service_start"] = "refused: " + str(e)[-160:]
                    r = await c.post("/v1/admin/reload", headers={"Authorization": f"Bearer {KEY}"})
                    row["reload_status"], row["reload_detail"] = r.status_code, r.json().get("detail")
                    s = await c.post("/v1/search", json={"query": "a red circle rises", "k": 3})
                    row["search_status"] = s.status_code
                    row["served_after"] = s.json().get("index_version") if s.status_code == 200 else None
                    (vdir / META_FILE).unlink()
                    _replace(vdir / META_FILE, original[0])
                    _replace(vdir / "manifest.json", original[1])
                    _replace(vdir / SEAL_FILE, original[2])
                    r2 = await c.post("/v1/admin/reload", headers={"Authorization": f"Bearer {KEY}"})
                    row["repaired_reload_status"] = r2.status_code
                    row["served"] = served

            asyncio.run(go())
            assert row["open"].startswith("refused") and META_FILE in row["open"], row
            assert row["verify_problems"] and META_FILE in " ".join(row["verify_problems"]), row
            assert row["verify_rc"] == 1 and row["verify_names_file"], row
            assert row["serve_check_rc"] == 2, row
            assert row["service_start"].startswith("refused") and META_FILE in row["service_start"], row
            assert row["reload_status"] == 503 and f"still serving {row['served']}" in row["reload_detail"], row
            assert row["search_status"] == 200 and row["served_after"] == row["served"], row
            assert row["repaired_reload_status"] == 200, row


@pytest.mark.parametrize("kind", ["junk", "truncated_in_place"])
def test_metadata_damaged_after_open_answers_503_not_500(robust_env, tmp_path, kind):
    """The check runs when a version is opened; a file damaged in place afterwards (same inode) reaches the
    request path: every route that reads it answers 503 with a message, never 500."""
    from gare_serve.app import create_app

    idx = copy_index(robust_env, tmp_path / "index")
    vdir = idx / "versions" / (idx / "CURRENT").read_text().strip()
    app = create_app(svc_settings(idx))

    async def go():
        async with running_app(app) as c:
            db = vdir / META_FILE
            size = db.stat().st_size
            os.unlink(db)  # a private copy of the inode first: the base index's file stays intact
            with open(db, "wb") as fh:
                fh.write(b"\0" * size if kind == "junk" else b"")
            out = {}
            for method, url, body in (("POST", "/v1/search", {"query": "a red circle", "k": 3}),
                                      ("POST", "/v1/search/batch", {"queries": ["a red circle"], "k": 3}),
                                      ("GET", "/v1/videos/0", None), ("GET", "/v1/videos/0/file", None)):
                r = await c.request(method, url, json=body)
                out[url] = (r.status_code, r.json().get("detail"))
            return out

    out = asyncio.run(go())
    for url, (status, detail) in out.items():
        assert status == 503 and "index metadata" in detail, (url, status, detail)
