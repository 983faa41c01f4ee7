"""The sharded search: one query over every shard of a sharded index (:mod:`gare_index.shards`), merged into the
answer a single index over the same videos gives, by text, by example and by image.

The query is encoded once, t (a, d). Every shard runs stage 1 (its own top K by the stage-1 score) and the
rerank of those K on its own memory-mapped arrays (:func:`shard_candidates`, what a Ray shard replica runs,
returning :class:`ShardCandidates` with LOCAL ids); :func:`merge` turns local ids into global ones
(``local * N + shard``, :func:`gare_index.shards.global_id`), keeps the global top K of the union by (stage-1 score
desc, global id asc) and ranks those with :func:`gare_search.search.rank`, as one index does.

Why that equals one index (exact, flat stage 1): the single index's K candidates are the global top K by the
stage-1 score; each one is in its own shard's top K (a shard holds a subset of the videos), so the union of the
shards' top K holds them all and its top K is that same set. A video's psi score depends on the query and the
video alone, and its NCL bias is fitted over the whole gallery and stored in its shard (the builder's job), so
the ranked top k is the same, scores included. With ``ncl_stage1`` a shard chooses its K by cos + b (and returns
cos and b): the merge keys on ann + bias. Exact ties on the stage-1 score at the K boundary may break
differently, since the two indexes number the videos differently.

A shard that did not answer is a None part: the merged result says ``partial`` and names the missing shards
(never a silent drop); whether a partial answer is served (or a 503) is the caller's choice.

By example (:func:`search_sharded_by_videos`): the example videos are looked up in their own shards
(:func:`split_examples`, :func:`example_rows`) into one :class:`ExampleQuery` (their mean unit vector and frame
features, :func:`example_query`), which every shard searches like one index does
(:func:`shard_example_candidates`: stage 1 without the query videos, s_vv rerank; :mod:`gare_search.by_example`).
By image (:func:`search_sharded_by_image`): the image vector is encoded once, every shard runs stage 1
(:func:`shard_image_candidates`). Both merge with ``kind="example"`` (ranked by
:func:`gare_search.by_example.rank_examples`: biases reported, not added).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from gare.model_protocols import PsiModel, SearchModel
from gare_index.shards import ShardedIndex, global_id, split_id
from gare_index.version_protocol import SearchVersion
from gare_search.by_example import (
    UnknownExample,
    encode_image,
    example_candidates,
    frame_match_rerank,
    rank_examples,
)
from gare_search.filtered import FilterPlan, filtered_stage1
from gare_search.query import encode_queries, sync, unit_rows
from gare_search.rerank import DEFAULT_RERANK, RerankSettings, rerank_shortlists
from gare_search.search import Hit, SearchOptions, rank
from gare_search.stage1 import shortlists, valid

if TYPE_CHECKING:
    from PIL.Image import Image

MERGE_KINDS = ("text", "example")  # how merge ranks: psi + NCL biases (text), or s_vv / cosine, no biases


@dataclass
class ShardCandidates:
    """One query's candidates on one shard: its top K by the stage-1 score (K' <= K on a small shard)."""

    ids: np.ndarray  # (K',) int64, the shard's LOCAL ids
    ann: np.ndarray  # (K',) float32, stage-1 cosine
    psi: np.ndarray | None  # (K',) float32: psi (text) or s_vv (example); None when no rerank ran
    bias: np.ndarray  # (K',) float32, the NCL bias b_j stored in the shard
    timings: dict[str, float] = field(default_factory=dict)  # seconds on the shard: ann, rerank (the shard's batch)


@dataclass
class MergedResult:
    """One query's merged hits over all shards (GLOBAL ids); `partial` when some shard did not answer."""

    hits: list[Hit]
    partial: bool = False
    missing_shards: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds: ann / rerank (slowest shard), merge, ...


class ShardsMissing(RuntimeError):
    """A step that needs some shards (the examples' own shards) got no answer from them."""

    def __init__(self, shards: Sequence[int], what: str) -> None:
        self.shards = sorted(int(s) for s in shards)
        super().__init__(f"shards {self.shards} did not answer: {what}")


