"""The warm-up of the hot part of an index at load (issue 29): it runs when the service starts and when it
reloads, asks for the files in WARM_ORDER, hottest first, and never for more than `warm_index_bytes`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gare_serve.app import create_app
from gare_serve.engine import startup
from tests.service.support import copy_index, settings


class FadviseLog:
    """Records the posix_fadvise calls (file, offset, length) and still makes them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int, int]] = []
        real = os.posix_fadvise

        def record(fd: int, offset: int, length: int, advice: int) -> None:
            assert advice == os.POSIX_FADV_WILLNEED
            self.calls.append((Path(os.readlink(f"/proc/self/fd/{fd}")).name, offset, length))
            real(fd, offset, length, advice)

        monkeypatch.setattr(os, "posix_fadvise", record)


def _sizes(version_dir: Path) -> dict[str, int]:
    return {n: (version_dir / n).stat().st_size for n in startup.WARM_ORDER if (version_dir / n).is_file()}


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux/POSIX only")
def test_warm_up_runs_at_start_and_reload_within_its_budget(service_env, tmp_path, monkeypatch):
    from gare_build.build import remove

    idx = copy_index(service_env["index"], tmp_path / "index")
    log = FadviseLog(monkeypatch)
    with TestClient(create_app(settings(idx, api_keys="k", warm_index_bytes=1 << 40))) as c:
        vdir = Path(c.app.state.gare.handle.version.path)
        sizes = _sizes(vdir)
        # a budget above the index: every hot file whole, in WARM_ORDER (ANN first, frames last)
        assert log.calls == [(n, 0, sizes[n]) for n in startup.WARM_ORDER if n in sizes]
        assert "frames.npy" in sizes and log.calls[0][0] == "ann.faiss"
        log.calls.clear()
        remove(str(idx), ["4"])
        assert c.post("/v1/admin/reload", headers={"X-API-Key": "k"}).json()["version"] == "v000002"
        assert [n for n, _, _ in log.calls] == [n for n in startup.WARM_ORDER if n in _sizes(vdir.parent / "v000002")]
    # a budget that ends inside the second file: the first whole, the second cut at the budget, nothing after
    log.calls.clear()
    with TestClient(create_app(settings(idx, warm_index_bytes=0))) as c:
        assert log.calls == []  # 0: no warm-up at all
        log_sizes = _sizes(Path(c.app.state.gare.handle.version.path))
    names = [n for n in startup.WARM_ORDER if n in log_sizes]
    first = log_sizes[names[0]]
    budget = first + log_sizes[names[1]] // 2
    with TestClient(create_app(settings(idx, warm_index_bytes=budget))):
        assert log.calls == [(names[0], 0, first), (names[1], 0, budget - first)]
        assert sum(length for _, _, length in log.calls) <= budget


def test_warm_index_refuses_a_negative_budget(tmp_path):
    class V:
        path = tmp_path
        name = "v1"

    with pytest.raises(ValueError, match="budget_bytes must be >= 0, got -1"):
        startup.warm_index(V(), -1)
    assert startup.warm_index(V(), 100) == {}  # no index files there: nothing asked
