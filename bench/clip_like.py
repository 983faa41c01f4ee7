"""Seeded CLIP-like embedding generator for the ANN benchmark (bench/index_ann.py).

Real CLIP video/text embeddings are not isotropic blobs.  This procedure reproduces the properties that
make approximate search hard or easy on them (all steps seeded by ``seed``; d = 512 by default):

1. **Low intrinsic dimension, anisotropic spectrum.**  Every vector lives mostly in a random
   ``intrinsic``-dimensional subspace (default 64) of R^d with a power-law spectrum: latent axis i has
   standard deviation ``(i + 1) ** -spectrum_decay`` (decay 0.5), mapped into R^d by a random orthonormal basis
   ``B`` (intrinsic, d).  A small isotropic full-dimensional noise (``ambient_noise``, 0.15 of the latent
   norm) is added on top, as in real embeddings whose residual variance is spread thin.
2. **A common mean direction (the "cone").**  CLIP embeddings of one modality share a large mean vector
   (mean pairwise cosine ~0.2-0.5).  Gallery vectors get ``mu_v`` of norm ``cone`` (relative to the latent
   norm) added before normalisation.
3. **Heavy-tailed cluster sizes.**  ``n / mean_cluster`` cluster centres are drawn from the latent
   distribution; each vector picks a centre with probability proportional to a Pareto(``pareto_alpha`` = 1.1)
   weight, so a few "topics" hold many vectors and most hold few.  A member is
   ``centre + within * latent_noise`` (``within`` = 0.6: clusters overlap, as topics do).
4. **Near-duplicates.**  A fraction ``dup_frac`` (5%) of the gallery are copies of another gallery vector
   plus noise of relative size ``dup_noise`` (0.05, cosine ~0.99 to the original): re-uploads and re-encodes.
5. **Queries from a shifted distribution (the modality gap).**  A query ("caption") picks a random gallery
   vector (its "video"), takes that vector's latent code plus caption noise of relative size
   ``query_noise`` (0.8: a caption describes only part of a video), and is placed in its own cone: the
   text mean ``mu_t`` instead of ``mu_v``, with ``mu_t - mu_v`` the modality gap (``gap`` = 1.0 relative
   norm), plus its own ambient noise.  Query-to-own-video cosines come out ~0.3-0.5 and query-to-gallery
   cosines are shifted as a whole, like CLIP text-video scores.

6. **Held-out queries from another distribution** (:func:`clip_like_sets`): a topic chosen uniformly (a row's
   weight is 1 / its topic's size, so the many small topics are asked about as often as the few large ones) and
   noisier captions (``held_noise``, default 1.0): what a tuner's sample of queries does not show it.

``HARD`` is a harder gallery than the default (the "hard data" of issue 29): a quarter of it near-duplicates, tighter
and more unequal topics, a larger modality gap and noisier captions.

All outputs are unit float32 rows.  The gallery is generated in chunks straight into one (n, d) float32
array (1M x 512 = 2 GB, no second copy).  ``describe`` reports the statistics the docstring promises
(mean pairwise cosine, query-to-own-video cosine, participation ratio of the spectrum) so a reader can
check the data is what it claims.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["ClipLikeConfig", "HARD", "clip_like", "clip_like_sets", "describe"]


@dataclass(frozen=True)
class ClipLikeConfig:
    d: int = 512
    intrinsic: int = 64
    spectrum_decay: float = 0.5
    ambient_noise: float = 0.15
    cone: float = 0.8
    gap: float = 1.0
    mean_cluster: int = 200
    pareto_alpha: float = 1.1
    within: float = 0.6
    dup_frac: float = 0.05
    dup_noise: float = 0.05
    query_noise: float = 0.8

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Many near-duplicates (25% of the gallery), tighter topics (within 0.45) with a heavier size tail (alpha 0.9),
# a larger modality gap (1.5) and noisier captions (0.9): the gallery issue 29 calls hard.
HARD = ClipLikeConfig(dup_frac=0.25, within=0.45, pareto_alpha=0.9, gap=1.5, query_noise=0.9)


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)


class Space:
    """The shared geometry: latent spectrum, basis, cone means, cluster centres and their weights."""

    def __init__(self, n: int, cfg: ClipLikeConfig, seed: int) -> None:
        rng = np.random.default_rng([seed, 0])
        self.cfg = cfg
        r, d = cfg.intrinsic, cfg.d
        self.scale = ((np.arange(r) + 1.0) ** -cfg.spectrum_decay).astype(np.float32)  # (r,)
        self.latent_norm = float(np.sqrt((self.scale**2).sum()))  # expected |z| of a latent draw
        self.basis = np.linalg.qr(rng.standard_normal((d, r)))[0].T.astype(np.float32)  # (r, d) orthonormal rows
        mu = _unit(rng.standard_normal((2, d)))
        self.mu_v = (cfg.cone * self.latent_norm * mu[0]).astype(np.float32)
        # text cone: the video cone moved by the modality gap (a direction orthogonal-ish to mu_v)
        self.mu_t = (self.mu_v + cfg.gap * self.latent_norm * mu[1]).astype(np.float32)
        n_clusters = max(1, n // cfg.mean_cluster)
        self.centres = (rng.standard_normal((n_clusters, r)) * self.scale).astype(np.float32)  # (C, r)
        w = rng.pareto(cfg.pareto_alpha, size=n_clusters) + 1.0
        self.weights = w / w.sum()

    def latent(self, rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
        """m latent codes (m, r) and their cluster ids (m,)."""
        cl = rng.choice(self.centres.shape[0], size=m, p=self.weights)
        z = self.centres[cl] + self.cfg.within * rng.standard_normal((m, self.scale.size)).astype(
            np.float32) * self.scale
        return z.astype(np.float32), cl

    def embed(self, rng: np.random.Generator, z: np.ndarray, mean: np.ndarray) -> np.ndarray:
        d = self.cfg.d
        amb = self.cfg.ambient_noise * self.latent_norm / np.sqrt(d)
        x = z @ self.basis + mean + amb * rng.standard_normal((z.shape[0], d)).astype(np.float32)
        return _unit(x)


def clip_like(
    n: int, n_queries: int, *, seed: int = 0, cfg: ClipLikeConfig | None = None, chunk: int = 65_536,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gallery (n, d), queries (n_queries, d), query_target (n_queries,) int64): unit float32 rows.

    ``query_target[i]`` is the gallery row the i-th query was written from (its "video").  Deterministic in
    (n, n_queries, seed, cfg) and independent of ``chunk``... except for floating-point summation order."""
    sets = clip_like_sets(n, n_queries, 0, seed=seed, cfg=cfg, chunk=chunk, progress=progress)
    return sets["x"], sets["q"], sets["target"]