def per_query(options: SearchOptions | Sequence[SearchOptions], n_q: int) -> list[SearchOptions]:
    """One SearchOptions per query (the same for all, or one each: ValueError when the counts differ)."""
    if isinstance(options, SearchOptions):
        return [options] * n_q
    opts = list(options)
    if len(opts) != n_q:
        raise ValueError(f"{n_q} queries but {len(opts)} option sets")
    return opts


def as_query_tensor(t: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """Query embeddings (a, d) as float32 on `device` (a Ray shard replica receives them as numpy)."""
    x = torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32)) if isinstance(t, np.ndarray) else t
    if x.ndim != 2:
        raise ValueError(f"query embeddings must be (queries, d), got shape {tuple(x.shape)}")
    return x.to(device=device, dtype=torch.float32)


def shard_biases(version: SearchVersion, ids: np.ndarray) -> np.ndarray:
    """The NCL biases b_j (K',) float32 of the shard's local ids."""
    if not ids.size:
        return np.zeros(0, np.float32)
    return np.asarray(version.biases, dtype=np.float32)[version.rows(ids)]


# ------------------------------------------------------------------------------------------ text queries
def shard_candidates(model: PsiModel, version: SearchVersion, t: torch.Tensor | np.ndarray,
                     options: SearchOptions | Sequence[SearchOptions], *,
                     rerank_settings: RerankSettings = DEFAULT_RERANK) -> list[ShardCandidates]:
    """Stage 1 (top K by the stage-1 score) + psi + biases of every query on ONE shard (an opened IndexVersion).

    t (a, d) float32, the un-normalised query embeddings (psi needs |t|); one option set or one per query. The
    stages are gare_search's (one ANN call per distinct (K, ncl_stage1), one psi pass for the batch), so a shard
    computes for its videos exactly what a single index computes for them. `rerank_settings`: where the psi
    rerank runs and its threads (a Ray shard replica passes the service's)."""
    t = as_query_tensor(t, model.device)
    n_q = int(t.shape[0])
    opts = per_query(options, n_q)
    t0 = time.perf_counter()
    units = unit_rows(t)  # (a, d) float32: the stage-1 query vectors
    plans: list[FilterPlan | None] = [None] * n_q
    ann_s, ann_i = shortlists(version, units, opts, plans)
    t1 = time.perf_counter()
    psi = rerank_shortlists(model, version, t, ann_i, opts, rerank_settings)
    sync(t.device)
    t2 = time.perf_counter()
    timings = {"ann": t1 - t0, "rerank": t2 - t1}
    # a filtered query's shard also reports the filter's cost (each shard evaluates it over its own rows)
    return [ShardCandidates(ids=ann_i[i], ann=ann_s[i], psi=psi[i], bias=shard_biases(version, ann_i[i]),
                            timings=dict(timings) | ({} if plans[i] is None else {"filter": plans[i].filter_s}))
            for i in range(n_q)]


# ------------------------------------------------------------------------------------------ the merge
def merge(parts: Sequence[Sequence[ShardCandidates] | None], n_shards: int,
          options: SearchOptions | Sequence[SearchOptions], *, kind: str = "text",
          n_queries: int | None = None) -> list[MergedResult]:
    """Merge the shards' candidates into each query's global top k.

    parts[s]: shard s's candidates, one per query (``shard_candidates``), or None when shard s did not answer
    (its queries' results are ``partial`` and name it). Per query: local ids -> global ids, the global top K
    (K = the query's ``candidates``) of the union by (stage-1 score desc, global id asc) (the stage-1 score is
    ann, or ann + bias with ``ncl_stage1``), then ``kind="text"``: :func:`gare_search.search.rank` (psi + biases
    when ncl); ``kind="example"``: :func:`gare_search.by_example.rank_examples`. `n_queries` is needed only when
    no shard answered and `options` is one option set."""
    if kind not in MERGE_KINDS:
        raise ValueError(f"merge kind must be one of {MERGE_KINDS}, got {kind!r}")
    if len(parts) != n_shards:
        raise ValueError(f"merge got {len(parts)} shard parts for n_shards={n_shards} (one entry per shard, "
                         "None for a shard that did not answer)")
    answered = [s for s, p in enumerate(parts) if p is not None]
    missing = [s for s, p in enumerate(parts) if p is None]
    if n_queries is None:
        if answered:
            n_queries = len(parts[answered[0]])
        elif not isinstance(options, SearchOptions):
            n_queries = len(options)
        else:
            raise ValueError("merge: no shard answered and the number of queries is unknown; pass n_queries")
    for s in answered:
        if len(parts[s]) != n_queries:
            raise ValueError(f"merge: shard {s} answered {len(parts[s])} queries, expected {n_queries}")
    opts = per_query(options, n_queries)
    t0 = time.perf_counter()
    out = []
    for i, o in enumerate(opts):
        got = [(s, parts[s][i]) for s in answered]
        hits = merge_one(got, n_shards, o, kind)
        out.append(MergedResult(hits=hits, partial=bool(missing), missing_shards=list(missing),
                                timings=slowest([c.timings for _, c in got])))
    merge_s = time.perf_counter() - t0
    for r in out:
        r.timings["merge"] = merge_s
    return out


