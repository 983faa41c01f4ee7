"""What several benchmark scripts share: a tiny checkpoint and corpus, `gare-serve` in a
child process, keep-alive bursts and the per-worker request counters of /metrics.

bench/ imports product code only, never tests/: the helpers the tests have for the same jobs
(tests/indexer/support.py, tests/service/support.py) stay theirs. What a run records about itself (commit, command,
machine) is bench/harness.py's.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# A child process runs this checkout's code whether or not it is installed: the three source roots hold the
# packages, the root holds bench/ and tests/.
CHECKOUT_PATH = os.pathsep.join(str(REPO / root) for root in ("training", "indexer", "service", "."))


def stop_process(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Stop a server started by a benchmark: SIGTERM (it drains), SIGKILL if it is still up after ``timeout`` s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def randomize_psi(psi: Any, *, wstd: float = 0.3, ln_std: float = 0.2, other_std: float = 0.1) -> Any:
    """In place: psi starts at N(0, 0.02), so its Δ would be ~0; give it real weights (matrices ~ N(0, wstd),
    LayerNorm gamma ~ N(1, ln_std) and beta ~ N(0, ln_std), other parameters ~ N(0, other_std))."""
    import torch

    with torch.no_grad():
        for name, p in psi.named_parameters():
            noise = torch.randn(p.shape, dtype=p.dtype)
            if name.startswith("ln"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + ln_std * noise)
            elif p.ndim == 2:
                p.copy_(wstd * noise)
            else:
                p.copy_(other_std * noise)
    return psi


def tiny_checkpoint(path: Path, *, seed: int = 0) -> Path:
    """A `gare-test-tiny` checkpoint with non-trivial psi weights and a 256 x 64 text queue (for NCL biases)."""
    import torch

    from gare.checkpoint import save_checkpoint
    from gare.config import get_model_config
    from gare.model import GARE

    torch.manual_seed(seed)
    model = GARE.build(get_model_config("gare-test-tiny")).eval()
    randomize_psi(model.psi)
    queues = {"text": torch.randn(256, 64, generator=torch.Generator().manual_seed(seed + 1))}
    save_checkpoint(path, model, queues=queues)
    return path


def tiny_corpus(directory: Path, n: int, *, seed: int = 0) -> Path:
    """n short real mp4 files (32x32, 2 s at 8 fps) under directory/videos; returns that folder."""
    from gare_train.synth import SynthConfig, generate_corpus

    generate_corpus(directory, SynthConfig(n_videos=n, seed=seed, width=32, height=32, duration=2.0, fps=8.0,
                                           captions_per_video=1), progress=False)
    return directory / "videos"


class ServeProcess:
    """`gare-serve` (gare_serve.cli) in a child process on 127.0.0.1:<free port>, ready when /readyz says so."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, ready_timeout_s: float = 240) -> None:
        self.ready_timeout_s = ready_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "gare_serve.cli", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, "PYTHONPATH": CHECKOUT_PATH, "HF_HUB_OFFLINE": "1", "GARE_TORCH_THREADS": "1",
                    **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="gare-serve-", suffix=".log", delete=False)

    def __enter__(self) -> ServeProcess:
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
        raise RuntimeError(f"gare-serve did not become ready in {self.ready_timeout_s} s:\n{self.output()}")

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


_WORKER_REQUESTS = re.compile(r'gare_worker_requests\{pid="(\d+)"\} ([0-9.e+]+)')


def worker_requests(url: str) -> dict[int, float]:
    """{worker pid: its `gare_worker_requests` counter} from the server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=60).text
    return {int(m.group(1)): float(m.group(2)) for m in _WORKER_REQUESTS.finditer(text)}


def burst(port: int, queries: list[str], clients: int, requests: int) -> dict[str, Any]:
    """`clients` threads open one keep-alive connection each at the same instant (a barrier) and send `requests`
    `POST /v1/search` (k=10) back to back on it: wall time, q/s, p50/p99 latency and the failures seen."""
    gate = threading.Barrier(clients + 1)
    lat: list[list[float]] = [[] for _ in range(clients)]
    failures: list[str] = []

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            gate.wait()
            conn.connect()
            for j in range(requests):
                body = json.dumps({"query": queries[(i * requests + j) % len(queries)], "k": 10})
                t0 = time.perf_counter()
                conn.request("POST", "/v1/search", body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                if r.status != 200 or r.will_close:
                    failures.append(f"client {i} request {j}: HTTP {r.status}, will_close={r.will_close}")
                    return
                lat[i].append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - reported in the result
            failures.append(f"client {i}: {e!r}")
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    all_lat = sorted(x for xs in lat for x in xs)

    def pct(q: float) -> float:
        return round(1000 * all_lat[min(len(all_lat) - 1, int(q * len(all_lat)))], 1) if all_lat else float("nan")

    return {"wall_s": round(wall, 2), "qps": round(len(all_lat) / wall, 1), "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "errors": len(failures), "first_errors": failures[:3]}
