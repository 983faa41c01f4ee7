"""`gare-serve --workers 2` on a CUDA host: one engine holds the model and the index on the GPU for both workers.

Skipped without CUDA; run on a lent GPU with ``-m gpu``. Without ``--engine`` the default (auto) must choose the
shared engine there; its answers equal the CPU service's within the CUDA paths' tolerance (tests/test_cuda.py holds
each stage to 2e-5; a whole search adds them up), and one engine batch holds the queries of both workers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from gare_serve.app import create_app
from tests.service.support import UvicornProcess, copy_index, running_app, settings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HANG_S = 600
ATOL = 1e-4  # a score's stages on CUDA against the CPU ones (each within 2e-5, tests/test_cuda.py)
INDEX_FILES = ("units.npy", "frames.npy", "ann.faiss")


def _mapped(pid: int) -> set[str]:
    return {Path(line.split()[-1]).name for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if len(line.split()) >= 6}


def test_two_workers_share_one_cuda_engine(service_env, tmp_path):
    idx = copy_index(service_env["index"], tmp_path / "index")
    texts = service_env["captions"]

    async def cpu_answers():
        s = settings(idx, device="cpu", index_poll_s=0, recall_sample_rate=0)
        async with running_app(create_app(s)) as c:
            return {q: (await c.post("/v1/search", json={"query": q, "k": 5})).json() for q in texts}

    want = asyncio.run(asyncio.wait_for(cpu_answers(), HANG_S))

    def same(got: dict, ref: dict) -> None:
        assert [h["id"] for h in got["results"]] == [h["id"] for h in ref["results"]]
        np.testing.assert_allclose([h["score"] for h in got["results"]], [h["score"] for h in ref["results"]],
                                   atol=ATOL, rtol=0)

    env = {"GARE_RECALL_SAMPLE_RATE": "0", "GARE_INDEX_POLL_S": "0", "GARE_WORKER_HEALTHCHECK_S": "900"}
    args = ["--index", str(idx), "--workers", "2", "--text-encoder", "fp32", "--result-cache-entries", "0",
            "--batch-max-wait-ms", "50"]
    with UvicornProcess(args, env=env, ready_timeout_s=HANG_S) as srv:
        ready = httpx.get(srv.base_url + "/readyz", timeout=30).json()
        engine, workers = ready["engine"], [w["pid"] for w in ready["workers"]]
        assert engine["up"] and engine["device"].startswith("cuda") and engine["pid"] not in workers
        # gpu_index auto: the engine serves the version from GPU memory, its stage 1 chosen by measurement
        st = engine["stage1"]
        assert st["resident"] is True and st["method"] in ("exact", "ann") and st["devices"][0].startswith("cuda"), st
        for pid in workers:
            assert not (_mapped(pid) & set(INDEX_FILES))
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            for q in texts:
                same(c.post("/v1/search", json={"query": q, "k": 5}).json(), want[q])

        pairs = [texts[i: i + 2] for i in range(0, len(texts) - 1, 2)]

        def one(i):
            with httpx.Client(base_url=srv.base_url, timeout=120) as c:
                return c.post("/v1/search/batch", json={"queries": pairs[i % len(pairs)], "k": 5})

        mixed = 0.0
        for _ in range(40):  # hang guard
            with cf.ThreadPoolExecutor(8) as pool:
                for r in pool.map(one, range(8)):
                    assert r.status_code == 200, r.text
                    for a in r.json()["results"]:
                        same(a, want[a["query"]])
            metrics = httpx.get(srv.base_url + "/metrics", timeout=30).text
            mixed = sum(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("gare_engine_mixed_batches_total"))
            if mixed > 0:
                break
        assert mixed > 0
