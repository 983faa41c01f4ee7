"""The README's screenshot: the search page of a running demo with real results, taken in headless Chromium.

    bash run.sh demo &                                   # the demo on 127.0.0.1:8000
    python -m bench.demo_screenshot --url http://127.0.0.1:8000 --query "three cyan balls rise slowly" \
        --out docs/img/demo-search.png

bench/quickstart.py --screenshot calls it on the demo it has just started, with a held-out caption. The browser
is the one the page test uses (Debian's `chromium`, or GARE_CHROMIUM), driven by Playwright for Python;
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "service/gare_demo/",
    "service/gare_serve/web/",
)


CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_path() -> str:
    path = os.environ.get("GARE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).is_file():
        raise FileNotFoundError(f"Chromium not found at {path} (apt-get install -y chromium, or set GARE_CHROMIUM)")
    return path


def screenshot(base_url: str, query: str, out: Path, *, width: int = 1280, height: int = 820) -> Path:
    """Search `query` on the page at `base_url` and save the viewport (results with their thumbnails) as PNG."""
    from playwright.sync_api import sync_playwright

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(base_url.rstrip("/") + "/")
            page.wait_for_function("() => document.getElementById('index-info').textContent.includes('entries')")
            page.fill("#q", query)
            page.press("#q", "Enter")
            page.wait_for_selector(".card")
            # every visible thumbnail decoded, so the picture shows the videos and not empty boxes
            page.wait_for_function(
                "() => [...document.querySelectorAll('.card img')].slice(0, 12).every(i => i.complete && i.naturalWidth > 0)"
            )
            tmp = out.with_name(out.name + ".tmp.png")
            page.screenshot(path=str(tmp), full_page=False)
            os.replace(tmp, out)
        finally:
            browser.close()
    if out.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        raise RuntimeError(f"{out} is not a PNG")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--query", required=True)
    p.add_argument("--out", default="docs/img/demo-search.png")
    args = p.parse_args(argv)
    print(screenshot(args.url, args.query, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
