"""`--engine dask`: the Dask cluster that runs the encoder's shard tasks; shards merged into one index version.

The client splits the clips into shards of `shard_size`, submits one task per shard and writes every
returned shard into INDEX/work/ as soon as it arrives (so a killed run resumes like the local engine), and
the builder merges the shards into one version. Each worker process loads the model once (a per-process
cache keyed by checkpoint path, sha256 and device) and checks the checkpoint's sha256, so workers need the
checkpoint and the videos under the same paths (a shared filesystem).

Without `--scheduler` a LocalCluster is started bound to 127.0.0.1 (processes, one thread each, no
dashboard): nothing listens on a non-loopback address.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)


def run_dask(
    task: Callable[..., dict[str, Any]],
    jobs: Sequence[tuple[str, str, float | None, float | None]],
    *,
    checkpoint: str,
    sha256: str,
    device: str,
    precision: str,
    batch_size: int,
    shard_size: int,
    scheduler: str | None,
    n_workers: int,
    on_result: Callable[[dict[str, Any]], None],
    decode_timeout: float = 300.0,
) -> None:
    """Encode `jobs` on a Dask cluster: `task` (:func:`gare_build.pipeline.encode.encode_shard`) runs once per shard of
    `shard_size` jobs; `on_result` gets each shard's result dict as it completes."""
    try:
        from dask.distributed import Client, LocalCluster, as_completed
    except ImportError as e:  # pragma: no cover - dask is in the dist/test extras
        raise RuntimeError("--engine dask needs dask[distributed]: pip install 'gare-search[dist]'") from e
    if shard_size < 1:
        raise ValueError(f"shard size must be >= 1, got {shard_size}")
    cluster = None
    if scheduler:
        client = Client(scheduler)
    else:
        cluster = LocalCluster(
            host="127.0.0.1", n_workers=max(1, n_workers), threads_per_worker=1, processes=True,
            dashboard_address=None, protocol="tcp",
        )
        client = Client(cluster)
    log.info("dask engine: %s (%d workers)", client.scheduler.address if client.scheduler else scheduler,
             len(client.scheduler_info().get("workers", {})))
    run = uuid.uuid4().hex[:8]
    try:
        chunks = [list(jobs[s : s + shard_size]) for s in range(0, len(jobs), shard_size)]
        futures = {}
        for i, chunk in enumerate(chunks):
            fut = client.submit(
                task, chunk, checkpoint, sha256, device, precision, batch_size, decode_timeout,
                key=f"gare-encode-{run}-{i}", pure=False, retries=1,
            )
            futures[fut] = chunk
        for fut in as_completed(list(futures)):
            chunk = futures.pop(fut)
            try:
                res = fut.result()
            except Exception as e:  # noqa: BLE001 - a task that fails twice fails its clips, not the run
                reason = f"dask task failed: {type(e).__name__}: {str(e)[:200]}"
                res = {"keys": [], "frames": None, "vbar": None, "masks": None,
                       "failed": {it[0]: reason for it in chunk}, "frames_used": 0}
            on_result(res)
            fut.release()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
