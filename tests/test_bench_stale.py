"""The staleness list (`python -m bench.stale`), the harness's tree state and its record, on a temporary git
repository with real commits.

Only tests/test_evidence.py may import bench/ (tests/test_layers.py), so both run as the commands a user types:
`python -m bench.stale --repo TMP`, and `python -c` for the harness's `git_state`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120  # a hang guard: each command takes well under a second


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True,
                          timeout=TIMEOUT_S).stdout.strip()


def commit_file(repo: Path, path: str, text: str, message: str) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    git(repo, "add", path)
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def report(repo: Path, name: str, data: dict) -> None:
    path = repo / "bench" / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def run_py(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("GARE_COMMIT", None)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def stale(repo: Path, *extra: str) -> dict[str, str]:
    """{report path: reasons} for every report (`--all`; "current" for a fresh one)."""
    out = run_py("-m", "bench.stale", "--repo", str(repo), "--all", *extra)
    assert out.returncode == 0, out.stderr
    return dict(line.split(": ", 1) for line in out.stdout.splitlines())


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with a product folder pkg/ (measured), other/ (not measured) and a script bench/tool.py that
    declares MEASURES = ("pkg/",)."""
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    (r / "other").mkdir()
    (r / "other" / "c.py").write_text("C = 1\n")
    (r / "bench").mkdir()
    (r / "bench" / "tool.py").write_text('MEASURES: tuple[str, ...] = (\n    "pkg/",\n)\n')
    commit_file(r, "pkg/a.py", "A = 1\n", "first")
    git(r, "add", "-A")
    git(r, "commit", "-q", "-m", "script")
    return r


def test_a_report_older_than_a_change_to_its_measured_path_is_listed_and_a_fresh_one_is_not(repo):
    c1 = git(repo, "rev-parse", "HEAD")
    c2 = commit_file(repo, "pkg/a.py", "A = 2\n", "change the measured code")
    commit_file(repo, "other/c.py", "C = 2\n", "change code the report does not measure")
    report(repo, "old.json", {"command": "python bench/tool.py", "commit": c1[:12]})
    report(repo, "fresh.json", {"command": "python -m bench.tool --x 1", "commit": c2[:12]})
    report(repo, "tool.json", {"commit": c2})  # no command: the script named like the report
    got = stale(repo)
    assert "1 later commit(s) changed what it measures" in got["bench/results/old.json"]
    assert got["bench/results/fresh.json"] == "current"
    assert got["bench/results/tool.json"] == "current"


def test_a_change_to_comments_and_docstrings_only_does_not_make_a_report_stale(repo):
    code = 'def f(x):\n    return x + 1\n'
    c1 = commit_file(repo, "pkg/b.py", code, "code")
    report(repo, "tool.json", {"commit": c1})
    commit_file(repo, "pkg/b.py", '"""Module doc."""\n# why\ndef f(x):\n    """Doc."""\n    return x + 1  # said\n',
                "comments and docstrings only")
    assert stale(repo)["bench/results/tool.json"] == "current"
    commit_file(repo, "pkg/b.py", '"""Module doc."""\ndef f(x):\n    """Doc."""\n    return x + 2\n', "the code")
    assert "1 later commit(s) changed what it measures" in stale(repo)["bench/results/tool.json"]
    commit_file(repo, "pkg/notes.txt", "a data file the code may read\n", "not Python")
    assert "2 later commit(s) changed what it measures" in stale(repo)["bench/results/tool.json"]


def test_a_dirty_report_is_listed(repo):
    head = git(repo, "rev-parse", "HEAD")
    report(repo, "dirty_run.json", {"run": {"commit": head, "dirty": True, "script": "bench/tool.py",
                                            "measures": ["pkg/"]}})
    report(repo, "clean_run.json", {"run": {"commit": head, "dirty": False, "script": "bench/tool.py",
                                            "measures": ["pkg/"]}})
    report(repo, "dirty_old.json", {"command": "python bench/tool.py", "commit": head[:12] + "-dirty"})
    got = stale(repo)
    assert got["bench/results/dirty_run.json"] == "ran on a dirty tree"
    assert got["bench/results/dirty_old.json"] == "ran on a dirty tree"
    assert got["bench/results/clean_run.json"] == "current"


