"""gare_serve.heap_trim: the freed heap of a burst is given back (glibc malloc_trim), and the serving
loop's trimmer does it once the process has grown by its threshold. Each case runs in its own interpreter, whose
heap it owns."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from gare_serve.heap_trim import rss_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux only")

# ~200 MB of 2 kB blocks (malloc's, not Python's small-object allocator), of which one in 64 stays alive, the last
# one included: free() cannot shrink the heap past live blocks, so the pages between them stay resident
PRELUDE = textwrap.dedent("""
    import asyncio, json
    from gare_serve import heap_trim as A
    MiB = 1 << 20
    base = A.rss_bytes()

    def burst():
        blocks = [bytearray(2000) for _ in range(100_000)]
        return blocks[::64] + [blocks[-1]]
""")


def _run(body: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_rss_bytes_reads_this_process():
    with open("/proc/self/status") as fh:
        vmrss = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    assert abs(rss_bytes() - vmrss) < 16 << 20


def test_trim_gives_back_the_pages_between_live_blocks():
    r = _run("""
        keep = burst()
        grown = A.rss_bytes()
        released = A.trim()
        print(json.dumps({"grown": (grown - base) / MiB, "after": (A.rss_bytes() - base) / MiB, "released": released}))
    """)
    assert r["grown"] > 150, r  # the burst really stayed resident
    assert r["released"] and r["after"] < 40, r  # 1 in 64 blocks alive: a few MB, not 200


@pytest.mark.parametrize("growth_mib, trimmed", [(64, True), (1024, False)])
def test_the_trimmer_trims_once_the_free_heap_grew_by_its_threshold(growth_mib, trimmed):
    """The burst is alive for a while first (the RSS peaks, nothing is free to return) and freed later, as a burst
    of answers is: the trimmer returns it then."""
    r = _run(f"""
        async def main():
            task = asyncio.create_task(A.trim_when_grown(0.05, growth_bytes={growth_mib} * MiB))
            await asyncio.sleep(0.1)  # it has taken its starting point
            live = [bytearray(2000) for _ in range(100_000)]
            await asyncio.sleep(0.3)  # a few of its checks while all of it is alive
            keep = live[::64] + [live[-1]]
            del live
            grown = A.rss_bytes()
            if {trimmed}:  # its next check trims: wait for it (10 s: a hang guard, 200 times its interval)
                for _ in range(200):
                    await asyncio.sleep(0.05)
                    if A.rss_bytes() - base < 40 * MiB:
                        break
            else:
                await asyncio.sleep(0.5)  # ten of its checks
            task.cancel()
            return grown, A.rss_bytes(), len(keep)

        grown, after, _ = asyncio.run(main())
        print(json.dumps({{"grown": (grown - base) / MiB, "after": (after - base) / MiB}}))
    """)
    assert r["grown"] > 150, r
    if trimmed:  # 190 MB freed, over its 64 MiB: trimmed within its interval
        assert r["after"] < 40, r
    else:  # under its threshold: left as it is
        assert r["after"] > 150, r


def test_free_heap_bytes_counts_what_was_freed():
    r = _run("""
        f0 = A.free_heap_bytes()
        keep = burst()
        print(json.dumps({"freed": (A.free_heap_bytes() - f0) / MiB}))
    """)
    assert r["freed"] > 150, r  # 63 of every 64 of ~200 MB
