"""Bounds of ``POST /v1/search/image`` (issue 24): aspect ratio, decode-time reduction, decode concurrency,
content-type parsing and error bodies, against the real app (tiny model, real index: tests/service/support.py).

Memory is the worker's own: the app runs in this process (httpx's ASGI transport, real thread pool), and the
peak RSS growth of a block is VmHWM (reset through /proc/self/clear_refs) minus VmRSS at its start.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import resource
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from gare_search import by_example as E
from gare_serve.app import create_app
from tests.service.support import running_app, settings

URL = "/v1/search/image"
RSS_BUDGET_MB = 300
# what an error body must never carry: a heap address (Pillow's "<_io.BytesIO object at 0x7f...>"), a path, a traceback
LEAK = re.compile(r"0x[0-9a-f]{6,}|/tmp|/home|/root|File \"|Traceback", re.IGNORECASE)

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the RSS from /proc (Linux)")


# ------------------------------------------------------------------------------------------ images
def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def gray_png(w: int, h: int, idat: bytes | None = None) -> bytes:
    """A black 8-bit grayscale PNG written directly (the file stays tiny whatever its size); `idat` replaces
    the compressed pixel data (a header that promises more than the data holds)."""
    if idat is None:
        co = zlib.compressobj(9)
        row = b"\0" * (w + 1)  # filter byte + w black pixels
        rows_per_piece = max(1, (1 << 22) // len(row))
        parts, left = [], h
        while left:
            n = min(left, rows_per_piece)
            parts.append(co.compress(row * n))
            left -= n
        idat = b"".join(parts) + co.flush()
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + _chunk(b"IDAT", idat) + _chunk(b"IEND", b""))


def natural(w: int, h: int):
    """A natural-ish RGB picture: smooth colour gradients and a few filled shapes (drawn small, then enlarged)."""
    from PIL import Image, ImageDraw

    sw, sh = min(w, 480), min(h, 480)
    y, x = np.mgrid[0:sh, 0:sw].astype(np.float32)
    rgb = np.stack([127 + 100 * np.sin(x / sw * 3.1 + y / sh * 1.7), 127 + 100 * np.cos(y / sh * 4.3 - x / sw * 0.9),
                    255 * (x + y) / (sw + sh)], -1)
    im = Image.fromarray(rgb.clip(0, 255).astype(np.uint8), "RGB")
    d = ImageDraw.Draw(im)
    d.ellipse((sw * .1, sh * .2, sw * .45, sh * .7), fill=(230, 40, 40))
    d.rectangle((sw * .55, sh * .15, sw * .9, sh * .5), fill=(30, 60, 200))
    d.polygon([(sw * .5, sh * .6), (sw * .8, sh * .95), (sw * .2, sh * .95)], fill=(20, 180, 60))
    im = im.resize((w, h), Image.Resampling.BILINEAR) if (w, h) != (sw, sh) else im
    ImageDraw.Draw(im).ellipse((w * .6, h * .6, w * .7, h * .75), fill=(250, 250, 0))  # sharp edges at full size
    return im


def encoded(im, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------ memory
def _status_kb(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class PeakRSS:
    """Peak RSS growth (MB) of this process over a `with` block: VmHWM, reset at the start through
    /proc/self/clear_refs, minus VmRSS at the start; where the reset is refused, a 2-ms VmRSS sampler."""

    def __enter__(self) -> PeakRSS:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
                fh.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
        self.base = _status_kb("VmRSS")
        self.sampled, self._stop = self.base, threading.Event()
        self._thread = None
        if not self.hwm:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.sampled = max(self.sampled, _status_kb("VmRSS"))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        peak = _status_kb("VmHWM") if self.hwm else self.sampled
        self.growth_mb = (peak - self.base) / 1024


@contextlib.contextmanager
def address_space_guard(headroom_gb: float = 6.0):
    """RLIMIT_AS at the current address space + headroom for the block: should the bound regress, a request
    that would enlarge a 16,000,000 x 1 image fails with MemoryError instead of exhausting the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _status_kb("VmSize") * 1024 + int(headroom_gb * (1 << 30))
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    if soft != resource.RLIM_INFINITY and soft <= limit:
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# ------------------------------------------------------------------------------------------ app
@pytest.fixture(scope="module")
def client(service_env):
    with TestClient(create_app(settings(service_env["index"]))) as c:
        yield c


