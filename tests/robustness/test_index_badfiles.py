"""Bad input: every broken, unsupported, vanished or duplicate entry is skipped with its reason (report.json and
the summary line), exit code 3, and nothing partial enters the index; exit codes documented in --help."""

from __future__ import annotations

import json
import os

import pytest

from indexer.cli import main
from indexer.store import list_versions, open_index, verify_index
from tests.badfiles import write_bad_videos
from tests.indexer.support import copy_videos


def _reasons(out) -> dict[str, str]:
    report = json.loads((out / "report.json").read_text())
    return {os.path.basename(s["path"]): s["reason"] for s in report["skipped"]}


def test_bad_files_in_a_folder(tmp_path, ckpt, corpus, capsys):
    lib = copy_videos(corpus, tmp_path / "lib", ["video0.mp4", "video1.mp4", "video2.mp4", "video3.mp4"])
    bad = write_bad_videos(lib / "bad")  # empty, truncated, random, no_moov, wrong_container, text
    os.mkfifo(lib / "pipe.mp4")  # not a regular file (and never opened: reading a FIFO would block)
    os.symlink(lib / "does-not-exist.mp4", lib / "dangling.mkv")  # vanished target
    (lib / "notes.txt").write_text("not a video")  # ignored (not a video type), not an error
    (lib / ".partial.mp4").write_bytes(b"")  # hidden files are not looked at
    out = tmp_path / "INDEX"
    rc = main(["build", "--checkpoint", str(ckpt), "--videos", str(lib), "--out", str(out), "--workers", "2",
               "--batch-size", "3", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 3
    assert "skipped" in captured.out and "report.json" in captured.out  # the summary line
    reasons = _reasons(out)
    expected = {f"{k}.mp4" for k in bad} | {"pipe.mp4", "dangling.mkv"}
    assert set(reasons) == expected, reasons
    assert reasons["empty.mp4"] == "empty file"
    assert reasons["pipe.mp4"] == "not a regular file"
    assert "not found" in reasons["dangling.mkv"]
    assert "not a video container" in reasons["wrong_container.mp4"]
    assert all(reasons.values())
    for name in expected:
        assert name in captured.err  # each skip is also printed with its reason
    report = json.loads((out / "report.json").read_text())
    assert report["exit_code"] == 3 and report["status"] == "done with skipped files"
    assert [os.path.basename(s["path"]) for s in report["ignored"]] == ["notes.txt"]
    # only the good videos are in the index, each once, and everything agrees
    v = open_index(out, verify=True)
    assert sorted(os.path.basename(r["path"]) for r in v.all_metadata()) == [f"video{i}.mp4" for i in range(4)]
    assert v.n == v.ann.ntotal == 4
    assert verify_index(out) == []


def test_bad_manifest_rows(tmp_path, ckpt, corpus):
    lib = copy_videos(corpus, tmp_path / "lib", ["video0.mp4", "video1.mp4", "video2.mp4"])
    (lib / "clip.txt").write_text("x")
    rows = [
        {"video": "lib/video0.mp4", "id": 100},
        {"video": "lib/video1.mp4", "id": 100},  # duplicate id
        {"video": "lib/video2.mp4", "id": 7, "start": 0.0, "end": 1.0},
        {"video": "lib/video2.mp4", "id": 8, "start": 0.0, "end": 1.0},  # same file and window again
        {"video": "lib/video2.mp4", "start": 1.0},  # a second window of video2, auto id
        {"video": "lib/vanished.mp4"},  # listed but gone
        {"video": "lib/clip.txt"},  # unsupported type
        {"video": "lib/video1.mp4", "start": "soon"},  # bad value
        {"video": "lib/video1.mp4", "id": -3},
        {"nothing": 1},
    ]
    manifest = tmp_path / "videos.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    out = tmp_path / "INDEX"
    rc = main(["build", "--checkpoint", str(ckpt), "--videos", str(manifest), "--out", str(out), "--workers", "0",
               "--no-progress"])
    assert rc == 3
    report = json.loads((out / "report.json").read_text())
    reasons = [s["reason"] for s in report["skipped"]]
    joined = "\n".join(reasons)
    assert "duplicate id 100" in joined and "duplicate entry" in joined and "file not found" in joined
    assert "unsupported file type '.txt'" in joined and "invalid start 'soon'" in joined and "invalid id -3" in joined
    assert "no 'video' path" in joined and "invalid JSON" in joined
    assert len(reasons) == 8
    v = open_index(out)
    md = {r["id"]: r for r in v.all_metadata()}
    assert set(md) == {100, 7, 101}
    assert (md[7]["start"], md[7]["end"]) == (0.0, 1.0) and md[101]["start"] == 1.0 and md[101]["end"] is None
    assert verify_index(out) == []

    # CSV manifests work the same way
    csv_path = tmp_path / "videos.csv"
    csv_path.write_text("video,start,end,id\nlib/video0.mp4,,,5\nlib/video1.mp4,0.5,1.5,\n")
    out2 = tmp_path / "INDEX2"
    assert main(["build", "--checkpoint", str(ckpt), "--videos", str(csv_path), "--out", str(out2), "--workers", "0",
                 "--no-progress"]) == 0
    md2 = {r["id"]: r for r in open_index(out2).all_metadata()}
    assert set(md2) == {5, 6} and (md2[6]["start"], md2[6]["end"]) == (0.5, 1.5)


def test_nothing_indexable_fails_without_a_version(tmp_path, ckpt, capsys):
    write_bad_videos(tmp_path / "bad")
    out = tmp_path / "INDEX"
    rc = main(["build", "--checkpoint", str(ckpt), "--videos", str(tmp_path / "bad"), "--out", str(out),
               "--workers", "0", "--no-progress"])
    assert rc == 1
    assert "nothing could be indexed" in capsys.readouterr().err
    assert list_versions(out) == [] and not (out / "CURRENT").exists()
    assert json.loads((out / "report.json").read_text())["exit_code"] == 1


@pytest.mark.parametrize("argv, message", [
    (["build", "--checkpoint", "/nope.safetensors", "--videos", ".", "--out", "X"], "/nope.safetensors"),
    (["build", "--checkpoint", "CK", "--videos", "/no/such/dir", "--out", "X"], "/no/such/dir"),
])
def test_errors_name_the_bad_value(tmp_path, ckpt, argv, message, capsys):
    argv = [str(ckpt) if a == "CK" else str(tmp_path / "X") if a == "X" else a for a in argv]
    assert main(argv + ["--no-progress"]) == 1
    assert message in capsys.readouterr().err


def test_help_documents_exit_codes(capsys):
    for argv in (["--help"], ["build", "--help"]):
        with pytest.raises(SystemExit) as ei:
            main(argv)
        assert ei.value.code == 0
        text = capsys.readouterr().out
        assert "exit codes" in text and "3  done, but some files were skipped" in text and "1  failed" in text
    with pytest.raises(SystemExit) as ei:
        main(["build", "--checkpoint", "x", "--videos", "y", "--out", "z", "--segment", "-1"])
    assert ei.value.code == 2
    assert "-1" in capsys.readouterr().err
