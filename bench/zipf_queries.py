"""Zipf-distributed query streams for load benchmarks, and the query-cache hit rate they give.

Real search traffic is heavy-tailed: the r-th most popular query is asked with probability ∝ 1 / r^s
(s ≈ 0.6-1.2 in published web/video search logs). :func:`zipf_stream` draws such a stream from a fixed
vocabulary of distinct caption-like queries; with ``perturb`` > 0 a share of the draws is re-typed the way
people do (capitalised, doubled spaces, trailing space), which the cache key normalisation must absorb.

    python -m bench.zipf_queries --distinct 100000 --n 200000 --entries 1000 10000 100000

The library functions (:func:`vocabulary`, :func:`zipf_ranks`, :func:`zipf_stream`, :func:`hit_rates`) are
used by bench/text_encoder.py (hit-rate table) and meant for the HTTP load benchmark.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "service/gare_serve/engine/query_cache.py",
)


REPO = Path(__file__).resolve().parents[1]

_COLORS = ["red", "green", "blue", "yellow", "orange", "purple", "pink", "cyan", "black", "white", "grey", "brown"]
_THINGS = ["dog", "cat", "man", "woman", "car", "ball", "circle", "square", "bird", "child", "horse", "train",
           "boat", "girl", "boy", "robot", "chef", "singer", "player", "truck"]
_ACTS = ["runs across a field", "jumps over a fence", "rises slowly", "slides to the left", "is cooking pasta",
         "plays the guitar", "rolls down a hill", "dances on a stage", "swims in a pool", "drives through a city",
         "talks to the camera", "climbs a wall", "falls asleep", "eats an apple", "waves at people"]
_TAILS = ["", " at night", " in slow motion", " while people watch", ", then it stops", " on a sunny beach",
          " in the rain", " in a kitchen", " on television", " during a game"]
_DETS = ["a", "the", "one", "a small", "a big", "an old", "a young", "two"]


def vocabulary(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct caption-like queries in a random (seeded) popularity order."""
    combos = itertools.product(_DETS, _COLORS, _THINGS, _ACTS, _TAILS)
    total = len(_DETS) * len(_COLORS) * len(_THINGS) * len(_ACTS) * len(_TAILS)
    if n > total:
        raise ValueError(f"at most {total} distinct queries, asked for {n}")
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(total, size=n, replace=False))
    out, j = [], 0
    for i, (d, c, t, a, tail) in enumerate(combos):
        if j < n and i == pick[j]:
            out.append(f"{d} {c} {t} {a}{tail}")
            j += 1
            if j == n:
                break
    order = rng.permutation(n)  # popularity rank is independent of the wording
    return [out[k] for k in order]


def zipf_ranks(n_distinct: int, n: int, s: float = 1.0, seed: int = 0) -> np.ndarray:
    """``n`` ranks in [0, n_distinct) with P(r) ∝ 1 / (r + 1)^s (a bounded Zipf law; s = 0 is uniform)."""
    if n_distinct < 1 or n < 0:
        raise ValueError(f"need n_distinct >= 1 and n >= 0, got {n_distinct}, {n}")
    if s < 0:
        raise ValueError(f"Zipf exponent s must be >= 0, got {s}")
    w = 1.0 / np.arange(1, n_distinct + 1, dtype=np.float64) ** s
    cdf = np.cumsum(w / w.sum())
    u = np.random.default_rng(seed).random(n)
    return np.minimum(np.searchsorted(cdf, u, side="right"), n_distinct - 1)


def _retype(q: str, rng: np.random.Generator) -> str:
    k = int(rng.integers(0, 4))
    if k == 0:
        return q[:1].upper() + q[1:]
    if k == 1:
        return q.replace(" ", "  ", 1)
    if k == 2:
        return q + " "
    return q.upper()


def zipf_stream(
    n: int, *, n_distinct: int = 10_000, s: float = 1.0, perturb: float = 0.0, seed: int = 0,
    vocab: Sequence[str] | None = None,
) -> list[str]:
    """A stream of ``n`` query strings whose popularity follows Zipf(s) over ``n_distinct`` queries."""
    vocab = list(vocab) if vocab is not None else vocabulary(n_distinct, seed)
    ranks = zipf_ranks(len(vocab), n, s, seed + 1)
    out = [vocab[r] for r in ranks]
    if perturb > 0:
        rng = np.random.default_rng(seed + 2)
        flip = rng.random(n) < perturb
        out = [_retype(q, rng) if f else q for q, f in zip(out, flip, strict=True)]
    return out


def hit_rates(
    stream: Sequence[str], entries: Sequence[int], *, d: int = 512, max_bytes: int = 1 << 40, normalize=None,
) -> dict[int, dict[str, float]]:
    """Replay ``stream`` through a real :class:`gare_serve.engine.query_cache.QueryCache` per size (cold start).

    Returns {entries: {"hit_rate", "hit_rate_second_half", "bytes"}}; the second half shows the warm rate.
    """
    import torch

    from gare_serve.engine.query_cache import QueryCache, make_normalizer

    if normalize is None:
        import open_clip

        normalize = make_normalizer(open_clip.get_tokenizer("ViT-B-32"))
    vec = torch.zeros(d)
    out = {}
    half = len(stream) // 2
    for n_entries in entries:
        c = QueryCache(n_entries, max_bytes, normalize=normalize)
        hits_second = 0
        for i, q in enumerate(stream):
            hit = c.get(q, "ckpt") is not None
            if not hit:
                c.put(q, "ckpt", vec)
            elif i >= half:
                hits_second += 1
        st = c.stats()
        out[int(n_entries)] = {
            "hit_rate": st.hit_rate,
            "hit_rate_second_half": hits_second / max(1, len(stream) - half),
            "bytes": st.bytes,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--distinct", type=int, default=100_000)
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--s", type=float, nargs="+", default=[0.8, 1.0, 1.2])
    ap.add_argument("--entries", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--perturb", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    vocab = vocabulary(a.distinct, a.seed)
    print("| s | " + " | ".join(f"{e} entries" for e in a.entries) + " |")
    print("|---|" + "---:|" * len(a.entries))
    for s in a.s:
        res = hit_rates(zipf_stream(a.n, s=s, perturb=a.perturb, seed=a.seed, vocab=vocab), a.entries)
        print(f"| {s} | " + " | ".join(f"{100 * res[e]['hit_rate']:.1f}%" for e in a.entries) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