def post(client, data: bytes, content_type: str, name: str = "x.png", **form):
    return client.post(URL, files={"image": (name, data, content_type)}, data={"k": "3", **form})


def assert_clean_4xx(r, *words: str) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    detail = r.json()["detail"]
    assert isinstance(detail, str) and detail, r.text
    assert not LEAK.search(r.text), r.text
    for w in words:
        assert w in detail, (w, detail)


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("w,h", [(16_000_000, 1), (1, 16_000_000)])
def test_extreme_aspect_refused_from_the_header(service_env, w, h):
    """A tiny PNG of 16,000,000 x 1 (or 1 x 16,000,000) pixels, exactly max_image_pixels: before the aspect bound
    the model transform enlarged its short side to image_size (16e6 x 32 x 32 pixels here: memory exhausted).
    Now a 422 naming both sides and the limit, from the header, and the worker's peak RSS barely moves."""
    data = gray_png(w, h)
    assert len(data) < 64 * 1024

    async def go():
        app = create_app(settings(service_env["index"]))
        async with running_app(app, raise_app_exceptions=False) as c:
            warm = await c.post(URL, files={"image": ("a.png", encoded(natural(64, 48), "PNG"), "image/png")})
            assert warm.status_code == 200, warm.text
            with address_space_guard(), PeakRSS() as rss:
                t0 = time.perf_counter()
                r = await c.post(URL, files={"image": ("long.png", data, "image/png")}, data={"k": "3"})
                took = time.perf_counter() - t0
            return r, rss, took

    r, rss, took = asyncio.run(go())
    assert r.status_code == 422, (r.status_code, r.text[:300])
    assert_clean_4xx(r, f"{w}x{h}", "20")
    print(f"{w}x{h}: {r.status_code} in {took * 1000:.0f} ms, peak RSS growth {rss.growth_mb:.1f} MB")
    assert rss.growth_mb <= RSS_BUDGET_MB


def test_aspect_bound_is_the_setting(service_env):
    """max_image_aspect is read from the settings: 100 x 2 (50:1) passes at 64, is refused at the default 20."""
    data = encoded(natural(100, 2), "PNG")
    with TestClient(create_app(settings(service_env["index"], max_image_aspect=64.0))) as c:
        assert post(c, data, "image/png").status_code == 200
    with TestClient(create_app(settings(service_env["index"]))) as c:
        r = post(c, data, "image/png")
        assert r.status_code == 422 and "100x2" in r.text


def test_eight_concurrent_large_uploads_bounded(service_env):
    """8 uploads of 4000 x 4000 at once (4 PNG, 4 JPEG, ~0.3 MB each, 16 M pixels: the pixel limit) -> all 200,
    and the worker's peak RSS growth stays within the budget: JPEGs decode at reduced scale, PNGs are reduced
    right after decoding, and only image_decode_concurrency (2) of them hold pixels at any time."""
    im = natural(4000, 4000)
    uploads = [(f"{i}.png", encoded(im, "PNG"), "image/png") if i % 2 == 0 else
               (f"{i}.jpg", encoded(im, "JPEG", quality=85), "image/jpeg") for i in range(8)]
    del im

    async def go():
        app = create_app(settings(service_env["index"]))
        async with running_app(app, raise_app_exceptions=False) as c:
            warm = await c.post(URL, files={"image": ("a.png", encoded(natural(64, 48), "PNG"), "image/png")})
            assert warm.status_code == 200, warm.text
            with PeakRSS() as rss:
                t0 = time.perf_counter()
                rs = await asyncio.gather(*[c.post(URL, files={"image": u}, data={"k": "3"}) for u in uploads])
                took = time.perf_counter() - t0
            return rs, rss, took

    rs, rss, took = asyncio.run(go())
    print(f"8 x 4000x4000: {[r.status_code for r in rs]} in {took:.1f} s, peak RSS growth {rss.growth_mb:.1f} MB")
    for r in rs:
        assert r.status_code < 500, r.text[:300]
        if r.status_code >= 400:
            assert_clean_4xx(r)
    assert all(r.status_code == 200 for r in rs), [r.text[:200] for r in rs]
    assert rss.growth_mb <= RSS_BUDGET_MB


