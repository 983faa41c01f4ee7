"""The hit budget (gare_serve.web.hit_budget): requests admitted by the hits they can return, in arrival order;
and the search routes holding it from the search to the JSON."""

from __future__ import annotations

import asyncio
import time

import pytest

from gare_serve.app import create_app
from gare_serve.web import search_routes
from gare_serve.web.hit_budget import HitBudget
from tests.service.support import running_app, settings


async def _settle() -> None:
    """Let every task that can run, run (loop iterations, not time: the same on a loaded machine)."""
    for _ in range(50):
        await asyncio.sleep(0)


async def _hold(budget: HitBudget, hits: int, log: list, name: str, release: asyncio.Event) -> None:
    async with budget.hold(hits):
        log.append(name)
        await release.wait()


def test_admits_while_there_is_room_then_in_arrival_order():
    async def go():
        budget, log = HitBudget(100), []
        ev = {n: asyncio.Event() for n in "abcd"}
        a = asyncio.create_task(_hold(budget, 60, log, "a", ev["a"]))
        b = asyncio.create_task(_hold(budget, 40, log, "b", ev["b"]))
        await asyncio.sleep(0)
        assert log == ["a", "b"] and budget.free == 0  # both fit: 60 + 40 = the capacity
        c = asyncio.create_task(_hold(budget, 50, log, "c", ev["c"]))
        d = asyncio.create_task(_hold(budget, 10, log, "d", ev["d"]))  # would fit once b leaves, but c came first
        await asyncio.sleep(0)
        assert budget.waiting == 2
        ev["b"].set()
        await _settle()
        assert log == ["a", "b"] and budget.free == 40  # c (50) waits for room; d (10) may not overtake it
        ev["a"].set()
        await _settle()
        assert log == ["a", "b", "c", "d"] and budget.free == 40
        ev["c"].set(), ev["d"].set()
        await asyncio.gather(a, b, c, d)
        assert budget.free == 100 and budget.waiting == 0

    asyncio.run(go())


def test_a_request_larger_than_the_budget_runs_alone():
    async def go():
        budget, log = HitBudget(10), []
        ev = {n: asyncio.Event() for n in "ab"}
        a = asyncio.create_task(_hold(budget, 64_000, log, "a", ev["a"]))
        await asyncio.sleep(0)
        assert log == ["a"] and budget.free == 0  # clamped to the capacity: admitted, and nothing beside it
        b = asyncio.create_task(_hold(budget, 1, log, "b", ev["b"]))
        await _settle()
        assert log == ["a"]
        ev["a"].set()
        await _settle()
        assert log == ["a", "b"]
        ev["b"].set()
        await asyncio.gather(a, b)
        assert budget.free == 10

    asyncio.run(go())


def test_a_cancelled_waiter_leaves_the_queue_and_unblocks_those_behind():
    async def go():
        budget, log = HitBudget(10), []
        ev = {n: asyncio.Event() for n in "abc"}
        a = asyncio.create_task(_hold(budget, 6, log, "a", ev["a"]))
        await asyncio.sleep(0)
        b = asyncio.create_task(_hold(budget, 10, log, "b", ev["b"]))  # waits for the whole budget
        c = asyncio.create_task(_hold(budget, 4, log, "c", ev["c"]))  # fits now, but queued behind b
        await _settle()
        assert log == ["a"]
        b.cancel()  # the client went away while waiting
        await _settle()
        assert log == ["a", "c"] and budget.free == 0 and budget.waiting == 0
        ev["a"].set(), ev["c"].set()
        await asyncio.gather(a, c)
        with pytest.raises(asyncio.CancelledError):
            await b
        assert budget.free == 10  # nothing lost to the cancelled request
        with pytest.raises(ValueError, match="capacity must be >= 1 hit, got 0"):
            HitBudget(0)

    asyncio.run(go())


def test_large_batches_are_searched_and_rendered_within_the_budget(service_env, monkeypatch):
    """Eight concurrent 8-query batches at k = 16 (128 hits each) against a budget of 256 hits: once all eight have
    reached the budget, exactly two are inside their search, and every answer is complete; with a budget for all
    of them, all eight are inside together."""
    real = search_routes.search_texts
    now: dict = {"in": 0, "max": 0, "arrived": 0, "gate": None}  # the gate: an asyncio.Event of the running loop

    class CountingBudget(HitBudget):
        def hold(self, hits):  # called as a request reaches the budget, before it waits there
            now["arrived"] += 1
            return super().hold(hits)

    async def counted(*a, **kw):  # the real search, counting the requests inside it
        now["in"] += 1
        now["max"] = max(now["max"], now["in"])
        try:
            await now["gate"].wait()  # held until every request has reached the budget
            return await real(*a, **kw)
        finally:
            now["in"] -= 1

    monkeypatch.setattr(search_routes, "HitBudget", CountingBudget)
    monkeypatch.setattr(search_routes, "search_texts", counted)
    texts = service_env["captions"][:8]

    def run(budget: int) -> int:
        now.update({"max": 0, "arrived": 0})
        app = create_app(settings(service_env["index"], inflight_hits=budget))

        async def open_gate():
            deadline = time.monotonic() + 120  # a hang guard only
            while now["arrived"] < 8 and time.monotonic() < deadline:
                await asyncio.sleep(0)
            await _settle()  # those admitted have entered the search
            now["gate"].set()

        async def go():
            now["gate"] = asyncio.Event()
            async with running_app(app) as c:
                opener = asyncio.create_task(open_gate())
                rs = await asyncio.gather(*(c.post("/v1/search/batch", json={"queries": texts, "k": 16})
                                            for _ in range(8)))
                await opener
                return rs

        for r in asyncio.run(go()):
            assert r.status_code == 200, r.text
            assert [len(q["results"]) for q in r.json()["results"]] == [16] * 8
        assert now["arrived"] == 8
        return now["max"]

    assert run(256) == 2
    assert run(1_000_000) == 8
