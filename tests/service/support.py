"""Shared helpers for the service tests (no tests here).

Test indexes are made the real way: ``gare_train.synth.generate_corpus`` writes H.264 mp4 files, a tiny
GARE checkpoint (psi with non-trivial weights and an NCL text queue) is saved with ``save_checkpoint``,
and ``gare_build.build.build`` (what ``gare-index build`` runs) indexes them: :func:`make_service_env`, built
once per test run by the session fixture ``service_env`` (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.psi_weights import randomize_psi

REPO = Path(__file__).resolve().parents[2]


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    import torch

    from gare.checkpoint import save_checkpoint
    from gare.config import get_model_config
    from gare.model import GARE

    torch.manual_seed(seed)
    model = GARE.build(get_model_config("gare-test-tiny")).eval()
    randomize_psi(model.psi)  # psi at N(0, 0.02) would make the rerank a no-op
    queue = torch.nn.functional.normalize(torch.randn(64, model.cfg.embed_dim), dim=-1)
    save_checkpoint(path, model, queues={"text": queue})
    return path


def build_index(checkpoint: Path, videos: Path | str, out: Path, **opts: Any) -> Path:
    from gare_build.build import BuildOptions, build

    build(str(checkpoint), str(videos), str(out), BuildOptions(workers=0, progress=False, **opts))
    return out


def make_service_env(root: Path) -> dict[str, Any]:
    """{root, corpus, videos, checkpoint, index, seg_index (1-s segments), captions} under `root`; read-only for
    tests (copy what you change). The session fixture ``service_env`` builds it once."""
    import json

    from gare_train.synth import SynthConfig, generate_corpus

    info = generate_corpus(root / "corpus", SynthConfig(n_videos=16, seed=0, duration=2.0, captions_per_video=2), progress=False)
    ckpt = make_checkpoint(root / "tiny.safetensors")
    idx = build_index(ckpt, info["videos_dir"], root / "index")
    seg = build_index(ckpt, info["videos_dir"], root / "seg_index", segment=1.0)
    with open(info["manifest"], encoding="utf-8") as fh:
        captions = [json.loads(line)["captions"][0] for line in fh]
    return dict(root=root, corpus=Path(info["out_dir"]), videos=Path(info["videos_dir"]), checkpoint=ckpt,
                index=idx, seg_index=seg, captions=captions)


def copy_index(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def settings(index: Path, **kw: Any):
    from gare_serve.settings import Settings

    kw.setdefault("batch_max_wait_ms", 1.0)
    # the model's own text tower, so that in-process results compare exactly with the offline search; the
    # `auto` default (int8 on the CPU) has its own tests in test_serve_scale.py
    kw.setdefault("text_encoder", "fp32")
    # whole-result caching off: these tests watch the stages run (the embedding cache, the batcher, the rerank);
    # the result cache has its own tests (test_result_cache.py)
    kw.setdefault("result_cache_entries", 0)
    # in-process clients send Host: testserver; the loopback default (Settings.trusted_host_list) has its own tests
    kw.setdefault("trusted_hosts", "testserver,127.0.0.1,localhost")
    return Settings(index=index, **kw)


@contextlib.asynccontextmanager
async def running_app(app, *, raise_app_exceptions: bool = True):
    """Run the app's lifespan and yield an httpx client talking to it in process. `raise_app_exceptions=False`:
    the client sees a 500 as a 500 (what a real client gets), not as the app's exception."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as client:
            yield client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UvicornProcess:
    """`gare-serve` (gare_serve.cli) in a child process on 127.0.0.1:<free port>."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, ready_timeout_s: float = 240) -> None:
        self.ready_timeout_s = ready_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "gare_serve.cli", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "GARE_TORCH_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="gare-serve-", suffix=".log", delete=False)

    def __enter__(self) -> UvicornProcess:
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + self.ready_timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gare-serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base_url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"gare-serve did not become ready:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return None if self.proc is None else self.proc.returncode

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


def png_bytes(color: tuple[int, int, int] = (30, 200, 30), size: tuple[int, int] = (48, 32)) -> bytes:
    """A small solid-colour PNG, for the image routes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def answers_here(s, calls: list[tuple[str, dict[str, Any]]], timeout_s: float) -> list[dict]:
    """The in-process app's JSON answers to ``calls`` (``(path, httpx post keywords)``, in order) for settings ``s``."""
    import asyncio

    from gare_serve.app import create_app

    async def go() -> list[dict]:
        async with running_app(create_app(s)) as c:
            return [(await c.post(path, **kw)).json() for path, kw in calls]

    return asyncio.run(asyncio.wait_for(go(), timeout_s))


def answers_in_a_fresh_process(s, calls: list[tuple[str, dict[str, Any]]], timeout_s: float) -> list[dict]:
    """:func:`answers_here`, computed in a fresh spawned interpreter: nothing an earlier test left in this process
    reaches a reference for bitwise comparisons (the rerank's kept query folds, or a pool thread's torch intra-op
    count, which torch keeps from the first parallel op that thread ran, whatever the process's count is now)."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(answers_here, s, calls, timeout_s).result(timeout=timeout_s)