def clip_like_sets(
    n: int, n_queries: int, n_held: int, *, seed: int = 0, cfg: ClipLikeConfig | None = None,
    held_noise: float = 1.0, chunk: int = 65_536, progress: bool = False,
) -> dict[str, np.ndarray]:
    """The gallery ``x`` (n, d), ``n_queries`` caption-like queries ``q`` of random gallery rows (``target``), and
    ``n_held`` held-out queries ``q_held`` (``target_held``) from another distribution: a topic chosen uniformly,
    caption noise ``held_noise``.  ``x``, ``q`` and ``target`` equal :func:`clip_like`'s for the same arguments."""
    cfg = cfg or ClipLikeConfig()
    space = Space(n, cfg, seed)
    x = np.empty((n, cfg.d), dtype=np.float32)
    z_all = np.empty((n, cfg.intrinsic), dtype=np.float32)  # kept (n x 64 floats) to write the queries
    cl_all = np.empty(n, dtype=np.int64)  # each row's topic (held-out queries pick topics uniformly)
    starts = range(0, n, chunk)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc=f"clip-like gallery n={n:,}", unit="chunk")
    for s in starts:
        e = min(n, s + chunk)
        rng = np.random.default_rng([seed, 1, s])
        z, cl = space.latent(rng, e - s)
        z_all[s:e], cl_all[s:e] = z, cl
        x[s:e] = space.embed(rng, z, space.mu_v)
    # near-duplicates: row i becomes a noisy copy of an earlier/later row j (in place; j itself unchanged)
    rng = np.random.default_rng([seed, 2])
    n_dup = int(round(cfg.dup_frac * n))
    if n_dup and n > 1:
        dst = rng.choice(n, size=n_dup, replace=False)
        src = rng.integers(0, n, size=n_dup)
        src = np.where(src == dst, (src + 1) % n, src)
        src = np.where(np.isin(src, dst), (src + 7) % n, src)  # mostly copy originals, not copies
        for s in range(0, n_dup, chunk):
            e = min(n_dup, s + chunk)
            noise = rng.standard_normal((e - s, cfg.d)).astype(np.float32) * (cfg.dup_noise / np.sqrt(cfg.d))
            x[dst[s:e]] = _unit(x[src[s:e]] + noise)
            z_all[dst[s:e]] = z_all[src[s:e]]
            cl_all[dst[s:e]] = cl_all[src[s:e]]
    # queries: a caption of a random gallery video, in the text cone
    rng = np.random.default_rng([seed, 3])
    target = rng.integers(0, n, size=n_queries).astype(np.int64)
    zq = z_all[target] + cfg.query_noise * rng.standard_normal((n_queries, cfg.intrinsic)).astype(
        np.float32) * space.scale
    q = space.embed(rng, zq.astype(np.float32), space.mu_t)
    # held out: every topic equally likely (a row's weight = 1 / its topic's size), noisier captions
    rng = np.random.default_rng([seed, 4])
    size = np.bincount(cl_all, minlength=space.centres.shape[0]).astype(np.float64)
    w_row = 1.0 / size[cl_all]
    target_held = rng.choice(n, size=n_held, p=w_row / w_row.sum()).astype(np.int64)
    zh = z_all[target_held] + held_noise * rng.standard_normal((n_held, cfg.intrinsic)).astype(
        np.float32) * space.scale
    q_held = space.embed(rng, zh.astype(np.float32), space.mu_t)
    return {"x": x, "q": q, "target": target, "q_held": q_held, "target_held": target_held,
            "topics": np.asarray(space.centres.shape[0])}


