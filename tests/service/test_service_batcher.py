"""gare_serve.engine.batcher.MicroBatcher: bounded batches, bounded wait, one worker thread, errors, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gare_serve.engine.batcher import BatcherClosed, BatcherOverloaded, MicroBatcher


def run(coro):
    return asyncio.run(coro)


def test_batches_are_bounded_ordered_and_on_one_thread():
    seen_batches: list[list[int]] = []
    threads: set[int] = set()

    def process(items):
        threads.add(threading.get_ident())
        seen_batches.append(list(items))
        time.sleep(0.01)
        return [x * 10 for x in items]

    async def go():
        b = MicroBatcher(process, max_batch=4, max_wait_s=0.02)
        b.start()
        res = await asyncio.gather(*(b.submit(i) for i in range(10)))
        await b.stop()
        return res, b

    res, b = run(go())
    assert [r for r, _ in res] == [i * 10 for i in range(10)]
    assert all(len(x) <= 4 for x in seen_batches) and max(len(x) for x in seen_batches) > 1
    assert sorted(i for x in seen_batches for i in x) == list(range(10))
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert b.items == 10 and b.batches == len(seen_batches)
    info = res[-1][1]
    assert info.size >= 1 and info.queue_s >= 0 and info.run_s >= 0.01


def test_wait_is_bounded_and_adaptive():
    """Without adaptive_wait a lone item waits up to max_wait_s for company: a second item sent meanwhile joins its
    batch, and with nobody coming it still goes alone (bounded). With adaptive_wait a lone client does not wait:
    its item is answered long before a max_wait_s of a minute would end. (The timeouts are hang guards.)"""
    def process(items):
        return list(items)

    async def company(adaptive, max_wait_s):
        b = MicroBatcher(process, max_batch=2, max_wait_s=max_wait_s, adaptive_wait=adaptive)
        b.start()
        first = asyncio.ensure_future(b.submit(1))
        for _ in range(20):  # the collector takes the first item and starts its wait
            await asyncio.sleep(0)
        second = await asyncio.wait_for(b.submit(2), 30)
        got = [await asyncio.wait_for(first, 30), second]
        await b.stop()
        return got

    async def lone(adaptive, max_wait_s):
        b = MicroBatcher(process, max_batch=8, max_wait_s=max_wait_s, adaptive_wait=adaptive)
        b.start()
        got = await asyncio.wait_for(b.submit(1), 30)
        await b.stop()
        return got

    # waits for company: the second item, sent while the first waits, shares its batch
    got = run(company(False, 60.0))
    assert [r for r, _ in got] == [1, 2] and [i.size for _, i in got] == [2, 2]
    # bounded: nobody comes, it goes alone once max_wait_s is over
    (r, info) = run(lone(False, 0.2))
    assert r == 1 and info.size == 1 and info.queue_s >= 0.2 - 1e-3
    # adaptive: a lone client's item goes at once (a 60 s wait would trip the 30 s guard), so the second item
    # sent after it finds the first batch gone and forms its own
    (r, info) = run(lone(True, 60.0))
    assert r == 1 and info.size == 1
    got = run(company(True, 60.0))
    assert [r for r, _ in got] == [1, 2] and [i.size for _, i in got] == [1, 1]


def test_errors_reach_every_waiter_and_the_worker_survives():
    calls = {"n": 0}

    def process(items):
        calls["n"] += 1
        if any(x < 0 for x in items):
            raise ValueError("negative")
        return [x + 1 for x in items]

    async def go():
        b = MicroBatcher(process, max_batch=8, max_wait_s=0.05, adaptive_wait=False)
        b.start()
        bad = await asyncio.gather(b.submit(1), b.submit(-1), return_exceptions=True)
        good = await b.submit(5)
        await b.stop()
        return bad, good

    bad, good = run(go())
    assert all(isinstance(x, ValueError) for x in bad)
    assert good[0] == 6


def test_wrong_result_count_is_an_error():
    async def go():
        b = MicroBatcher(lambda items: [], max_batch=2, max_wait_s=0)
        b.start()
        with pytest.raises(RuntimeError, match="0 results for 1 items"):
            await b.submit(1)
        await b.stop()

    run(go())


def test_overload_closed_and_stop_drains():
    gate = threading.Event()

    def process(items):
        gate.wait(5)
        return list(items)

    async def go():
        b = MicroBatcher(process, max_batch=1, max_wait_s=0, max_queue=2)
        with pytest.raises(BatcherClosed):
            await b.submit(1)
        b.start()
        first = asyncio.create_task(b.submit(0))
        await asyncio.sleep(0.05)  # the worker holds item 0
        queued = [asyncio.create_task(b.submit(i)) for i in (1, 2)]
        await asyncio.sleep(0.01)
        with pytest.raises(BatcherOverloaded):
            await b.submit(3)
        gate.set()
        await b.stop()  # finishes what was queued before the stop
        assert (await first)[0] == 0 and [(await q)[0] for q in queued] == [1, 2]
        with pytest.raises(BatcherClosed):
            await b.submit(4)
        assert not b.running

    run(go())


def test_bad_arguments():
    with pytest.raises(ValueError):
        MicroBatcher(list, max_batch=0)
    with pytest.raises(ValueError):
        MicroBatcher(list, max_wait_s=-1)
