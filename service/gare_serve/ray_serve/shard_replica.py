"""One shard of a sharded index as a server process sees it: its versions pinned by generation, and the calls the
ingress makes on it (what a Ray Serve shard replica runs: ``gare_serve.ray_serve.deployment``): the searches, and
the recall watch's probe of a sampled query (:meth:`ShardWorker.stage1_probe`: this shard's exact top-10 and its
stage 1 at the watch's K, the exact scan paced here, where its CPU is spent).

:class:`ShardWorker` opens shard ``s``'s version that a generation names (``gare_index.shards``: never the shard's
own CURRENT, which is the builder's working state), memory-mapped, and answers every call for the generation the
call names: a request carries the generation the ingress pinned when it started, and a shard that serves another
one opens that generation's version first (kept open beside the others, at most ``keep`` of them, each closed when
its last request is done: ``gare_serve.engine.versions.VersionHandle``). So a request is answered from exactly one
generation on every shard, across switches.

:class:`LocalShards` is the ingress's view of the shards when they live in the same process (tests, a one-host
run): the same calls as the Ray handles of ``gare_serve.ray_serve.deployment.RayShards``, each shard answering or not.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gare.checkpoint import CheckpointError, read_checkpoint_subset
from gare.config import ModelConfig
from gare.model_protocols import PsiModel
from gare.psi import Psi
from gare_index.shards import current_generation, read_generation, shard_root
from gare_index.store import IndexFormatError, open_version
from gare_search import rerank
from gare_search import shard_search as SH
from gare_search.search import SearchOptions
from gare_search.stage1 import ann_stage, valid
from gare_serve.engine.exact_scan import CHUNK_BYTES, TOP, cpu_pacer, exact_top
from gare_serve.engine.versions import VersionHandle, advise_random_access

log = logging.getLogger(__name__)

__all__ = ["ShardWorker", "LocalShards", "SHARD_CALLS", "ShardModel", "ShardProbe", "load_shard_model"]

# The calls the ingress makes on a shard (method names of ShardWorker); a Ray replica refuses any other name.
SHARD_CALLS = ("open", "candidates", "example_rows", "example_candidates", "image_candidates", "metadata", "path_of",
               "stage1_probe")


@dataclass
class ShardProbe:
    """One sampled query on one shard, for the recall watch (LOCAL ids): the exact top-10 by the stage-1 score and
    the shard's stage-1 top K, as a served query at that K gets it."""

    exact_ids: np.ndarray  # (<= 10,) int64, best first
    exact_scores: np.ndarray  # (<= 10,) float32: cos(t, v̂_j), + b_j with ncl_stage1
    listed: np.ndarray  # (<= K,) int64: stage 1's top K, in its order


class ShardModel(torch.nn.Module):
    """What a shard needs of the GARE model: psi (the rerank's fold is computed from its weights) and the model
    config (temperature, sizes, padding), on a device. The CLIP towers and the temporal transformer (queries are
    encoded by the ingress, videos by the builder) are not in it: at ViT-B/32 that is ~1.1 GiB a replica does not
    hold. Duck-typed as the model by gare_search's shard calls (``.psi``, ``.cfg``, ``.device``)."""

    def __init__(self, cfg: ModelConfig, psi: Psi) -> None:
        super().__init__()
        self.cfg = cfg
        self.psi = psi

    @property
    def device(self) -> torch.device:
        return next(self.psi.parameters()).device


def load_shard_model(path: str | Path, device: str | torch.device = "cpu") -> ShardModel:
    """psi and the config of the checkpoint at `path`, read alone from the file
    (:func:`gare.checkpoint.read_checkpoint_subset`: the other tensors are never loaded), in eval mode on `device`.
    The caller checks the file's sha256 against the index as for the full model (gare_serve.engine.startup)."""
    ckpt = read_checkpoint_subset(path, ("psi.",))
    cfg = ckpt.config
    psi = Psi(cfg.embed_dim, cfg.psi_heads, cfg.psi_dropout)
    sd = {k[len("psi."):]: v for k, v in ckpt.state_dict.items()}
    missing, unexpected = psi.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{path}: psi weights do not fit the config: missing={missing[:5]} unexpected={unexpected[:5]}")
    return ShardModel(cfg, psi).to(device).eval()


