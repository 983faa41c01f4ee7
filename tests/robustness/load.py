"""A bounded, closed-loop load test of a running `gare-serve` (127.0.0.1 only).

    python -m tests.robustness.load --spawn --clients 16 --duration 60          # builds a tiny index, starts gare-serve
    python -m tests.robustness.load --url http://127.0.0.1:8000 --pid PID --clients 16 --duration 60 --requests 100000

N client threads each keep one HTTP/1.1 keep-alive connection and send `POST /v1/search` back to back until
the duration *or* the request count is reached (whichever comes first), so a run is bounded both ways.
Every request is accounted for: a response (2xx / 4xx / 5xx) or a *dropped* request (connection error,
timeout, truncated or unparsable body). While the load runs a sampler reads the server's resident memory
(VmRSS of /proc/PID/status) every `--rss-interval` seconds; the report compares the median RSS of the first
and the last window (one minute when the run lasts at least 3 minutes, else a quarter of the run).

The server's own request counter (`gare_http_requests_total` in /metrics) is read before and after, so
requests the server saw and requests the clients sent can be compared (none lost on either side).

`run_load()` is what tests/robustness/test_robust_load.py calls (bench/robustness.py runs those tests). Traffic never leaves the
machine: any URL whose host is not a loopback address is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.indexer.support import make_corpus
from tests.service.support import UvicornProcess, build_index, make_checkpoint

QUERIES: tuple[str, ...] = tuple(
    f"{n} {c} {s} {m}{tail}"
    for n, c, s, m, tail in zip(
        ["a", "two", "three", "one", "a small", "a big"] * 40,
        ["red", "green", "blue", "yellow", "orange", "purple", "pink", "cyan"] * 30,
        ["circle", "square", "triangle", "diamond", "cross"] * 48,
        ["rises", "falls", "slides to the left", "moves to the right", "bounces", "stays still"] * 40,
        ["", " on a black background", ", then it stops", " slowly", " fast", " on white"] * 40,
        strict=False,
    )
)


def check_loopback(url: str) -> str:
    """`url` unchanged when its host is a loopback address (127.0.0.0/8, ::1, localhost); ValueError otherwise."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return url
    try:
        if ipaddress.ip_address(host).is_loopback:
            return url
    except ValueError:
        pass
    raise ValueError(f"refusing to send load to {url!r}: only loopback addresses (127.0.0.1) are allowed")