def merge_one(got: Sequence[tuple[int, ShardCandidates]], n_shards: int, o: SearchOptions, kind: str) -> list[Hit]:
    """One query: (shard, its candidates) of the shards that answered -> the ranked global top k."""
    if not got:
        return []
    gids, ann, bias, keep = stage1_cut(got, n_shards, int(o.candidates), ncl_stage1=o.ncl_stage1)
    have_psi = [c.psi is not None for _, c in got]
    if any(have_psi) and not all(have_psi):
        raise ValueError(f"merge: shards {[s for (s, _), h in zip(got, have_psi, strict=True) if not h]} sent no "
                         "rerank scores where the others did")
    psi = np.concatenate([np.asarray(c.psi, np.float32) for _, c in got]) if all(have_psi) else None
    psi_k = None if psi is None else psi[keep]
    if kind == "text":
        return rank(ann[keep], gids[keep], psi_k, bias[keep], o)
    return rank_examples(ann[keep], gids[keep], psi_k, bias[keep], o.k)


def stage1_cut(got: Sequence[tuple[int, ShardCandidates]], n_shards: int, k: int, *,
               ncl_stage1: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The union of the shards' stage-1 lists and its global top ``k``, the candidates a merged query is reranked
    over: (global ids, ann, bias) of the union, in shard order, and the positions of its top k by (stage-1 score
    desc, global id asc), the stage-1 score being what each shard chose its K by (ann, or ann + bias with
    ``ncl_stage1``: the NCL fold picks by cos + b)."""
    if not got:
        return np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64)
    gids = np.concatenate([global_id(np.full(c.ids.size, s, np.int64), np.asarray(c.ids, np.int64), n_shards)
                           for s, c in got]).astype(np.int64, copy=False)
    ann = np.concatenate([np.asarray(c.ann, np.float32) for _, c in got])
    bias = np.concatenate([np.asarray(c.bias, np.float32) for _, c in got])
    key = ann + bias if ncl_stage1 else ann
    return gids, ann, bias, np.lexsort((gids, -key))[: int(k)]


def slowest(timings: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per stage, the slowest shard's seconds (the shards run side by side, so the merge waits for it)."""
    out: dict[str, float] = {}
    for t in timings:
        for name, sec in t.items():
            out[name] = max(out.get(name, 0.0), float(sec))
    return out


def search_sharded(model: SearchModel, sharded: ShardedIndex, texts: Sequence[str],
                   options: SearchOptions | Sequence[SearchOptions] = SearchOptions(), *, precision: str = "fp32",
                   tower: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   encoder: Callable[[list[str]], torch.Tensor] | None = None,
                   rerank_settings: RerankSettings = DEFAULT_RERANK) -> list[MergedResult]:
    """Text queries over every shard of an opened sharded index (:func:`gare_index.shards.open_sharded`), in one
    process: encode once (`tower`/`encoder` as in :func:`gare_search.search.search_batch`), every shard's
    candidates, merge. Equal to :func:`gare_search.search.search_batch` on one index over the same videos."""
    n_q = len(texts)
    opts = per_query(options, n_q)
    if n_q == 0:
        return []
    t0 = time.perf_counter()
    t = encoder(list(texts)) if encoder is not None else encode_queries(model, texts, precision, tower=tower)
    t = t.to(model.device)
    sync(model.device)
    t1 = time.perf_counter()
    parts = [shard_candidates(model, v, t, opts, rerank_settings=rerank_settings) for v in sharded.shards]
    results = merge(parts, sharded.n_shards, opts)
    t2 = time.perf_counter()
    for r in results:
        r.timings.update({"encode": t1 - t0, "shards": t2 - t1, "total": t2 - t0})
    return results


# ------------------------------------------------------------------------------------------ by example, by image
@dataclass
class ExampleRows:
    """The example videos one shard holds, in the order asked: what an example query needs from them."""

    units: np.ndarray  # (m, d) float32, v̂
    frames: np.ndarray  # (m, f, d), the frame features F (the shard's dtype, float16)
    masks: np.ndarray  # (m, f) bool


@dataclass
class ExampleQuery:
    """A "more like these videos" query, assembled from the examples' own shards."""

    ids: list[int]  # GLOBAL ids of the examples, deduplicated, in request order
    unit: np.ndarray  # (1, d) float32: the mean of their v̂, renormalised
    frames: np.ndarray  # (m, f, d) their frame features, in `ids` order
    masks: np.ndarray  # (m, f) bool


def dedup_ids(ids: Sequence[int]) -> list[int]:
    """The example ids as ints, first occurrence kept (what the single-index search does)."""
    return list(dict.fromkeys(int(i) for i in ids))


def split_examples(ids: Sequence[int], n_shards: int) -> dict[int, list[int]]:
    """shard -> the LOCAL ids of the examples it holds (request order, deduplicated); a negative id is an
    UnknownExample naming it."""
    ids = dedup_ids(ids)
    bad = [i for i in ids if i < 0]
    if bad:
        raise UnknownExample(f"ids not in index: {bad}")
    out: dict[int, list[int]] = {}
    for g in ids:
        s, lo = split_id(g, n_shards)
        out.setdefault(s, []).append(lo)
    return out


def example_rows(version: SearchVersion, local_ids: Sequence[int], *, shard: int, n_shards: int) -> ExampleRows:
    """Shard `shard`'s example videos (its LOCAL ids): their v̂, frames and masks. An id the shard does not hold
    is an UnknownExample naming its GLOBAL id (the id the user sent)."""
    local = np.asarray(list(local_ids), dtype=np.int64)
    rows = version.rows(local, missing="mask")
    if (rows < 0).any():
        gone = global_id(np.full(int((rows < 0).sum()), shard, np.int64), local[rows < 0], n_shards)
        raise UnknownExample(f"ids not in index: {sorted(int(g) for g in gone)}")
    return ExampleRows(units=np.asarray(version.units[rows], dtype=np.float32),
                       frames=np.asarray(version.frames[rows]), masks=np.asarray(version.masks[rows]))


def example_query(ids: Sequence[int], rows: dict[int, ExampleRows], n_shards: int) -> ExampleQuery:
    """Assemble the query from each shard's :func:`example_rows` (``rows[s]`` in the order of
    ``split_examples(ids, n_shards)[s]``); ShardsMissing when a shard holding an example did not answer."""
    ids = dedup_ids(ids)
    wanted = split_examples(ids, n_shards)
    gone = [s for s in wanted if s not in rows]
    if gone:
        raise ShardsMissing(gone, f"they hold example videos {ids}")
    where = {global_id(s, lo, n_shards): (s, j) for s, locs in wanted.items() for j, lo in enumerate(locs)}
    units = np.stack([rows[s].units[j] for s, j in (where[g] for g in ids)])  # (m, d), request order
    frames = np.stack([rows[s].frames[j] for s, j in (where[g] for g in ids)])  # (m, f, d)
    masks = np.stack([rows[s].masks[j] for s, j in (where[g] for g in ids)])  # (m, f)
    # the same mean as one index (by_example.video_query_unit): same rows, same order, same float32 reduction
    return ExampleQuery(ids=ids, unit=unit_rows(units.mean(axis=0, keepdims=True)), frames=frames, masks=masks)


def shard_example_candidates(version: SearchVersion, query: ExampleQuery, options: SearchOptions, *, shard: int,
                             n_shards: int) -> ShardCandidates:
    """One shard's part of a "more like these" query: its top K by cos(û, v̂_j) without the query videos it
    holds, reranked by s_vv against the examples' frames when ``options.rerank`` (psi field = s_vv)."""
    t0 = time.perf_counter()
    s_of, local = split_id(np.asarray(query.ids, dtype=np.int64), n_shards)
    exclude = local[s_of == shard]  # the query videos this shard holds (local ids)
    ann_s, ann_i = example_candidates(version, query.unit, exclude, int(options.candidates), options)
    t1 = time.perf_counter()
    psi = None
    if options.rerank:
        # an empty shortlist still says "reranked", so that the merge sees every shard alike
        psi = (frame_match_rerank(version, ann_i, list(query.frames), list(query.masks)) if ann_i.size
               else np.zeros(0, np.float32))
    t2 = time.perf_counter()
    return ShardCandidates(ids=ann_i, ann=ann_s, psi=psi, bias=shard_biases(version, ann_i),
                           timings={"ann": t1 - t0, "rerank": t2 - t1})


def shard_image_candidates(version: SearchVersion, unit: np.ndarray, options: SearchOptions) -> ShardCandidates:
    """One shard's part of an image query: its top K by cos(î, v̂_j), unit (1, d) (stage 1 only, as one index)."""
    t0 = time.perf_counter()
    if options.filter is not None:  # only the shard's passing videos (gare_search.filtered)
        sc_l, id_l, _ = filtered_stage1(version, np.asarray(unit, dtype=np.float32), int(options.candidates),
                                        options.filter, ncl_stage1=False, exact_below=options.filter_exact_below)
        ann_s, ann_i = sc_l[0], id_l[0]
    else:
        sc, got = version.search(np.asarray(unit, dtype=np.float32), int(options.candidates))
        ann_s, ann_i = valid(sc[0], got[0])
    return ShardCandidates(ids=ann_i, ann=ann_s, psi=None, bias=shard_biases(version, ann_i),
                           timings={"ann": time.perf_counter() - t0, "rerank": 0.0})


def search_sharded_by_videos(sharded: ShardedIndex, ids: Sequence[int], options: SearchOptions) -> MergedResult:
    """More like these videos (GLOBAL ids) over every shard, in one process: equal to
    :func:`gare_search.by_example.search_by_videos` on one index over the same videos."""
    t0 = time.perf_counter()
    n = sharded.n_shards
    wanted = split_examples(ids, n)
    rows = {s: example_rows(sharded.shards[s], locs, shard=s, n_shards=n) for s, locs in wanted.items()}
    q = example_query(ids, rows, n)
    t1 = time.perf_counter()
    parts = [[shard_example_candidates(v, q, options, shard=s, n_shards=n)] for s, v in enumerate(sharded.shards)]
    res = merge(parts, n, options, kind="example")[0]
    t2 = time.perf_counter()
    res.timings.update({"encode": t1 - t0, "shards": t2 - t1, "total": t2 - t0})
    return res


def search_sharded_by_image(model: SearchModel, sharded: ShardedIndex, image: Image, options: SearchOptions) -> MergedResult:
    """An image query (a PIL image) over every shard, in one process: encoded once, then every shard's stage 1
    and the merge; equal to :func:`gare_search.by_example.search_by_image` on one index over the same videos."""
    t0 = time.perf_counter()
    u = encode_image(model, image)  # (1, d) unit
    sync(model.device)
    t1 = time.perf_counter()
    parts = [[shard_image_candidates(v, u, options)] for v in sharded.shards]
    res = merge(parts, sharded.n_shards, options, kind="example")[0]
    t2 = time.perf_counter()
    res.timings.update({"encode": t1 - t0, "shards": t2 - t1, "total": t2 - t0})
    return res


__all__ = ["MERGE_KINDS", "ShardCandidates", "MergedResult", "ShardsMissing", "per_query", "as_query_tensor",
           "shard_candidates", "merge", "stage1_cut", "search_sharded", "ExampleRows", "ExampleQuery", "split_examples",
           "example_rows", "example_query", "shard_example_candidates", "shard_image_candidates",
           "search_sharded_by_videos", "search_sharded_by_image"]
