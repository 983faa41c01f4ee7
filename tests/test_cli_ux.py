"""The command-line tools as a user runs them: real files, the tools' `main([...])` in process, and one real
subprocess (the build a user starts from a shell: a fresh interpreter, third-party imports and all).

- a normal run prints no third-party log lines (open_clip logs INFO on the root logger), `-v` shows them;
- bad arguments are reported before any model is built (checked with `-v`: a model build would log
  open_clip's "Instantiating model architecture" line), naming the bad value and the fix;
- `--json` output of `gare-index stats` / `verify` and `gare-train info` parses and holds the facts.

In process, each `main` sets up logging as the command does (gare.cli_logging: a handler on the current
sys.stderr, which capsys captures); the `cli` fixture puts the root logger back afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gare.cli_logging import OUR_PACKAGES
from tests.checkout import CHECKOUT_PATH

REPO = Path(__file__).resolve().parents[1]
# What open_clip says on the root logger when it builds a model (any of these means "third-party noise").
OPEN_CLIP_LINES = ("Instantiating model architecture", "SimpleTokenizer", "No potential checkpoint path",
                   "creation process complete", "Final image preprocessing")
MODEL_BUILT = "Instantiating model architecture"


def run_process(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": CHECKOUT_PATH, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)


@pytest.fixture()
def cli(capsys):
    """`cli(module, *args)`: the tool's `main(list(args))` in this process -> (returncode, stdout, stderr), as
    a subprocess.CompletedProcess would give them. Logging is restored after the test."""
    import importlib

    root = logging.getLogger()
    saved = (list(root.handlers), root.level, {n: logging.getLogger(n).level for n in OUR_PACKAGES})

    def call(module: str, *args: str) -> SimpleNamespace:
        main = importlib.import_module(module).main
        capsys.readouterr()  # drop anything printed before
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse errors exit
            rc = e.code
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out, stderr=err)

    yield call
    for h in list(root.handlers):
        if h not in saved[0]:
            root.removeHandler(h)
            h.close()
    for h in saved[0]:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(saved[1])
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


def third_party_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if any(m in ln for m in OPEN_CLIP_LINES) or " root: " in ln]


@pytest.fixture(scope="module")
def built_index(ckpt, corpus, tmp_path_factory):
    """`gare-index build` run as a user would (a fresh process, default verbosity): (index dir, the process)."""
    out = tmp_path_factory.mktemp("cli-ux") / "index"
    proc = run_process("gare_build.cli", "build", "--checkpoint", str(ckpt), "--videos", str(corpus), "--out",
                       str(out), "--workers", "0", "--no-progress")
    assert proc.returncode in (0, 3), proc.stderr
    return out, proc


def test_index_build_prints_no_third_party_lines(built_index):
    _, proc = built_index
    assert third_party_lines(proc.stdout + proc.stderr) == []
    assert proc.stdout.strip()  # the summary line is there


def test_verbose_shows_third_party_lines(cli, ckpt, corpus, tmp_path):
    # -v must still show open_clip's lines (otherwise the quiet test above would pass for the wrong reason).
    proc = cli("gare_build.cli", "-v", "build", "--checkpoint", str(ckpt), "--videos", str(corpus), "--out",
               str(tmp_path / "idx"), "--workers", "0", "--no-progress")
    assert proc.returncode in (0, 3), proc.stderr
    assert MODEL_BUILT in proc.stderr


def test_stats_and_verify_json(cli, built_index, ckpt):
    from tests.indexer.support import N_VIDEOS

    out, _ = built_index
    st = cli("gare_build.cli", "stats", "--out", str(out), "--json")
    assert st.returncode == 0, st.stderr
    stats = json.loads(st.stdout)
    assert stats["n"] == N_VIDEOS and stats["index_type"] == "flat"
    human = cli("gare_build.cli", "stats", "--out", str(out))
    assert human.returncode == 0 and "index_type" in human.stdout and "{" not in human.stdout
    v = cli("gare_build.cli", "verify", "--out", str(out), "--json", "--checkpoint", str(ckpt))
    assert v.returncode == 0, v.stderr
    rep = json.loads(v.stdout)
    assert rep["ok"] is True and rep["problems"] == [] and rep["version"]
    assert third_party_lines(st.stdout + st.stderr + v.stdout + v.stderr) == []


def test_verify_json_reports_problems(cli, built_index, tmp_path):
    import shutil

    out, _ = built_index
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    current = (broken / "CURRENT").read_text().strip()
    vdir = broken / "versions" / current if (broken / "versions" / current).is_dir() else broken / current
    target = next(p for p in sorted(vdir.iterdir()) if p.suffix == ".npy")
    target.write_bytes(target.read_bytes()[:-8])  # truncate one array
    v = cli("gare_build.cli", "verify", "--out", str(broken), "--json")
    assert v.returncode == 1
    rep = json.loads(v.stdout)
    assert rep["ok"] is False and rep["problems"]


def test_train_info_json(cli, ckpt):
    from gare.checkpoint import file_sha256

    proc = cli("gare_train.cli", "info", str(ckpt), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["sha256"] == file_sha256(ckpt) and info["model_config"]["embed_dim"] == 64
    assert info["queues"]["text"] == [256, 64]
    human = cli("gare_train.cli", "info", str(ckpt))
    assert human.returncode == 0 and file_sha256(ckpt) in human.stdout and "{" not in human.stdout


def test_fit_bad_manifest_fails_before_the_model(cli, tmp_path):
    bad = tmp_path / "captions.csv"
    bad.write_text("video,caption\nmissing/clip1.mp4,a red ball\n")
    proc = cli("gare_train.cli", "-v", "fit", "--model", "gare-test-tiny", "--train-manifest", str(bad),
               "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert "clip1.mp4" in proc.stderr and "relative to the manifest" in proc.stderr
    assert MODEL_BUILT not in proc.stderr  # -v would show it had the model been built
    assert not (tmp_path / "run").exists()


def test_fit_bad_columns_and_model_name(cli, tmp_path):
    bad = tmp_path / "captions.csv"
    bad.write_text("file,text\na.mp4,hello\n")
    proc = cli("gare_train.cli", "-v", "fit", "--model", "gare-test-tiny", "--train-manifest", str(bad))
    assert proc.returncode == 2 and "video and caption" in proc.stderr and MODEL_BUILT not in proc.stderr
    proc = cli("gare_train.cli", "fit", "--model", "gare-tiny-typo", "--train-manifest", str(bad))
    assert proc.returncode == 2 and "gare-tiny-typo" in proc.stderr and "gare-test-tiny" in proc.stderr
    proc = cli("gare_train.cli", "fit", "--model", "gare-test-tiny", "--synth", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "nowhere" in proc.stderr and "gare-train synth" in proc.stderr


def test_fit_too_little_data_fails_before_the_model(cli, corpus, tmp_path):
    vids = sorted(Path(corpus).glob("*.mp4"))[:2]
    man = tmp_path / "captions.csv"
    man.write_text("video,caption\n" + "".join(f"{v},caption {i}\n" for i, v in enumerate(vids)))
    proc = cli("gare_train.cli", "-v", "fit", "--model", "gare-test-tiny", "--train-manifest", str(man),
               "--batch-size", "8")
    assert proc.returncode == 2 and "fewer than one batch of 8" in proc.stderr and "--batch-size" in proc.stderr
    assert MODEL_BUILT not in proc.stderr


def test_index_build_bad_paths_fail_before_the_model(cli, ckpt, tmp_path):
    proc = cli("gare_build.cli", "-v", "build", "--checkpoint", str(ckpt), "--videos", str(tmp_path / "novideos"),
               "--out", str(tmp_path / "idx"))
    assert proc.returncode == 1 and "novideos" in proc.stderr and MODEL_BUILT not in proc.stderr
    proc = cli("gare_build.cli", "-v", "build", "--checkpoint", str(tmp_path / "no.safetensors"), "--videos",
               str(tmp_path), "--out", str(tmp_path / "idx"))
    assert proc.returncode == 1 and "no.safetensors" in proc.stderr and MODEL_BUILT not in proc.stderr


def test_serve_check_is_quiet_and_bad_index_fails_early(cli, built_index, tmp_path):
    out, _ = built_index
    proc = cli("gare_serve.cli", "--index", str(out), "--check")
    assert proc.returncode == 0, proc.stderr
    assert third_party_lines(proc.stdout + proc.stderr) == []
    proc = cli("gare_serve.cli", "--index", str(tmp_path / "noindex"), "--check", "--log-level", "debug")
    assert proc.returncode == 2 and "noindex" in proc.stderr and MODEL_BUILT not in proc.stderr
