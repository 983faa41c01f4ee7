"""Search by example: "more like this" (query = indexed videos) and image queries (docs/search-by-example.md).

Both go through stage 1 (the ANN over the unit video vectors v̂_j) like a text query. psi is defined only for a
text query (SPEC: Δ = psi(t, F_j) moves the *text* embedding towards video j), so neither kind of example
query can use it:

- videos: the stage-2 rerank is the symmetric frame-matching score ``s_vv(q, j)`` of the stored frame
  features F (shape (f, d), the temporal transformer's outputs, the same rows psi attends over):
  ``½ [mean_a max_b cos(F_q[a], F_j[b]) + mean_b max_a cos(F_q[a], F_j[b])]``, averaged over the query
  videos. It compares the videos moment by moment where the pooled v̂ only compares their averages.
- images: stage 1 only; the image is one frame through the CLIP image tower and the temporal transformer
  (a one-frame video), so its vector lives where v̄ does, and the score is cos(v̂_image, v̂_j).

The NCL biases b_j are the Sinkhorn duals for *text* queries (SPEC: the bank is text embeddings), on the
scale of text-video scores; they are reported but never added here.

A sharded index runs the same steps per shard (:mod:`gare_search.shard_search`): :func:`example_candidates` (stage 1
without the query videos), :func:`frame_match_rerank` (s_vv against frames that may come from other shards) and
:func:`rank_examples` (the ranking, on the merged candidates).
"""

from __future__ import annotations

import io
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from gare.model_protocols import SearchModel
from gare.video import clip_transform
from gare_index.version_protocol import SearchVersion
from gare_search.filtered import FilterPlan, filtered_stage1
from gare_search.query import sync, unit_rows
from gare_search.search import Hit, QueryResult, SearchOptions

if TYPE_CHECKING:
    from PIL.Image import Image

IMAGE_TYPES = {"image/jpeg": "JPEG", "image/png": "PNG", "image/webp": "WEBP", "image/gif": "GIF"}


class ExampleError(ValueError):
    """A bad example (unknown id, undecodable image): the service answers 4xx with this message."""


class UnknownExample(ExampleError):
    """An example id that is not in the index version (the service answers 404)."""


