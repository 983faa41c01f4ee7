"""What the service holds when it serves a sharded index whose shards answer elsewhere (the Ray Serve ingress):
the model and query encoder (the query is encoded once, here), the current generation as the served "version",
and the searches the routes run, each fanned out to every shard and merged (``gare_search.shard_search``).

:class:`ShardedServiceState` is a ``gare_serve.engine.state.ServiceState`` whose served version is a
:class:`ShardedView` (one generation of a sharded index: its name ``gNNNNNN``, manifests, metadata by global id)
and whose ``search_batch`` / ``search_by_videos`` / ``search_by_image`` call the shards through a shard client
(``call(method, {shard: args}) -> {shard: answer}``, a shard that did not answer left out: ``gare_serve.ray_serve.deployment``'s
Ray handles, or ``gare_serve.ray_serve.shard_replica.LocalShards`` in one process). So the routes, schemas, auth, limits,
caches, micro-batcher and page of ``gare-serve`` run unchanged over a sharded index.

Every call names the generation the request started on (the ``VersionHandle`` it holds), so each request is
answered from exactly one generation; :func:`follow_generations` moves the ingress to a new generation once every
shard has opened it. A shard that does not answer: 503 naming it, or, with ``allow_partial``, the answer of the
others flagged ``partial`` with ``missing_shards`` (never a silent drop).

What gare-serve records of its traffic runs here too. The query bank (``GARE_QUERY_BANK_SIZE``/``_PATH``) is fed by
the batch worker with the unit vectors of the queries encoded here, as in gare-serve
(``gare_serve.engine.batch_worker.run_batch``), and ``gare-index tune --out ROOT --from-bank`` takes it on the
sharded root. The stage-1 recall watch (``GARE_RECALL_SAMPLE_RATE`` > 0, ``gare_serve.engine.recall_watch``)
measures the whole generation: :meth:`ShardedServiceState.search_batch` offers a sampled query with the candidates
it was served (the merge's global top K of the shards' stage-1 lists), and :class:`ShardSource` measures it on
every shard (``gare_serve.ray_serve.shard_replica.ShardWorker.stage1_probe``, the exact scan paced in the
replica): the generation's exact top-10 is the merge of every shard's exact top-10 (a video in it is in its own
shard's), its stage-1 candidates the union of every shard's stage-1 top K at the K that shard was tuned at (its
``recall_at``: a shard meeting its target keeps that share of its own top-10, so the union keeps that share of the
generation's), the target the lowest of the shards' (:func:`generation_target`). Metrics, warning and alarm are
gare-serve's, on this app's ``/metrics``; a new generation restarts the window and clears the alarm.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from fastapi import HTTPException
from starlette.concurrency import run_in_threadpool

from gare.model import GARE
from gare_index.ncl_ann import Stage1Unavailable
from gare_index.shards import (
    Generation,
    agreed_ncl_default,
    current_generation,
    global_id,
    shard_root,
    split_id,
)
from gare_index.store import VERSIONS_DIR, IndexFormatError, IndexManifest, read_manifest
from gare_search import by_example as E
from gare_search import shard_search as SH
from gare_search.query import encode_queries, sync, unit_rows
from gare_search.search import DEFAULT_CANDIDATES, QueryResult, SearchOptions
from gare_serve.engine.exact_scan import CHUNK_BYTES, TOP
from gare_serve.engine.prometheus import Metrics
from gare_serve.engine.recall_watch import RecallWatch, Sample, SkipSample
from gare_serve.engine.reload import ReloadRefused, ReloadUnavailable
from gare_serve.engine.startup import StartupError, resolve_checkpoint
from gare_serve.engine.state import ServiceState
from gare_serve.engine.versions import VersionHandle
from gare_serve.ray_serve.shard_replica import ShardProbe
from gare_serve.settings import Settings

log = logging.getLogger(__name__)

__all__ = ["ShardClient", "ShardedQueryResult", "ShardedView", "ShardedServiceState", "ShardSource",
           "generation_target", "shard_recall_ks", "follow_generations"]

# How long the recall watch waits for a shard's probe: its exact scan is paced to recall_cpu_share of the replica's
# time (at 5%, twenty times its CPU time), far past a search's shard timeout on a large shard
PROBE_TIMEOUT_S = 600.0


class ShardClient(Protocol):
    n_shards: int

    def call(self, method: str, args: Mapping[int, tuple[Any, ...]], timeout_s: float | None = None) -> dict[int, Any]:
        """shard -> its answer to ``method(*args[shard])``; shards that did not answer (within ``timeout_s``, None:
        the client's own) are left out."""


@dataclass
class ShardedQueryResult(QueryResult):
    """A query's result over a sharded index: the shards that did not answer (empty: the whole answer)."""

    missing_shards: list[int] = field(default_factory=list)


class ShardedView:
    """One generation of a sharded index as the routes see a version: name, sizes, manifest, metadata."""

    def __init__(self, root: Path, generation: Generation, client: ShardClient, expect_sha: str | None) -> None:
        self.root, self.generation, self.client = Path(root), generation, client
        self.name = f"g{generation.number:06d}"
        self.n_shards = generation.n_shards
        manifests: list[IndexManifest] = []
        for s, v in enumerate(generation.versions):
            m = read_manifest(shard_root(root, s) / VERSIONS_DIR / v)
            if expect_sha is not None and m.checkpoint_sha256 not in (None, expect_sha):
                raise IndexFormatError(f"shard {s} version {v} was built with checkpoint sha256 "
                                       f"{m.checkpoint_sha256}, not {expect_sha}")
            manifests.append(m)
        self.manifests = manifests
        first = manifests[0]
        # The NCL default a request without `ncl` gets: the one decision over the whole gallery (made at build time on
        # validation captions) that every shard records (biases.default); the search reads it from self.manifest as
        # it reads a single index's (gare_serve.engine.served_options), so shard 0's biases record stands for the
        # generation once the shards are known to agree (else IndexFormatError)
        agreed_ncl_default(manifests)
        # The default K: one K for the whole gallery (the merge keeps the global top K), the largest any shard chose
        ks = [int((m.stage1 or {}).get("default_candidates") or 0) for m in manifests]
        stage1 = {**(first.stage1 or {}), "default_candidates": max(ks)} if max(ks) > 0 else first.stage1
        self.manifest = first.model_copy(update={"n": sum(m.n for m in manifests), "stage1": stage1})
        self.n, self.dim, self.max_frames = self.manifest.n, first.dim, first.max_frames

    def check_stage1(self, *, ncl_stage1: bool) -> None:
        if ncl_stage1 and any(m.ncl_stage1 is None for m in self.manifests):
            raise Stage1Unavailable(f"generation {self.name}: not every shard was built with --ncl-stage1; "
                                    "ncl_stage1 is not available")

    def metadata(self, ids: Sequence[int] | np.ndarray) -> list[dict[str, Any]]:
        """Rows of GLOBAL ids (each row's "id" the global id), in order; KeyError for an unknown one; 503 when a
        shard holding some of them does not answer."""
        want = [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]
        if not want:
            return []
        if min(want) < 0:
            raise KeyError(f"ids not in index {self.name}: {[i for i in want if i < 0]}")
        shard, local = split_id(np.asarray(want, dtype=np.int64), self.n_shards)
        by_shard = {int(s): local[shard == s].tolist() for s in np.unique(shard)}
        got = self.client.call("metadata", {s: (self.generation.number, lo) for s, lo in by_shard.items()})
        gone = sorted(set(by_shard) - set(got))
        if gone:
            raise HTTPException(503, f"shards {gone} of index generation {self.name} did not answer (metadata)")
        rows = {global_id(s, int(r["id"]), self.n_shards): r for s, rs in got.items() for r in rs}
        missing = [g for g in want if g not in rows]
        if missing:
            raise KeyError(f"ids not in index {self.name}: {missing[:20]}")
        return [{**rows[g], "id": g} for g in want]

    def path_of(self, video_id: int) -> Path | None:
        s, lo = split_id(int(video_id), self.n_shards)
        got = self.client.call("path_of", {s: (self.generation.number, lo)})
        if s not in got:
            raise HTTPException(503, f"shard {s} of index generation {self.name} did not answer")
        return None if got[s] is None else Path(got[s])

    def close(self) -> None:
        """Nothing to close here: the shards close a generation's versions themselves."""


class ShardedServiceState(ServiceState):
    """The ingress's state: ``ServiceState`` over a :class:`ShardedView`, searches fanned out to the shards."""

    def __init__(self, settings: Settings, metrics: Metrics, *, client: ShardClient, allow_partial: bool = False) -> None:
        super().__init__(settings, metrics)
        self.client = client
        self.allow_partial = bool(allow_partial)
        self.sha: str | None = None

    # ------------------------------------------------------------------ loading (ServiceState.load's seams)
    def resolve_checkpoint(self) -> tuple[Path, str]:
        gen = self.current()
        path, sha, _ = resolve_checkpoint(self.settings.model_copy(update={"index": shard_root(self.settings.index, 0)}))
        self.sha = sha
        log.info("sharded index %s: generation %d, %d shards", self.settings.index, gen.number, gen.n_shards)
        return path, sha

    def current(self) -> Generation:
        try:
            gen = current_generation(self.settings.index)
        except IndexFormatError as e:
            raise StartupError(f"cannot read the sharded index: {e}") from None
        if gen is None:
            raise StartupError(f"{self.settings.index} is not a sharded index (no GENERATION file); build one with "
                               "gare-index build --shards N")
        if gen.n_shards != self.client.n_shards:
            raise StartupError(f"generation {gen.number} has {gen.n_shards} shards, the app was built with "
                               f"{self.client.n_shards} shard deployments")
        return gen

    def open_served(self, sha: str) -> ShardedView:
        try:
            return ShardedView(Path(self.settings.index), self.current(), self.client, sha)
        except IndexFormatError as e:
            raise StartupError(f"cannot open the sharded index: {e}") from None

    def check_fit(self, version: ShardedView) -> None:
        cfg = self.model.cfg
        if version.n and (version.dim != cfg.embed_dim or version.max_frames != cfg.max_frames):
            raise StartupError(f"index generation {version.name} has dim={version.dim}, max_frames="
                               f"{version.max_frames}; the model has embed_dim={cfg.embed_dim}, max_frames={cfg.max_frames}")

    # ------------------------------------------------------------------ the searches
    def fan_out(self, view: ShardedView, method: str, args: Callable[[int], tuple[Any, ...]]) -> list[Any | None]:
        """Every shard's answer to ``method(generation, *args(shard))`` (None: it did not answer); 503 naming the
        missing shards unless partial answers are allowed."""
        got = self.client.call(method, {s: (view.generation.number, *args(s)) for s in range(view.n_shards)})
        parts = [got.get(s) for s in range(view.n_shards)]
        missing = [s for s, p in enumerate(parts) if p is None]
        if missing:
            log.warning("generation %s: shards %s did not answer %s", view.name, missing, method)
            if not self.allow_partial:
                raise HTTPException(503, f"shards {missing} of index generation {view.name} did not answer; no "
                                    "answer without them (start the app with allow_partial to serve partial answers)")
        return parts

    def search_batch(self, model: GARE, version: ShardedView, texts: Sequence[str],
                     options: SearchOptions | Sequence[SearchOptions] = SearchOptions(), *, precision: str = "fp32",
                     on_units: Any = None, encoder: Callable[[list[str]], torch.Tensor] | None = None,
                     tower: Any = None) -> list[QueryResult]:
        """``gare_search.search.search_batch`` over the shards: the texts encoded once here (t (a, d)), every
        shard's top K + psi + biases, the global merge."""
        opts = SH.per_query(options, len(texts))
        if not texts:
            return []
        t0 = time.perf_counter()
        t = encoder(list(texts)) if encoder is not None else encode_queries(model, texts, precision, tower=tower)
        sync(model.device)
        t_np = t.detach().to("cpu", torch.float32).numpy()  # (a, d): what crosses to the shards
        units = unit_rows(t_np)  # what every shard's stage 1 searches with
        if on_units is not None:
            on_units(units)
        t1 = time.perf_counter()
        parts = self.fan_out(version, "candidates", lambda s: (t_np, opts))
        if self.recall_watch is not None:
            self.offer_samples(self.recall_watch, version, units, parts, opts)
        t2 = time.perf_counter()
        merged = SH.merge(parts, version.n_shards, opts, n_queries=len(texts))
        t3 = time.perf_counter()
        return [ShardedQueryResult(m.hits, {"encode": t1 - t0, "ann": m.timings.get("ann", t2 - t1),
                                            "rerank": m.timings.get("rerank", 0.0), "rank": t3 - t2,
                                            "shards": t2 - t1, "total": t3 - t0}, missing_shards=m.missing_shards)
                for m in merged]

    def offer_samples(self, watch: RecallWatch, view: ShardedView, units: np.ndarray,
                      parts: Sequence[Sequence[SH.ShardCandidates] | None], opts: Sequence[SearchOptions]) -> None:
        """The recall watch's sample of these queries (``watch.observe``: each with probability
        ``recall_sample_rate``), each with the candidates it was served: the global top K of every shard's stage-1
        list, as the merge keeps them. A partial answer or a filtered query says nothing about stage 1 over the
        gallery: not offered."""
        if any(p is None for p in parts):
            return
        try:
            for i, o in enumerate(opts):
                if getattr(o, "filter", None) is not None:
                    continue
                gids, _, _, keep = SH.stage1_cut([(s, p[i]) for s, p in enumerate(parts)], view.n_shards,
                                                 int(o.candidates), ncl_stage1=o.ncl_stage1)
                watch.observe(view.name, units[i:i + 1], gids[keep][None, :], int(o.candidates), o.ncl_stage1)
        except Exception:  # noqa: BLE001 - sampling must never fail a search
            log.exception("recall watch: sampling a sharded stage-1 result failed")

    def recall_source(self) -> ShardSource:
        """How the recall watch measures a generation (``gare_serve.engine.recall_watch.start_recall_watch``)."""
        return ShardSource(self.client, cpu_share=self.settings.recall_cpu_share)

    def search_by_videos(self, version: ShardedView, ids: Sequence[int], opts: SearchOptions) -> QueryResult:
        """More like these videos (GLOBAL ids): their rows from their own shards, then every shard, merged."""
        t0 = time.perf_counter()
        n, g = version.n_shards, version.generation.number
        wanted = SH.split_examples(ids, n)
        got = self.client.call("example_rows", {s: (g, lo) for s, lo in wanted.items()})
        try:
            q = SH.example_query(ids, got, n)
        except SH.ShardsMissing as e:  # the query itself needs them: no partial answer can stand for it
            raise HTTPException(503, f"shards {e.shards} of index generation {version.name} did not answer; they "
                                f"hold the example videos") from None
        t1 = time.perf_counter()
        parts = self.fan_out(version, "example_candidates", lambda s: (q, opts))
        t2 = time.perf_counter()
        m = SH.merge([None if p is None else [p] for p in parts], n, opts, kind="example", n_queries=1)[0]
        t3 = time.perf_counter()
        return ShardedQueryResult(m.hits, {"encode": t1 - t0, "ann": m.timings.get("ann", t2 - t1),
                                           "rerank": m.timings.get("rerank", 0.0), "rank": t3 - t2, "total": t3 - t0},
                                  missing_shards=m.missing_shards)

    def search_by_image(self, model: GARE, version: ShardedView, image: Any, opts: SearchOptions) -> QueryResult:
        """An image query: encoded once here (û (1, d)), every shard's stage 1, merged."""
        t0 = time.perf_counter()
        u = E.encode_image(model, image)
        sync(model.device)
        t1 = time.perf_counter()
        parts = self.fan_out(version, "image_candidates", lambda s: (u, opts))
        t2 = time.perf_counter()
        m = SH.merge([None if p is None else [p] for p in parts], version.n_shards, opts, kind="example",
                     n_queries=1)[0]
        t3 = time.perf_counter()
        return ShardedQueryResult(m.hits, {"encode": t1 - t0, "ann": t2 - t1, "rerank": 0.0, "rank": t3 - t2,
                                           "total": t3 - t0}, missing_shards=m.missing_shards)

    # ------------------------------------------------------------------ generations
    async def reload_here(self) -> dict[str, Any]:
        """Switch to the index's current generation now (``POST /v1/admin/reload`` and the poll): the result of
        ``gare_serve.engine.reload.reload_local``; :class:`ReloadUnavailable` when GENERATION cannot be read or a shard
        cannot open the generation (the old one stays served), :class:`ReloadRefused` when it does not fit."""
        reloads = self.metrics.reloads
        async with self.reload_lock:
            old = self.handle
            if old is None:
                raise ReloadUnavailable("the index is not loaded yet")
            try:
                gen = await run_in_threadpool(current_generation, self.settings.index)
            except IndexFormatError as e:
                reloads.labels("error").inc()
                raise ReloadUnavailable(f"cannot read the sharded index's GENERATION ({e}); still serving "
                                        f"{old.version.name}") from None
            if gen is None or gen.number == old.version.generation.number:
                reloads.labels("unchanged").inc()
                return {"reloaded": False, "version": old.version.name, "previous": old.version.name,
                        "n": old.version.n}
            try:
                ok = await run_in_threadpool(self.switch_to, gen)
            except StartupError as e:
                reloads.labels("refused").inc()
                raise ReloadRefused(f"generation {gen.number}: {e}; still serving {old.version.name}") from None
            except IndexFormatError as e:
                reloads.labels("error").inc()
                raise ReloadUnavailable(f"generation {gen.number} could not be opened ({e}); still serving "
                                        f"{old.version.name}") from None
            if not ok:
                reloads.labels("error").inc()
                raise ReloadUnavailable(f"not every shard could open generation {gen.number}; still serving "
                                        f"{old.version.name}")
            reloads.labels("ok").inc()
            new = self.handle.version
            return {"reloaded": True, "version": new.name, "previous": old.version.name, "n": new.n}

    def switch_to(self, gen: Generation) -> bool:
        """Serve ``gen`` from now on, once every shard has opened its version (else keep the old one: False).
        Requests in flight finish on the generation they started on."""
        opened = self.client.call("open", {s: (gen.number,) for s in range(gen.n_shards)})
        if len(opened) != gen.n_shards:
            log.error("generation %d: shards %s could not open it; still serving %s", gen.number,
                      sorted(set(range(gen.n_shards)) - set(opened)), self.handle.version.name if self.handle else None)
            return False
        view = ShardedView(Path(self.settings.index), gen, self.client, self.sha)
        self.check_fit(view)
        old, self.handle = self.handle, VersionHandle(view)
        self.publish_index(view)
        if old is not None:
            old.retire()
        log.info("now serving generation %s (was %s)", view.name, old.version.name if old is not None else None)
        return True


def shard_recall_ks(view: ShardedView) -> list[int]:
    """Every shard's K: the ``recall_at`` its stage 1 was tuned at (the service's default K when not tuned)."""
    return [max(1, int((m.stage1 or {}).get("recall_at") or DEFAULT_CANDIDATES)) for m in view.manifests]


def generation_target(view: ShardedView) -> tuple[float | None, int]:
    """(the generation's recall target: the lowest of its shards' ``stage1.recall_target``, what every shard was
    tuned to meet, None when no shard was; the K reported with it: the largest shard K, capped at the generation's
    size)."""
    targets = [float(t) for m in view.manifests if isinstance(t := (m.stage1 or {}).get("recall_target"), (int, float))]
    k = max(shard_recall_ks(view))
    return (min(targets) if targets else None), max(1, min(k, int(view.n)) if view.n else k)


class ShardSource:
    """The recall watch's :class:`gare_serve.engine.recall_watch.Stage1Source` over a sharded generation: one
    ``stage1_probe`` call per shard per sample (each shard's exact scan paced to ``cpu_share`` in its replica, its
    stage 1 asked at its own K: :func:`shard_recall_ks`), merged by GLOBAL id. Stage 1 is always run again: the
    served list is the merge's cut at the request's K, not the shards' lists. A shard that does not answer within
    ``timeout_s``: the sample is skipped (``reason="shards"``)."""

    def __init__(self, client: ShardClient, *, cpu_share: float = 1.0, chunk_bytes: int = CHUNK_BYTES,
                 timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.client, self.cpu_share, self.chunk_bytes, self.timeout_s = client, float(cpu_share), chunk_bytes, timeout_s

    def target(self, view: ShardedView) -> tuple[float | None, int]:
        return generation_target(view)

    def measure(self, view: ShardedView, sample: Sample, k_target: int,
                step: Callable[[], None]) -> tuple[np.ndarray, np.ndarray, bool]:
        """(the generation's exact top-10 GLOBAL ids, the union of the shards' stage-1 lists, True)."""
        n, ks = view.n_shards, shard_recall_ks(view)
        got: dict[int, ShardProbe] = self.client.call(
            "stage1_probe", {s: (view.generation.number, sample.unit, ks[s], sample.ncl_stage1, self.cpu_share,
                                 self.chunk_bytes) for s in range(n)}, timeout_s=self.timeout_s)
        step()
        if len(got) < n:
            log.warning("recall watch: shards %s did not answer the probe of a sample; skipped",
                        sorted(set(range(n)) - set(got)))
            raise SkipSample("shards")
        gids = np.concatenate([global_id(np.full(p.exact_ids.size, s, np.int64), np.asarray(p.exact_ids, np.int64), n)
                               for s, p in got.items()]).astype(np.int64, copy=False)
        scores = np.concatenate([np.asarray(p.exact_scores, np.float32) for p in got.values()])
        exact = gids[np.lexsort((gids, -scores))[:TOP]]  # each shard's exact top-10 holds the global one's videos
        listed = [global_id(np.full(p.listed.size, s, np.int64), np.asarray(p.listed, np.int64), n)
                  for s, p in got.items()]
        return exact, np.concatenate(listed).astype(np.int64, copy=False), True

    def wrap(self, view: ShardedView, watch: RecallWatch) -> ShardedView:
        """The view itself: the state offers the served lists (:meth:`ShardedServiceState.offer_samples`)."""
        return view


async def follow_generations(state: ShardedServiceState, poll_s: float) -> None:
    """Switch ``state`` to the index's current generation whenever GENERATION changes (one poll every ``poll_s``
    seconds; ``index_poll_s``, and 0 means every 2 s here: a sharded index has no other way to switch by itself)."""
    poll_s = poll_s if poll_s > 0 else 2.0
    while True:
        await asyncio.sleep(poll_s)
        try:
            await state.reload_here()
        except (ReloadRefused, ReloadUnavailable) as e:
            # a refused generation is tried again at the next poll (a shard may be restarting)
            log.warning("following the sharded index: %s", e)