def test_a_missing_or_unknown_commit_is_listed(repo):
    report(repo, "missing.json", {"command": "python -m bench.tool", "commit": "1e9d3f40029b"})
    report(repo, "unknown.json", {"command": "python -m bench.tool", "commit": "unknown"})
    report(repo, "none.json", {"command": "python -m bench.tool"})
    git(repo, "checkout", "-q", "-b", "side")
    side = commit_file(repo, "pkg/b.py", "B = 1\n", "on another branch")
    git(repo, "checkout", "-q", "main")
    report(repo, "side.json", {"command": "python -m bench.tool", "commit": side})
    got = stale(repo)
    assert got["bench/results/missing.json"] == "commit 1e9d3f40029b is not in this branch's history"
    assert got["bench/results/unknown.json"] == "records no commit"
    assert got["bench/results/none.json"] == "records no commit"
    assert got["bench/results/side.json"] == f"commit {side} is not in this branch's history"


def test_archives_are_not_read_and_a_report_without_a_script_is_listed(repo):
    head = git(repo, "rev-parse", "HEAD")
    report(repo, "history/old.json", {"command": "python -m bench.tool", "commit": "unknown"})
    report(repo, "orphan.json", {"commit": head})
    got = stale(repo)
    assert "bench/results/history/old.json" not in got
    assert got["bench/results/orphan.json"] == "no bench script is known to write it"


def test_stale_exits_0_unless_strict(repo):
    report(repo, "unknown.json", {"command": "python -m bench.tool", "commit": "unknown"})
    assert run_py("-m", "bench.stale", "--repo", str(repo)).returncode == 0
    assert run_py("-m", "bench.stale", "--repo", str(repo), "--strict").returncode == 1


def test_readme_block_lists_every_report_with_its_commit_and_state(repo):
    start = "<!-- bench-table:start: generated by `python -m bench.stale --readme` from bench/results; do not edit -->"
    (repo / "README.md").write_text(f"# x\n\n{start}\nold\n<!-- bench-table:end -->\ntail\n")
    report(repo, "unknown.json", {"command": "python bench/tool.py --n 3", "commit": "unknown"})
    (repo / "bench" / "results" / "fresh.md").write_text("# Fresh figures\n")
    first = git(repo, "rev-parse", "HEAD")
    report(repo, "old.json", {"command": "python -m bench.tool", "commit": first})
    head = commit_file(repo, "pkg/a.py", "A = 2\n", "change the measured code")
    report(repo, "fresh.json", {"command": "python -m bench.tool", "commit": head})
    stale(repo, "--readme")
    text = (repo / "README.md").read_text()
    assert "old\n" not in text and text.endswith("<!-- bench-table:end -->\ntail\n")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "bench" in line]
    assert rows == [
        f"| Fresh figures | [bench/results/fresh.md](bench/results/fresh.md) | `python -m bench.tool` | `{head[:12]}` "
        "| current |",
        f"| - | `bench/results/old.json` | `python -m bench.tool` | `{first[:12]}` | **stale**: what it measures "
        "changed after its commit |",
        "| - | `bench/results/unknown.json` | `python -m bench.tool --n 3` | none | **stale**: records no commit |",
    ]


def test_harness_tree_state_ignores_generated_evidence(repo):
    code = ("import json, sys; from pathlib import Path; from bench.harness import git_state; "
            "print(json.dumps(git_state(Path(sys.argv[1]))))")

    def state() -> dict:
        out = run_py("-c", code, str(repo))
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    clean = state()
    assert clean["commit"] == git(repo, "rev-parse", "HEAD") and clean["dirty"] is False
    report(repo, "new.json", {})  # a run's own output does not make the tree dirty
    assert state()["dirty"] is False
    (repo / "pkg" / "a.py").write_text("A = 3\n")
    dirty = state()
    assert dirty["dirty"] is True and dirty["dirty_paths"] == [" M pkg/a.py"]


