"""docs/search-your-own-videos.md, run as written: its bash blocks on a folder of generated mp4 files.

Steps 1-2 (variables, build, verify, stats) run through bash exactly as the page shows them; step 3's
`gare-serve` line is started in the background with the same arguments, then searched by text and by example.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx

from tests.checkout import CHECKOUT_PATH
from tests.service.support import REPO, UvicornProcess

DOC = REPO / "docs" / "search-your-own-videos.md"


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)


def test_walkthrough_runs_as_written(tmp_path, ckpt):
    from gare_train.synth import SynthConfig, generate_corpus

    blocks = bash_blocks()
    assert len(blocks) == 3, "the page has three steps"
    generate_corpus(tmp_path / "gen", SynthConfig(n_videos=6, seed=3, duration=2.0), progress=False)
    videos = tmp_path / "my videos"  # a space in the path, as a user's folder may have
    (videos / "holiday").mkdir(parents=True)
    for i, p in enumerate(sorted((tmp_path / "gen" / "videos").glob("*.mp4"))):
        (videos / ("holiday" if i % 2 else "") / p.name).write_bytes(p.read_bytes())
    index = tmp_path / "index"
    venv_bin = Path(sys.executable).parent
    env = {**os.environ, "VIDEOS": str(videos), "CKPT": str(ckpt), "INDEX": str(index), "GARE_VENV": str(venv_bin.parent),
           "PYTHONPATH": CHECKOUT_PATH, "HF_HUB_OFFLINE": "1"}
    script = "set -euo pipefail\n" + blocks[0] + blocks[1]
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout and (index / "CURRENT").is_file()
    assert re.search(r"^n\s+6$", proc.stdout, flags=re.M), proc.stdout  # stats: six videos indexed

    serve = shlex.split(blocks[2].strip().replace('"$INDEX"', shlex.quote(str(index)))
                        .replace('"$VIDEOS"', shlex.quote(str(videos))))
    assert serve[0] == "gare-serve"
    with UvicornProcess(serve[1:]) as srv:
        r = httpx.post(srv.base_url + "/v1/search", json={"query": "a red circle rises", "k": 3}, timeout=60)
        assert r.status_code == 200, r.text
        hits = r.json()["results"]
        assert len(hits) == 3
        paths = {h["metadata"]["path"] for h in hits}
        assert all((videos / p).is_file() for p in paths), paths  # shown relative to --library-root
        r = httpx.post(srv.base_url + "/v1/search", json={"video_id": hits[0]["id"], "k": 3}, timeout=60)
        assert r.status_code == 200 and hits[0]["id"] not in [h["id"] for h in r.json()["results"]]