class ShardWorker:
    """Shard ``shard`` of the sharded index at ``root``, answering for any generation (pinned per call). ``model``:
    the GARE model or, as a Ray replica holds it, its psi alone (:func:`load_shard_model`)."""

    def __init__(self, root: str | Path, shard: int, model: PsiModel, *, expect_checkpoint_sha: str | None = None,
                 verify: bool = False, use_gpu: bool | None = None, keep: int = 3,
                 rerank_settings: rerank.RerankSettings = rerank.DEFAULT_RERANK, check: bool = False) -> None:
        self.root, self.shard, self.model = Path(root), int(shard), model
        self.expect_sha, self.verify, self.use_gpu = expect_checkpoint_sha, verify, use_gpu
        self.check = check  # every file's fast hash before a version serves (gare_index.store.file_check)
        self.keep = max(1, int(keep))
        self.rerank_settings = rerank_settings  # where its psi rerank runs: the service's setting, every call
        self._open: OrderedDict[int, VersionHandle] = OrderedDict()  # generation -> its version of this shard
        self._lock = threading.Lock()
        gen = current_generation(self.root)
        if gen is None:
            raise IndexFormatError(f"{self.root}: no GENERATION file; not a sharded gare index")
        if not 0 <= self.shard < gen.n_shards:
            raise IndexFormatError(f"{self.root}: shard {self.shard} does not exist (generation {gen.number} has "
                                   f"{gen.n_shards} shards)")
        self.n_shards = gen.n_shards
        self.open(gen.number)  # the current generation now, not in the first request
        rerank.warm_up(model.device, rerank_settings)  # compile the CPU rerank kernel now (as gare-serve does), not in a request

    # ------------------------------------------------------------------ versions by generation
    def _acquire(self, generation: int) -> VersionHandle:
        """This shard's version of ``generation``, held (release it); opened on first use."""
        with self._lock:
            h = self._open.get(generation)
            if h is not None:
                self._open.move_to_end(generation)
                return h.acquire()
        gen = read_generation(self.root, int(generation))  # IndexFormatError naming the file when it is gone
        if gen.n_shards != self.n_shards:
            raise IndexFormatError(f"{self.root}: generation {gen.number} has {gen.n_shards} shards, this server "
                                   f"was started for {self.n_shards}")
        version = open_version(shard_root(self.root, self.shard), gen.versions[self.shard],
                               expect_checkpoint_sha=self.expect_sha, verify=self.verify, use_gpu=self.use_gpu,
                               mmap_ann=True, check=self.check)
        cfg = self.model.cfg
        if version.n and (version.dim != cfg.embed_dim or version.max_frames != cfg.max_frames):
            version.close()
            raise IndexFormatError(f"shard {self.shard} version {version.name} has dim={version.dim}, max_frames="
                                   f"{version.max_frames}; the model has {cfg.embed_dim}, {cfg.max_frames}")
        rerank.prepare(self.model, version)  # the fold's constants (folded in memory when the version has none)
        advise_random_access(version)
        with self._lock:
            h = self._open.get(generation)
            if h is None:  # another thread may have opened it meanwhile: keep one
                h = self._open[generation] = VersionHandle(version)
                log.info("shard %d: generation %d -> version %s (%d entries)", self.shard, generation,
                         version.name, version.n)
            else:
                version.close()
            self._open.move_to_end(generation)
            h.acquire()
            while len(self._open) > self.keep:  # the oldest generation closes once its requests are done
                _, old = self._open.popitem(last=False)
                old.retire()
        return h

    def open(self, generation: int) -> str:
        """Open ``generation``'s version of this shard now (the ingress calls it before switching); its name."""
        h = self._acquire(generation)
        try:
            return h.version.name
        finally:
            h.release()

    def _run(self, generation: int, fn: Any, *args: Any) -> Any:
        h = self._acquire(generation)
        try:
            return fn(h.version, *args)
        finally:
            h.release()

    # ------------------------------------------------------------------ the calls
    def candidates(self, generation: int, t: np.ndarray, options: Sequence[SearchOptions]) -> list[SH.ShardCandidates]:
        """Stage 1 + psi + biases of text queries t (a, d) float32 (un-normalised) on this shard."""
        return self._run(generation, lambda v: SH.shard_candidates(self.model, v, t, list(options),
                                                                   rerank_settings=self.rerank_settings))

    def example_rows(self, generation: int, local_ids: Sequence[int]) -> SH.ExampleRows:
        return self._run(generation, lambda v: SH.example_rows(v, local_ids, shard=self.shard, n_shards=self.n_shards))

    def example_candidates(self, generation: int, query: SH.ExampleQuery, options: SearchOptions) -> SH.ShardCandidates:
        return self._run(generation, lambda v: SH.shard_example_candidates(v, query, options, shard=self.shard,
                                                                            n_shards=self.n_shards))

    def image_candidates(self, generation: int, unit: np.ndarray, options: SearchOptions) -> SH.ShardCandidates:
        return self._run(generation, lambda v: SH.shard_image_candidates(v, unit, options))

    def metadata(self, generation: int, local_ids: Sequence[int]) -> list[dict[str, Any]]:
        """The rows of the LOCAL ids this shard holds (unknown ones left out; the ingress names them)."""
        def rows(v: Any) -> list[dict[str, Any]]:
            q = np.asarray(list(local_ids), dtype=np.int64)
            known = q[v.rows(q, missing="mask") >= 0]
            return v.metadata(known) if known.size else []
        return self._run(generation, rows)

    def stage1_probe(self, generation: int, unit: np.ndarray, k: int, ncl_stage1: bool, cpu_share: float = 1.0,
                     chunk_bytes: int = CHUNK_BYTES) -> ShardProbe:
        """The recall watch's look at this shard for one sampled query (unit (d,), the stage-1 query vector): the
        exact top-10 over the shard's stage-1 vectors (``gare_serve.engine.exact_scan.exact_top``, in chunks of
        ``chunk_bytes``, paced to ``cpu_share`` of this thread's wall time), and its stage-1 top ``k`` through the
        version's ANN, as the searches run it (``gare_search.stage1``)."""
        def probe(v: Any) -> ShardProbe:
            q = np.ascontiguousarray(unit, dtype=np.float32).reshape(-1)
            ids, scores = exact_top(v, q, TOP, ncl_stage1=ncl_stage1, step=cpu_pacer(float(cpu_share)),
                                    chunk_rows=max(1, int(chunk_bytes) // max(1, 4 * int(v.dim))))
            listed = np.zeros(0, np.int64)
            if v.n:  # an empty shard lists nothing
                sc, got = ann_stage(v, q[None, :], max(1, int(k)), ncl_stage1=ncl_stage1)
                listed = valid(sc[0], got[0])[1]
            return ShardProbe(ids, scores, listed)
        return self._run(generation, probe)

    def path_of(self, generation: int, local_id: int) -> str | None:
        p = self._run(generation, lambda v: v.path_of(int(local_id)))
        return None if p is None else str(p)

    def close(self) -> None:
        with self._lock:
            handles = list(self._open.values())
            self._open.clear()
        for h in handles:
            h.retire()


class LocalShards:
    """The shards as the ingress calls them, served in this process; a shard in ``down`` does not answer."""

    def __init__(self, workers: Sequence[ShardWorker]) -> None:
        self.workers = list(workers)
        self.n_shards = len(self.workers)
        self.down: set[int] = set()

    def call(self, method: str, args: Mapping[int, tuple[Any, ...]], timeout_s: float | None = None) -> dict[int, Any]:
        """shard -> its answer to ``method(*args[shard])``; a shard that did not answer is left out (``timeout_s``:
        the Ray handles' wait; nothing waits here)."""
        if method not in SHARD_CALLS:
            raise ValueError(f"unknown shard call {method!r}; one of {SHARD_CALLS}")
        return {s: getattr(self.workers[s], method)(*a) for s, a in args.items() if s not in self.down}

    def close(self) -> None:
        for w in self.workers:
            w.close()