def read_rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB (None when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssSampler:
    """Samples VmRSS of `pid` every `interval` seconds in a thread: `samples` = [(t since start, KiB)]."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._t0 = 0.0

    def _run(self) -> None:
        while True:
            v = read_rss_kib(self.pid)
            if v is not None:
                self.samples.append((time.monotonic() - self._t0, v))
            if self._stop.wait(self.interval):
                break

    def __enter__(self) -> RssSampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def rss_summary(samples: Sequence[tuple[float, int]], duration: float) -> dict[str, Any]:
    """Median RSS (MiB) of the first and last window; window = 60 s for runs >= 180 s, else a quarter."""
    if not samples:
        return {"n_samples": 0}
    window = 60.0 if duration >= 180 else max(duration / 4.0, 1.0)
    end = samples[-1][0]
    first = [v for t, v in samples if t <= window] or [samples[0][1]]
    last = [v for t, v in samples if t >= end - window] or [samples[-1][1]]
    f_med, l_med = statistics.median(first) / 1024, statistics.median(last) / 1024
    return {
        "n_samples": len(samples),
        "window_s": round(window, 1),
        "first_window_median_mib": round(f_med, 1),
        "last_window_median_mib": round(l_med, 1),
        "growth_mib": round(l_med - f_med, 1),
        "growth_pct": round(100.0 * (l_med - f_med) / f_med, 2) if f_med else None,
        "min_mib": round(min(v for _, v in samples) / 1024, 1),
        "max_mib": round(max(v for _, v in samples) / 1024, 1),
    }


_METRIC_RE = re.compile(r'^gare_http_requests_total\{(?P<labels>[^}]*)\}\s+(?P<value>[0-9.eE+-]+)$')


def server_request_count(base_url: str, route: str = "/v1/search") -> int:
    """Requests to `route` the server has counted so far (sum over codes), from its /metrics."""
    text = httpx.get(check_loopback(base_url) + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        m = _METRIC_RE.match(line)
        if m and f'route="{route}"' in m.group("labels"):
            total += float(m.group("value"))
    return int(total)


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, max(0, round(q / 100.0 * (len(sorted_values) - 1))))
    return sorted_values[i]


@dataclass
class LoadResult:
    clients: int
    duration_s: float
    max_requests: int | None
    sent: int = 0
    answered: int = 0
    dropped: int = 0
    status: dict[str, int] = field(default_factory=dict)
    errors_5xx: int = 0
    errors_4xx: int = 0
    bad_bodies: int = 0
    qps: float = 0.0
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    server_counted: int | None = None
    index_versions: dict[str, int] = field(default_factory=dict)
    rss: dict[str, Any] = field(default_factory=dict)
    drop_reasons: dict[str, int] = field(default_factory=dict)
    during: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        r = self.rss
        return (
            f"{self.clients} clients, {self.duration_s:.0f} s: {self.sent} requests, {self.qps:.1f} q/s, "
            f"p50 {self.p50_ms} ms, p99 {self.p99_ms} ms, 5xx {self.errors_5xx}, dropped {self.dropped}; "
            f"RSS {r.get('first_window_median_mib')} -> {r.get('last_window_median_mib')} MiB"
        )


def run_load(
    base_url: str,
    *,
    clients: int = 16,
    duration_s: float = 20.0,
    max_requests: int | None = None,
    pid: int | None = None,
    k: int = 10,
    timeout_s: float = 60.0,
    rss_interval_s: float = 1.0,
    queries: Sequence[str] = QUERIES,
    headers: dict[str, str] | None = None,
    during: Callable[[threading.Event], dict[str, Any] | None] | None = None,
) -> LoadResult:
    """Closed-loop load: `clients` threads send POST /v1/search until `duration_s` or `max_requests`.

    `during(stop_event)` (optional) runs in its own thread while the load runs (e.g. index reloads); what it
    returns is stored in `result.during`. It should return soon after `stop_event` is set.
    """
    base_url = check_loopback(base_url.rstrip("/"))
    res = LoadResult(clients=clients, duration_s=duration_s, max_requests=max_requests)
    lock = threading.Lock()
    latencies: list[float] = []
    status: Counter[str] = Counter()
    versions: Counter[str] = Counter()
    drops: Counter[str] = Counter()
    counters = {"sent": 0, "answered": 0, "dropped": 0, "bad": 0}
    stop = threading.Event()
    start_barrier = threading.Barrier(clients + 1)

    def take_ticket() -> bool:
        with lock:
            if stop.is_set() or (max_requests is not None and counters["sent"] >= max_requests):
                return False
            counters["sent"] += 1
            return True

    def client(i: int) -> None:
        n = i
        with httpx.Client(base_url=base_url, timeout=timeout_s, headers=headers or {}) as c:
            start_barrier.wait()
            while take_ticket():
                q = queries[n % len(queries)]
                n += clients
                t = time.perf_counter()
                try:
                    r = c.post("/v1/search", json={"query": q, "k": k})
                    body = r.content
                except httpx.HTTPError as e:  # timeouts, resets, protocol errors: the request got no answer
                    with lock:
                        counters["dropped"] += 1
                        drops[type(e).__name__] += 1
                    continue
                dt = time.perf_counter() - t
                version = None
                ok_body = True
                if r.status_code == 200:
                    try:
                        doc = json.loads(body)
                        version = doc["index_version"]
                        ok_body = isinstance(doc["results"], list) and len(doc["results"]) > 0
                    except (ValueError, KeyError, TypeError):
                        ok_body = False
                with lock:
                    counters["answered"] += 1
                    status[str(r.status_code)] += 1
                    latencies.append(dt)
                    if version is not None:
                        versions[version] += 1
                    if not ok_body:
                        counters["bad"] += 1

    before = server_request_count(base_url)
    threads = [threading.Thread(target=client, args=(i,), name=f"load-{i}", daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    during_out: dict[str, Any] = {}

    def run_during() -> None:
        try:
            during_out.update(during(stop) or {})  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - reported, and the caller's checks fail on it
            during_out["error"] = f"{type(e).__name__}: {e}"

    sampler = RssSampler(pid, rss_interval_s) if pid else contextlib.nullcontext()
    with sampler:
        start_barrier.wait()
        t0 = time.monotonic()
        dthread = threading.Thread(target=run_during, name="load-during", daemon=True) if during else None
        if dthread:
            dthread.start()
        while time.monotonic() - t0 < duration_s:
            with lock:
                if max_requests is not None and counters["sent"] >= max_requests:
                    break
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(timeout=timeout_s + 10)
        elapsed = time.monotonic() - t0
        if dthread:
            dthread.join(timeout=120)
    stuck = sum(t.is_alive() for t in threads)
    res.duration_s = round(elapsed, 2)
    res.sent, res.answered = counters["sent"], counters["answered"]
    res.dropped = res.sent - res.answered  # errors without a response + requests that never finished
    if stuck:
        drops["client thread stuck"] += stuck
    res.bad_bodies = counters["bad"]
    res.status = dict(sorted(status.items()))
    res.errors_5xx = sum(v for s, v in status.items() if s.startswith("5"))
    res.errors_4xx = sum(v for s, v in status.items() if s.startswith("4"))
    res.qps = round(res.answered / elapsed, 2) if elapsed > 0 else 0.0
    lat = sorted(x * 1000 for x in latencies)
    for name, q in (("p50_ms", 50), ("p90_ms", 90), ("p99_ms", 99)):
        v = percentile(lat, q)
        setattr(res, name, None if v is None else round(v, 2))
    res.max_ms = round(lat[-1], 2) if lat else None
    res.index_versions = dict(sorted(versions.items()))
    res.drop_reasons = dict(drops)
    res.during = during_out
    with contextlib.suppress(httpx.HTTPError):
        res.server_counted = server_request_count(base_url) - before
    if pid:
        res.rss = rss_summary(sampler.samples, elapsed)  # type: ignore[union-attr]
        res.rss["samples"] = [(round(t, 1), round(v / 1024, 1)) for t, v in sampler.samples]  # type: ignore[union-attr]
    return res


def assert_load_held(res: LoadResult, *, rss_growth_mib: float = 64.0, rss_growth_pct: float = 10.0) -> None:
    """The acceptance criteria: no 5xx, nothing dropped, every request counted by the server, flat RSS."""
    problems = []
    if res.sent == 0:
        problems.append("no request was sent")
    if res.errors_5xx:
        problems.append(f"{res.errors_5xx} responses were 5xx: {res.status}")
    if res.errors_4xx:
        problems.append(f"{res.errors_4xx} responses were 4xx: {res.status}")
    if res.dropped:
        problems.append(f"{res.dropped} requests were dropped: {res.drop_reasons}")
    if res.bad_bodies:
        problems.append(f"{res.bad_bodies} 200 responses had an invalid body")
    if res.answered != res.sent:
        problems.append(f"sent {res.sent} but {res.answered} were answered")
    if res.server_counted is not None and res.server_counted != res.sent:
        problems.append(f"the clients sent {res.sent} requests, the server counted {res.server_counted}")
    g = res.rss.get("growth_mib")
    if g is not None and g > max(rss_growth_mib, res.rss["first_window_median_mib"] * rss_growth_pct / 100.0):
        problems.append(f"resident memory grew by {g} MiB ({res.rss})")
    if problems:
        raise AssertionError("load test failed: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------ --spawn
@contextlib.contextmanager
def spawned_server(workdir: Path, n_videos: int = 24, extra_args: Sequence[str] = (), env: dict[str, str] | None = None):
    """A tiny checkpoint + corpus + index under `workdir` and `gare-serve` on 127.0.0.1:<free port>.

    Yields (base_url, pid, index_dir)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(workdir / "tiny.safetensors")
    videos = make_corpus(workdir / "corpus", n=n_videos)
    index = build_index(ckpt, videos, workdir / "index")
    with UvicornProcess(["--index", str(index), "--log-level", "warning", *extra_args], env=env) as srv:
        yield srv.base_url, srv.proc.pid, index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="base URL of a running gare-serve (loopback only)")
    p.add_argument("--pid", type=int, help="server process id, to sample its resident memory")
    p.add_argument("--spawn", action="store_true", help="build a tiny index and start gare-serve for the run")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=60.0, help="seconds (the run stops at --duration or --requests)")
    p.add_argument("--requests", type=int, default=None, help="at most this many requests")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout (s); a timeout counts as dropped")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if not args.spawn and not args.url:
        p.error("give --url (and --pid) of a running server, or --spawn")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.spawn:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="gare-load-") as tmp, \
                spawned_server(Path(tmp), env={"GARE_TORCH_THREADS": "1"}) as (url, pid, _):
            res = run_load(url, clients=args.clients, duration_s=args.duration, max_requests=args.requests, pid=pid,
                           k=args.k, timeout_s=args.timeout)
    else:
        res = run_load(args.url, clients=args.clients, duration_s=args.duration, max_requests=args.requests,
                       pid=args.pid, k=args.k, timeout_s=args.timeout)
    print(res.summary())
    if args.json:
        Path(args.json).write_text(json.dumps(res.to_dict(), indent=1))
    try:
        assert_load_held(res)
    except AssertionError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