def test_harness_record_writes_and_renders_again_from_the_json(tmp_path):
    """A run's record lands under the JSON's "run" key, the markdown shows it under the title, and --render's
    path (render_saved) writes the same markdown from the saved JSON alone."""
    code = """
import json, sys
from pathlib import Path
from bench import harness

@harness.with_provenance
def markdown(d):
    return "# Title\\n\\nbody " + str(d["x"]) + "\\n"

run = harness.start("bench.fake", ["pkg/"], ["--a", "1"])
out = Path(sys.argv[1])
md = harness.write_report(out / "fake.json", {"x": 7, "run": run.record()}, markdown)
first = md.read_text()
md.write_text("hand edit")
harness.render_saved(out / "fake.json", markdown)
print(json.dumps({"first": first, "again": md.read_text(), "run": json.loads((out / "fake.json").read_text())["run"]}))
"""
    out = run_py("-c", code, str(tmp_path))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    run = got["run"]
    assert run["command"] == "python -m bench.fake --a 1" and run["script"] == "bench/fake.py"
    assert run["measures"] == ["pkg/"] and run["commit"] == git(REPO, "rev-parse", "HEAD")
    assert set(run["machine"]) == {"cpu", "flags", "cores", "load_before", "load_after"}
    assert set(run["machine"]["flags"]) == {"avx2", "avx512_bf16"}
    assert got["again"] == got["first"]
    lines = got["first"].splitlines()
    assert lines[0] == "# Title" and lines[2].startswith(f"Run: `python -m bench.fake --a 1` at commit {run['commit'][:12]}")
    assert lines[-1] == "body 7"


def test_harness_records_the_sha256_of_each_input_file_and_folder(tmp_path):
    """add_inputs records a file's sha256 as `sha256sum` gives it and a folder's over its files' paths and hashes:
    a changed byte or a renamed file in the folder changes the folder's hash; the markdown names each input."""
    ckpt = tmp_path / "best.safetensors"
    ckpt.write_bytes(b"weights" * 1000)
    corpus = tmp_path / "corpus"
    (corpus / "videos").mkdir(parents=True)
    (corpus / "test.csv").write_text("video_id\nv1\n")
    (corpus / "videos" / "v1.mp4").write_bytes(b"\x00mp4")
    code = """
import json, sys
from pathlib import Path
from bench import harness

run = harness.start("bench.fake", ["pkg/"], [])
run.add_inputs(*sys.argv[1:])
rec = run.record()
print(json.dumps({"inputs": rec["inputs"], "md": harness.provenance_md({"run": rec})}))
"""

    def inputs() -> dict:
        out = run_py("-c", code, str(ckpt), str(corpus))
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    first = inputs()
    want = subprocess.run(["sha256sum", str(ckpt)], capture_output=True, text=True, check=True).stdout.split()[0]
    assert first["inputs"][str(ckpt)] == want
    assert f"Input `{ckpt}`: sha256 {want[:16]}." in first["md"]
    (corpus / "videos" / "v1.mp4").write_bytes(b"\x01mp4")
    changed = inputs()["inputs"][str(corpus)]
    (corpus / "videos" / "v1.mp4").rename(corpus / "videos" / "v2.mp4")
    renamed = inputs()["inputs"][str(corpus)]
    assert len({first["inputs"][str(corpus)], changed, renamed}) == 3
    assert inputs()["inputs"][str(corpus)] == renamed  # the same folder hashes the same
    missing = run_py("-c", code, str(tmp_path / "absent"))
    assert missing.returncode != 0 and "absent does not exist" in missing.stderr
