"""Attacks on a deployment (issue "a deployment you can trust"): hostile images, malformed media tokens, slow
clients, foreign Host headers, HEAD, the metrics key; the worker's RSS before and after each.

One live `gare-serve` (one worker: its pid is the process whose memory is measured) with search needing a key.
Every request goes to 127.0.0.1.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import re
import socket
import time

import httpx

from tests.robustness.test_robust_common import private_index, rss_mib

KEY = "deploy-attack-key"
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
RSS_LIMIT_MIB = 300.0
LEAK = re.compile(r"0x[0-9a-fA-F]{6,}|/tmp/|/home/|/root/|File \"|Traceback")


def _png(w: int, h: int, mode: str = "L") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (w, h), 90).save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def _slow_headers(port: int, every_s: float, limit_s: float) -> tuple[float, str]:
    """Send a request's headers one byte every `every_s`; (seconds until the server closed, what it answered)."""
    req = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    t0 = time.monotonic()
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as s:
        for i in range(len(req)):
            if time.monotonic() - t0 > limit_s:
                return time.monotonic() - t0, "still open"
            try:
                s.sendall(req[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            s.settimeout(every_s)
            try:
                chunk = s.recv(4096)
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
            got += chunk
            if not chunk or got:
                break
        with_answer = got.split(b"\r\n", 1)[0].decode("latin-1", "replace")
    return time.monotonic() - t0, with_answer or "closed"


def _slow_body(port: int, every_s: float, limit_s: float) -> tuple[float, str]:
    body = b'{"query": "' + b"a" * 100 + b'"}'
    head = (f"POST /v1/search HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as s:
        s.sendall(head)
        for i in range(len(body)):
            if time.monotonic() - t0 > limit_s:
                return time.monotonic() - t0, "still open"
            s.settimeout(every_s)
            try:
                chunk = s.recv(4096)
                return time.monotonic() - t0, chunk.split(b"\r\n", 1)[0].decode("latin-1", "replace") or "closed"
            except TimeoutError:
                pass
            except ConnectionResetError:
                return time.monotonic() - t0, "reset"
            try:
                s.sendall(body[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0, "closed"
    return time.monotonic() - t0, "body completed"


def test_deployment_attacks(figure, robust_env, tmp_path):
    from tests.service.support import UvicornProcess

    fig = figure("deploy_attacks", rows=[], rss_limit_mib=RSS_LIMIT_MIB, header_timeout_s=HEADER_TIMEOUT_S,
                 body_timeout_s=BODY_TIMEOUT_S)
    idx, _ = private_index(robust_env, tmp_path / "deploy")
    env = {"GARE_API_KEYS": KEY, "GARE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
           "GARE_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)}
    with UvicornProcess(["--index", str(idx), "--workers", "1", "--require-key-for-search", "--log-level", "warning"],
                        env=env) as srv:
        pid = srv.proc.pid
        auth = {"X-API-Key": KEY}
        c = httpx.Client(base_url=srv.base_url, timeout=120)

        def attack(name: str, fn, expect) -> None:
            before = rss_mib(pid)
            t0 = time.monotonic()
            statuses, note = fn()
            row = {"attack": name, "status": statuses, "seconds": round(time.monotonic() - t0, 2),
                   "rss_before_mib": round(before or 0, 1), "rss_after_mib": round(rss_mib(pid) or 0, 1), "note": note}
            row["rss_growth_mib"] = round(row["rss_after_mib"] - row["rss_before_mib"], 1)
            row["ok"] = all(expect(s) for s in statuses) and row["rss_growth_mib"] <= RSS_LIMIT_MIB
            fig["rows"].append(row)

        def image(data: bytes, ctype: str = "image/png"):
            def go():
                r = c.post("/v1/search/image", files={"image": ("x.png", data, ctype)}, headers=auth)
                leak = bool(LEAK.search(r.text)) if r.status_code >= 400 else False
                return [r.status_code], (r.json().get("detail", "")[:120] if r.status_code >= 400 else "") + \
                    (" LEAKS an address/path" if leak else "")
            return go

        clean4xx = lambda s: 400 <= s < 500  # noqa: E731
        attack("PNG 16,000,000 x 1 (377-byte class)", image(_png(16_000_000, 1)), clean4xx)
        attack("PNG 1 x 16,000,000", image(_png(1, 16_000_000)), clean4xx)
        big = _png(4000, 4000, "RGB")

        def eight():
            with cf.ThreadPoolExecutor(8) as pool:
                rs = list(pool.map(lambda _: c.post("/v1/search/image", files={"image": ("b.png", big, "image/png")},
                                                   headers=auth), range(8)))
            return [r.status_code for r in rs], f"{len(big)} bytes each"

        attack("8 concurrent 4000 x 4000 PNG", eight, lambda s: s == 200 or 400 <= s < 500)
        attack("corrupt PNG (error text)", image(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64), clean4xx)
        attack("content type 'IMAGE/PNG; x=y'", image(_png(64, 48, "RGB"), "IMAGE/PNG; x=y"), lambda s: s == 200)

        def token(tok: str):
            def go():
                return [c.get("/v1/videos/0/thumbnail", params={"token": tok}).status_code], ""
            return go

        attack("media token expiry '²'", token("²." + "A" * 43), lambda s: s == 401)
        attack("media token expiry of 4,301 digits", token("1" * 4301 + "." + "A" * 43), lambda s: s == 401)

        def slow_headers():
            secs, ans = _slow_headers(srv.port, 0.5, HEADER_TIMEOUT_S + 10)
            ok = secs <= HEADER_TIMEOUT_S + 1.5 and ans != "still open"
            return [408 if ok else 0], f"closed after {secs:.1f} s ({ans})"

        attack(f"headers at 1 byte / 0.5 s (bound {HEADER_TIMEOUT_S:g} s)", slow_headers, lambda s: s == 408)

        def slow_body():
            secs, ans = _slow_body(srv.port, 0.5, BODY_TIMEOUT_S + 10)
            ok = secs <= BODY_TIMEOUT_S + 1.5 and ans not in ("still open", "body completed")
            return [408 if ok else 0], f"answered after {secs:.1f} s ({ans})"

        attack(f"body at 1 byte / 0.5 s (bound {BODY_TIMEOUT_S:g} s)", slow_body, lambda s: s == 408)

        def host():
            return [c.get("/healthz", headers={"host": "evil.example"}).status_code], "DNS rebinding"

        attack("Host: evil.example on a loopback server", host, lambda s: s == 400)

        def head():
            vid = c.post("/v1/search", json={"query": "a ball", "k": 1}, headers=auth).json()["results"][0]["id"]
            paths = ("/", "/v1/index", f"/v1/videos/{vid}", f"/v1/videos/{vid}/file")
            rs = [c.head(p, headers=auth) for p in paths]
            return [r.status_code for r in rs], ", ".join(paths)

        attack("HEAD on GET routes", head, lambda s: s == 200)

        def metrics():
            return [c.get("/metrics").status_code], "no key"

        attack("/metrics without a key (search needs one)", metrics, lambda s: s == 401)
        # still serving after all of it
        r = c.post("/v1/search", json={"query": "a red ball", "k": 3}, headers=auth)
        fig["search_after"] = r.status_code
        c.close()
    bad = [row for row in fig["rows"] if not row["ok"]]
    assert fig["search_after"] == 200
    assert not bad, bad