def describe(x: np.ndarray, q: np.ndarray, target: np.ndarray, seed: int = 0, sample: int = 2000) -> dict[str, float]:
    """Statistics that check the generator's claims, on a seeded sample of rows."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(x.shape[0], size=min(sample, x.shape[0]), replace=False)
    xs = np.asarray(x[np.sort(rows)], dtype=np.float32)
    g = xs @ xs.T
    off = g[~np.eye(g.shape[0], dtype=bool)]
    qs = q[: min(sample, q.shape[0])]
    own = np.einsum("ij,ij->i", qs, np.asarray(x[target[: qs.shape[0]]], dtype=np.float32))
    qg = qs @ xs.T
    ev = np.linalg.eigvalsh(np.cov((xs - xs.mean(0)).T))
    pr = float(ev.sum() ** 2 / (ev**2).sum())  # participation ratio: "effective dimension" of the gallery
    return {
        "gallery_mean_pairwise_cos": float(off.mean()),
        "query_to_own_video_cos_mean": float(own.mean()),
        "query_to_random_video_cos_mean": float(qg.mean()),
        "query_own_video_rank_in_sample_approx": float((qg > own[:, None]).sum(1).mean()),
        "gallery_participation_ratio": pr,
        "query_gallery_mean_cos_gap": float(off.mean() - qg.mean()),
    }