def video_query_unit(version: SearchVersion, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(unit query vector (1, d): the mean of the videos' v̂ renormalised, their row positions)."""
    try:
        rows = version.rows(np.asarray(list(ids), dtype=np.int64))
    except KeyError as e:
        raise UnknownExample(str(e.args[0] if e.args else e)) from None
    u = np.asarray(version.units[rows], dtype=np.float32).mean(axis=0, keepdims=True)
    return unit_rows(u), rows


def frame_match_scores(q_frames: np.ndarray, q_masks: np.ndarray, frames: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """s_vv for one query video against n candidates.

    q_frames (fq, d), q_masks (fq,) bool; frames (n, f, d), masks (n, f) -> (n,) float32 in [-1, 1]."""
    qf = np.asarray(q_frames, np.float32)[np.asarray(q_masks, bool)]
    qf = qf / np.maximum(np.linalg.norm(qf, axis=1, keepdims=True), 1e-12)
    cf = np.asarray(frames, np.float32)
    cf = cf / np.maximum(np.linalg.norm(cf, axis=2, keepdims=True), 1e-12)
    m = np.asarray(masks, bool)
    sim = np.einsum("ad,nbd->nab", qf, cf)  # (n, fq, f)
    sim_masked = np.where(m[:, None, :], sim, -np.inf)
    q_to_c = sim_masked.max(axis=2).mean(axis=1)  # each query frame's best candidate frame
    c_best = np.where(m, sim.max(axis=1), 0.0)  # each candidate frame's best query frame
    c_to_q = c_best.sum(axis=1) / np.maximum(m.sum(axis=1), 1)
    return (0.5 * (q_to_c + c_to_q)).astype(np.float32)


def example_candidates(version: SearchVersion, u: np.ndarray, exclude: Sequence[int] | np.ndarray,
                       candidates: int, opts: SearchOptions | None = None,
                       plans: list[FilterPlan | None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Stage 1 of a "more like this" query: (cosines (K',), ids (K',)), the top K = `candidates` by cos(û, v̂_j)
    of the version's videos other than `exclude` (the query videos it holds); K' <= K when the version is small.

    u (1, d) unit query vector. It asks for K + |exclude| slots: the query videos are their own nearest
    neighbours, and once they are dropped the first K left are the top K of the others. With a filter in `opts`
    only passing videos are candidates (gare_search.filtered; its plan appended to `plans` when given)."""
    exclude = np.asarray(exclude, dtype=np.int64).reshape(-1)
    if opts is not None and opts.filter is not None:
        sc_l, id_l, plan = filtered_stage1(version, u, int(candidates), opts.filter, ncl_stage1=False,
                                           exact_below=opts.filter_exact_below, exclude=exclude)
        if plans is not None:
            plans.append(plan)
        return sc_l[0], id_l[0]
    sc, got = version.search(u, min(int(candidates) + exclude.size, max(version.n, 1)))
    keep = (got[0] >= 0) & ~np.isin(got[0], exclude)
    return sc[0][keep][:candidates], got[0][keep][:candidates]


def frame_match_rerank(version: SearchVersion, cand_ids: np.ndarray, q_frames: Sequence[np.ndarray],
                       q_masks: Sequence[np.ndarray]) -> np.ndarray:
    """s_vv(Q, j) for the version's candidates `cand_ids` (n,): the mean over the query videos (q_frames[i]
    (fq, d), q_masks[i] (fq,), in request order; they may live in another index, a shard) -> (n,) float32."""
    rows = version.rows(cand_ids)
    frames, masks = np.asarray(version.frames[rows]), np.asarray(version.masks[rows])
    psi = np.zeros(np.asarray(cand_ids).size, np.float32)
    for qf, qm in zip(q_frames, q_masks, strict=True):
        psi += frame_match_scores(qf, qm, frames, masks)
    psi /= len(q_frames)
    return psi


def search_by_videos(version: SearchVersion, ids: Sequence[int], opts: SearchOptions) -> QueryResult:
    """More like these videos: stage 1 with their mean unit vector, rerank by s_vv, the query videos excluded."""
    t0 = time.perf_counter()
    ids = list(dict.fromkeys(int(i) for i in ids))
    u, q_rows = video_query_unit(version, ids)
    t1 = time.perf_counter()
    plans: list[FilterPlan | None] = []
    ann_s, ann_i = example_candidates(version, u, ids, int(opts.candidates), opts, plans)
    t2 = time.perf_counter()
    psi = None
    if opts.rerank and ann_i.size:
        psi = frame_match_rerank(version, ann_i, [version.frames[r] for r in q_rows],
                                 [version.masks[r] for r in q_rows])
    t3 = time.perf_counter()
    hits = _rank_no_bias(version, ann_s, ann_i, psi, opts.k)
    t4 = time.perf_counter()
    return _with_plan(QueryResult(hits, {"encode": t1 - t0, "ann": t2 - t1, "rerank": t3 - t2, "rank": t4 - t3,
                                         "total": t4 - t0}), plans)


def _with_plan(res: QueryResult, plans: list[FilterPlan | None]) -> QueryResult:
    """The result with its filter's plan and cost (a filtered search), as a text search reports them."""
    if plans and plans[0] is not None:
        res.plan = plans[0]
        res.timings["filter"] = plans[0].filter_s
    return res


class UnsupportedImageType(ExampleError):
    """The declared content type is not one of IMAGE_TYPES (the service answers 415)."""


class DecodeBudgetExceeded(ExampleError):
    """Decoding the image took more CPU time than its budget (``decode_image(budget_s=...)``): it was stopped."""


class _BudgetedReader(io.BytesIO):
    """The upload's bytes, read by Pillow's decoder block by block: each read checks the decoding thread's CPU
    time against the budget and stops the decode (raises) past it. A decode running in a thread cannot be killed
    from outside; this stops it from within, at its next block."""

    def __init__(self, data: bytes, budget_s: float) -> None:
        super().__init__(data)
        self.budget_s = budget_s
        self.started = time.thread_time()

    def check(self) -> None:
        if time.thread_time() - self.started > self.budget_s:
            raise DecodeBudgetExceeded(f"decoding the image took more than its budget of {self.budget_s:g} s of CPU "
                                       f"(image_decode_budget_s); send a smaller image")

    def read(self, size: int | None = -1, /) -> bytes:
        self.check()
        return super().read(size)


# Compressed bytes handed to Pillow's decoder per step when a budget is set (Pillow's own is 64 KiB). A PNG's
# zlib stream can expand ~1000x, so one 64 KiB step may be ~64 MB of pixels; 4 KiB bounds what runs between
# two budget checks to a few MB of pixels.
BUDGET_BLOCK = 4096


def image_type(content_type: str | None) -> str | None:
    """The accepted media type a Content-Type names (``IMAGE/PNG``, `` image/png ; x=y`` -> ``image/png``;
    case-insensitive, parameters ignored), or None when it names none of IMAGE_TYPES."""
    if not content_type:
        return None
    base = content_type.split(";", 1)[0].strip().lower()
    return base if base in IMAGE_TYPES else None


# The fixed message of each way decoding can fail. Pillow's own text is never shown: it can carry the repr of
# the buffer it read (``<_io.BytesIO object at 0x7f...>``), a file path or a library's internals.
_NOT_THIS_TYPE = "could not decode the image as {fmt}: the data is not a {fmt} image (or its header is damaged)"
_BROKEN = "could not decode the image as {fmt}: the data is truncated or corrupt"


def reduced_size(size: tuple[int, int], short_side: int) -> tuple[int, int]:
    """(w, h) scaled so that its short side is `short_side` (never enlarged; each side at least 1)."""
    w, h = size
    s = min(w, h)
    if s <= short_side:
        return w, h
    return max(1, round(w * short_side / s)), max(1, round(h * short_side / s))


def decode_image(data: bytes, content_type: str | None, *, max_pixels: int, max_aspect: float | None = None,
                 image_size: int | None = None, budget_s: float | None = None) -> Image:
    """Bytes -> RGB PIL image, refusing what is not a still image of an allowed type within the bounds.

    Checked from the header, before any pixel is decoded: the pixel count (``max_pixels``: width x height) and
    the aspect ratio (``max_aspect``: long side / short side; None = unchecked). The model's transform resizes
    the *short* side to its ``image_size``, so a 100000x1 image would be enlarged to 22 400 000 x 224 pixels:
    the aspect bound is what keeps that enlargement small.

    With ``image_size`` (the model's input side) the image is reduced while it is decoded: a JPEG is decoded
    at 1/2, 1/4 or 1/8 scale (Pillow's ``draft``) and any image whose short side is still above
    ``2 * image_size`` is reduced (box-reduce, then bicubic: Pillow's ``reducing_gap``) to a short side of
    ``2 * image_size``. The model transform (bicubic to ``image_size``, centre crop) then sees the same picture
    as from the full-size image, up to resampling. None: the image is returned at its full size.

    With ``budget_s`` the decode is bounded in CPU time (of the calling thread): the compressed data is fed to
    the decoder in small blocks, the time is checked before each and between the steps (decode, convert, reduce),
    and past the budget the decode stops with DecodeBudgetExceeded. A WebP is decoded in one call of its
    library, so it is checked only between the steps (its size is bounded by ``max_pixels``).

    Every failure raises ExampleError with a fixed message (UnsupportedImageType for a type not accepted)."""
    from PIL import Image

    kind = image_type(content_type)
    if kind is None:
        raise UnsupportedImageType(f"image type {content_type!r} is not accepted; send one of {sorted(IMAGE_TYPES)}")
    fmt = IMAGE_TYPES[kind]
    # Pillow's own decompression-bomb guard (Image.MAX_IMAGE_PIXELS, a process-wide value) is left as it is:
    # changing it per call would race between the threads decoding at once. The bound here is checked first.
    reader = _BudgetedReader(data, budget_s) if budget_s is not None else io.BytesIO(data)
    try:
        im = Image.open(reader, formats=[fmt])
    except DecodeBudgetExceeded:
        raise
    except Image.DecompressionBombError:  # beyond 2 x Image.MAX_IMAGE_PIXELS: refused by Pillow at open
        limit = min(max_pixels, 2 * Image.MAX_IMAGE_PIXELS) if Image.MAX_IMAGE_PIXELS else max_pixels
        raise ExampleError(f"image has more than {limit} pixels; at most {limit} are accepted") from None
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - Pillow raises many types; the message is fixed whatever it was
        raise ExampleError(_NOT_THIS_TYPE.format(fmt=fmt)) from None
    with im:
        w, h = im.size
        if w < 1 or h < 1:
            raise ExampleError(_NOT_THIS_TYPE.format(fmt=fmt))
        if w * h > max_pixels:
            raise ExampleError(f"image is {w}x{h} = {w * h} pixels; at most {max_pixels} are accepted")
        if max_aspect is not None and max(w, h) > max_aspect * min(w, h):
            raise ExampleError(f"image is {w}x{h}: its long side is {max(w, h) / min(w, h):.4g} times its short side; "
                               f"at most {max_aspect:g} times is accepted")
        target = 2 * int(image_size) if image_size else None
        try:
            im.seek(0)
            if target is not None and fmt == "JPEG":
                im.draft("RGB", reduced_size((w, h), target))  # decodes at 1/2, 1/4 or 1/8 when that stays >= target
            if isinstance(reader, _BudgetedReader):
                im.decodermaxblock = BUDGET_BLOCK
            im.load()
            if isinstance(reader, _BudgetedReader):
                reader.check()
            if im.size[0] * im.size[1] > max_pixels:  # a format whose first frame is larger than its header said
                raise ExampleError(f"image is {im.size[0]}x{im.size[1]} pixels; at most {max_pixels} are accepted")
            out = im if im.mode == "RGB" else im.convert("RGB")  # "P", "1": resize would fall back to NEAREST
            if isinstance(reader, _BudgetedReader):
                reader.check()
            if target is not None and min(out.size) > target:
                out = out.resize(reduced_size(out.size, target), Image.Resampling.BICUBIC, reducing_gap=3.0)
            return out.copy() if out is im else out  # not tied to the file object closed below
        except ExampleError:
            raise
        except MemoryError:
            raise
        except Exception:  # noqa: BLE001 - truncated data, bad chunks, zlib errors, ...: one fixed message
            raise ExampleError(_BROKEN.format(fmt=fmt)) from None


@torch.no_grad()
def encode_image(model: SearchModel, image: Image) -> np.ndarray:
    """One PIL image -> unit vector (1, d): a one-frame clip through the video encoder (CLIP image tower,
    then the temporal transformer), so that it is comparable with the indexed v̂."""
    x = clip_transform(model.cfg.image_size)(image)[None, None]  # (1, 1, 3, H, W)
    _, vbar = model.encode_video(x, torch.ones(1, 1, dtype=torch.bool))
    return unit_rows(vbar)


def search_by_image(model: SearchModel, version: SearchVersion, image: Image, opts: SearchOptions) -> QueryResult:
    """Stage 1 only: cos(v̂_image, v̂_j) over the ANN (no psi: it needs a text query)."""
    t0 = time.perf_counter()
    u = encode_image(model, image)
    sync(model.device)
    t1 = time.perf_counter()
    plans: list[FilterPlan | None] = []
    if opts.filter is not None:
        sc_l, id_l, plan = filtered_stage1(version, u, int(opts.candidates), opts.filter, ncl_stage1=False,
                                           exact_below=opts.filter_exact_below)
        plans.append(plan)
        ann_s, ann_i = sc_l[0], id_l[0]
    else:
        sc, got = version.search(u, int(opts.candidates))
        ok = got[0] >= 0
        ann_s, ann_i = sc[0][ok], got[0][ok]
    t2 = time.perf_counter()
    hits = _rank_no_bias(version, ann_s, ann_i, None, opts.k)
    t3 = time.perf_counter()
    return _with_plan(QueryResult(hits, {"encode": t1 - t0, "ann": t2 - t1, "rerank": 0.0, "rank": t3 - t2,
                                         "total": t3 - t0}), plans)


def rank_examples(ann_s: np.ndarray, ann_i: np.ndarray, rerank: np.ndarray | None, biases: np.ndarray,
                  k: int) -> list[Hit]:
    """Rank an example query's candidates (ann_i (n,), their cosines, s_vv or None, their biases b_j (n,)):
    by s_vv (videos) or the cosine (images, or rerank off) desc, then id asc; top k. Biases reported, not added."""
    if not ann_i.size:
        return []
    final = ann_s if rerank is None else rerank
    order = np.lexsort((ann_i, -final))[:k]
    # psi_score stays None: no psi ran; `score` is s_vv (videos) or the cosine (images).
    return [Hit(id=int(ann_i[j]), score=float(final[j]), ann_score=float(ann_s[j]), psi_score=None,
                bias=float(biases[j]))
            for j in order]


def _rank_no_bias(version: SearchVersion, ann_s: np.ndarray, ann_i: np.ndarray, rerank: np.ndarray | None, k: int) -> list[Hit]:
    if not ann_i.size:
        return []
    return rank_examples(ann_s, ann_i, rerank, np.asarray(version.biases, dtype=np.float32)[version.rows(ann_i)], k)


__all__ = ["IMAGE_TYPES", "ExampleError", "UnsupportedImageType", "DecodeBudgetExceeded", "BUDGET_BLOCK", "image_type", "reduced_size", "video_query_unit",
           "frame_match_scores", "example_candidates", "frame_match_rerank", "rank_examples", "search_by_videos",
           "decode_image", "encode_image", "search_by_image"]