@pytest.mark.parametrize("slots", [1, 2])
def test_decode_concurrency_is_bounded(service_env, monkeypatch, slots):
    """At most image_decode_concurrency uploads are between the start of their decode and the end of their
    encode at once: the real decode_image and search_by_image, wrapped to count (the decode held 0.15 s so
    that the requests overlap)."""
    real_decode, real_search = E.decode_image, E.search_by_image
    lock = threading.Lock()
    state = {"active": 0, "peak": 0, "decodes": 0}

    def leave() -> None:
        with lock:
            state["active"] -= 1

    def decode(*args, **kw):
        with lock:
            state["active"] += 1
            state["decodes"] += 1
            state["peak"] = max(state["peak"], state["active"])
        time.sleep(0.15)
        try:
            return real_decode(*args, **kw)
        except BaseException:
            leave()
            raise

    def search(*args, **kw):
        try:
            return real_search(*args, **kw)
        finally:
            leave()

    monkeypatch.setattr(E, "decode_image", decode)
    monkeypatch.setattr(E, "search_by_image", search)
    data = encoded(natural(300, 200), "JPEG")

    async def go():
        app = create_app(settings(service_env["index"], image_decode_concurrency=slots))
        async with running_app(app, raise_app_exceptions=False) as c:
            return await asyncio.gather(*[c.post(URL, files={"image": ("a.jpg", data, "image/jpeg")}, data={"k": "2"})
                                          for _ in range(6)])

    rs = asyncio.run(go())
    assert [r.status_code for r in rs] == [200] * 6, [r.text[:200] for r in rs]
    assert state["decodes"] == 6 and state["active"] == 0
    assert state["peak"] == slots  # never more, and the requests did overlap up to the bound


@pytest.mark.parametrize("ctype", ["IMAGE/PNG", "image/png; x=y", " image/png ", "Image/Png ; charset=binary"])
def test_content_type_case_and_parameters(client, ctype):
    """Media types are case-insensitive and their parameters are not part of the type (RFC 9110 §8.3.1)."""
    r = post(client, encoded(natural(64, 48), "PNG"), ctype)
    assert r.status_code == 200, r.text
    assert r.json()["example"]["content_type"] == "image/png"


@pytest.mark.parametrize("ctype", ["text/plain", "image/svg+xml", "image/pngx", "application/octet-stream"])
def test_unknown_content_type_415(client, ctype):
    r = post(client, encoded(natural(64, 48), "PNG"), ctype)
    assert r.status_code == 415
    assert_clean_4xx(r, "image/png", "image/jpeg", "image/webp", "image/gif")


def _bad_inputs() -> list[tuple[str, bytes, str, str]]:
    """(case, bytes, declared type, words the message must carry): each way an upload can fail to decode."""
    png = encoded(natural(64, 48), "PNG")
    jpg = encoded(natural(64, 48), "JPEG")
    gif = encoded(natural(64, 48).convert("P"), "GIF")
    webp = encoded(natural(64, 48), "WEBP")
    # a valid header and CRCs whose compressed pixel data is garbage (zlib fails while decoding)
    bad_zlib = gray_png(64, 48, idat=b"\x78\x9c" + bytes(range(256)) * 4)
    bad_crc = png[:29] + bytes([png[29] ^ 0xFF]) + png[30:]  # IHDR's CRC broken
    return [
        ("garbage as png", b"hello, this is not an image" * 10, "image/png", "PNG"),
        ("garbage as jpeg", b"\xff\xd8\xff" + b"\x00" * 200, "image/jpeg", "JPEG"),
        ("garbage as gif", b"GIF89a" + b"\x00" * 5, "image/gif", "GIF"),
        ("garbage as webp", b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"\x00" * 20, "image/webp", "WEBP"),
        ("png declared as jpeg", png, "image/jpeg", "JPEG"),
        ("jpeg declared as png", jpg, "image/png", "PNG"),
        ("truncated png", png[: len(png) // 2], "image/png", "PNG"),
        ("truncated jpeg", jpg[: len(jpg) // 2], "image/jpeg", "JPEG"),
        ("truncated gif", gif[: len(gif) // 2], "image/gif", "GIF"),
        ("truncated webp", webp[: len(webp) // 2], "image/webp", "WEBP"),
        ("png with bad zlib data", bad_zlib, "image/png", "PNG"),
        ("png with bad crc", bad_crc, "image/png", "PNG"),
        ("png header only", png[:33], "image/png", "PNG"),
        ("empty", b"", "image/png", "empty"),
        # Pillow's own bomb guard (2 x Image.MAX_IMAGE_PIXELS) fires at open: still our message
        ("header of 20000 x 20000", gray_png(20000, 20000, idat=b""), "image/png", "pixels"),
        ("header of 5000 x 5000", gray_png(5000, 5000, idat=b""), "image/png", "pixels"),
    ]


@pytest.mark.parametrize("case,data,ctype,words", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_decode_errors_are_fixed_messages(client, case, data, ctype, words):
    """Each failure is a 4xx whose detail is a fixed message naming the format: never Pillow's text, which can
    carry the buffer's repr with its heap address, a path or a traceback."""
    r = post(client, data, ctype)
    assert r.status_code == 422, (case, r.status_code, r.text[:300])
    assert_clean_4xx(r, words)


def test_no_error_body_of_the_route_leaks(client):
    """Every 4xx the image route answers (the cases above, plus size, type, aspect and form errors)."""
    png = encoded(natural(64, 48), "PNG")
    bodies = [post(client, d, t) for _, d, t, _ in _bad_inputs()]
    bodies += [post(client, b"\x89PNG" + b"0" * (5 << 20), "image/png"), post(client, png, "text/html"),
               post(client, gray_png(1000, 10), "image/png"), post(client, png, "image/png", k="0"),
               post(client, png, "image/png", k="5", candidates="2"), client.post(URL, data={"k": "3"})]
    for r in bodies:
        assert 400 <= r.status_code < 500, r.text[:300]
        assert not LEAK.search(r.text), r.text


# ------------------------------------------------------------------------------------------ reduction
def _full_size(data: bytes):
    """What the service decoded before the reduction: the whole image, converted to RGB."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_reduced_decode_matches_full_size(model_and_index, fmt):
    """The image handed to the model transform has its short side at 2 x image_size (JPEG: decoded at 1/8
    scale by draft, then reduced); the model's input and the image embedding are those of the full-size
    image up to resampling. Checked at the tiny model's image_size (embeddings) and at CLIP's 224 (inputs)."""
    import torch
    from PIL import Image

    from gare.video import clip_transform

    model = model_and_index[0]
    data = encoded(natural(3000, 2000), fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    full = _full_size(data)
    for size in (model.cfg.image_size, 224):
        small = E.decode_image(data, f"image/{fmt.lower()}", max_pixels=16_000_000, max_aspect=20.0, image_size=size)
        assert small.mode == "RGB" and min(small.size) == 2 * size
        assert small.size[0] / small.size[1] == pytest.approx(1.5, rel=0.01)
        a, b = clip_transform(size)(full), clip_transform(size)(small)
        assert a.shape == b.shape == (3, size, size)
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
        mad = (a - b).abs().mean().item()
        assert cos > 0.999 and mad < 0.02, (size, cos, mad)  # inputs normalised to unit std per channel
    u_full, u_small = E.encode_image(model, full), E.encode_image(model, E.decode_image(
        data, f"image/{fmt.lower()}", max_pixels=16_000_000, image_size=model.cfg.image_size))
    cos = float(u_full[0] @ u_small[0])
    # the scale of "close" for this model: the same picture mirrored (~0.98 with the tiny test model)
    mirrored = float(u_full[0] @ E.encode_image(model, full.transpose(Image.Transpose.FLIP_LEFT_RIGHT))[0])
    print(f"{fmt}: embedding cosine reduced vs full-size {cos:.5f} (mirrored image: {mirrored:.5f})")
    assert cos > 0.999 and 1 - cos < 0.1 * (1 - mirrored)


def test_small_images_are_not_reduced():
    """An image whose short side is already <= 2 x image_size is returned as decoded (RGB)."""
    data = encoded(natural(120, 64).convert("L"), "PNG")
    im = E.decode_image(data, "image/png", max_pixels=16_000_000, max_aspect=20.0, image_size=32)
    assert im.size == (120, 64) and im.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(im), np.asarray(_full_size(data)))


def test_image_type_parsing():
    assert E.image_type("IMAGE/JPEG") == "image/jpeg"
    assert E.image_type(" image/webp ;q=1") == "image/webp"
    assert E.image_type("image/gif;") == "image/gif"
    for bad in (None, "", "image", "image/png/x", "text/png", "image/x-png"):
        assert E.image_type(bad) is None


# ------------------------------------------------------------------------ decode queue, budget, error numbers
def test_decode_queue_is_bounded_with_a_503(service_env, monkeypatch):
    """1 decode slot and a queue of 2: of 8 uploads at once, 3 are held (one decoding, two waiting) and the other
    5 are answered 503 with Retry-After at once, naming the settings. Before: all 8 waited, however many came.
    The real decode_image, held on an event until the 503s are in (so the 3 are still in the worker then)."""
    real_decode = E.decode_image
    release = threading.Event()

    def decode(*args, **kw):
        assert release.wait(60), "the test never released the decodes"
        return real_decode(*args, **kw)

    monkeypatch.setattr(E, "decode_image", decode)
    data = encoded(natural(120, 90), "PNG")

    async def go():
        app = create_app(settings(service_env["index"], image_decode_concurrency=1, image_decode_queue=2))
        async with running_app(app, raise_app_exceptions=False) as c:
            tasks = [asyncio.create_task(c.post(URL, files={"image": ("a.png", data, "image/png")}, data={"k": "2"}))
                     for _ in range(8)]
            deadline = time.monotonic() + 60  # hang guard
            while sum(t.done() for t in tasks) < 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            early = [t.result() for t in tasks if t.done()]
            release.set()
            return early, await asyncio.gather(*tasks)

    early, rs = asyncio.run(go())
    assert len(early) == 5 and all(r.status_code == 503 for r in early), [(r.status_code, r.text[:200]) for r in early]
    for r in early:
        assert r.headers["retry-after"] == "1"
        assert "image_decode_queue" in r.json()["detail"], r.text
    assert sorted(r.status_code for r in rs) == [200] * 3 + [503] * 5


def test_decode_budget_stops_a_costly_decode(service_env):
    """A 4000 x 4000 PNG of one colour (~60 KB: every pixel decoded, ~0.2 s of CPU) against a budget of 5 ms of
    CPU: stopped inside the decode, 422 naming the budget; under the default budget it is served."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4000, 4000), (10, 200, 30)).save(buf, "PNG")
    data = buf.getvalue()
    assert len(data) < 128 * 1024
    with pytest.raises(E.DecodeBudgetExceeded, match="0.005 s"):
        E.decode_image(data, "image/png", max_pixels=16_000_000, image_size=32, budget_s=0.005)
    with TestClient(create_app(settings(service_env["index"], image_decode_budget_s=0.005))) as c:
        r = post(c, data, "image/png")
        assert r.status_code == 422, r.text
        assert_clean_4xx(r, "0.005 s", "image_decode_budget_s")
    with TestClient(create_app(settings(service_env["index"]))) as c:
        assert post(c, data, "image/png").status_code == 200


@pytest.mark.parametrize("fmt,ctype", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("GIF", "image/gif"),
                                       ("WEBP", "image/webp")])
def test_a_budget_that_is_not_reached_changes_nothing(fmt, ctype):
    """The budgeted decode (small blocks, checks between steps) gives the same pixels as the unbudgeted one."""
    data = encoded(natural(640, 480), fmt)
    plain = E.decode_image(data, ctype, max_pixels=16_000_000, image_size=64)
    budgeted = E.decode_image(data, ctype, max_pixels=16_000_000, image_size=64, budget_s=600.0)
    assert plain.size == budgeted.size and plain.mode == budgeted.mode
    assert np.array_equal(np.asarray(plain), np.asarray(budgeted))


def test_error_texts_keep_their_numbers(client):
    """The scrubber of error texts took "0x1000..." inside "10000x10000" for a memory address: the client read
    "image is 10000x… = 100000000 pixels". Addresses are still scrubbed (test_http_surface.py)."""
    r = post(client, gray_png(10000, 10000, idat=b"x"), "image/png")
    assert r.status_code == 422, r.text
    assert_clean_4xx(r, "10000x10000 = 100000000 pixels", "16000000")
