"""Query-time search (SPEC §4-5): the one home of the two-stage search, as pure functions (no HTTP, no state).

Layer: ``training`` core (model, psi) <- ``indexer`` (this module, over :class:`gare_index.store.IndexVersion`)
<- ``service`` (HTTP) and the evaluation tools (``gare_build.compare``, ``bench/``). A request goes
route -> :func:`search_batch` -> :meth:`IndexVersion.search <gare_index.store.IndexVersion.search>` (stage 1,
plain or with the NCL fold of :mod:`gare_index.ncl_ann`) -> psi scores (``training`` psi) -> :func:`rank`.

For each query text: ``t = encode_text`` -> unit ``t/|t|`` -> ANN top-K by ``cos(t, v̄_j)`` -> psi score
``s_tj`` for those K candidates with ``v̄_j = norm_j * unit_j`` rebuilt from the index (Δ is computed block
by block and never kept) -> ``+ b_j`` (NCL bias) -> sort -> top k.

Modes: ``rerank=False`` ranks the K candidates by the dual-tower cosine (ANN-only), ``ncl=False`` leaves
the biases out. :func:`search` is the offline entry point; the service calls the same stage functions
on micro-batches (:func:`search_batch`), so its answers equal the offline ones.

Three implementations of the psi stage give the same scores (tests check it to 1e-5):

* ``"fold"`` (default): psi folded exactly into per-video constants stored in the index
  (:mod:`gare.psi_fold`, :mod:`gare_index.psi_consts`) and per-query vectors: ~3f + 1 dot products per
  pair plus O(f²) work. On the CPU one compiled kernel (:mod:`gare.psi_fold_cpu`, numba) reads each
  candidate's rows straight from the memory-mapped arrays; elsewhere (CUDA) the candidates of a whole batch
  are read once (unique rows) and share their constants in torch ops. An index without valid constants (written before them, or folded for other psi weights) is
  never served with them: the search logs one WARNING per version naming `gare-index upgrade` and uses
  ``"fused"`` for it (same scores, slower);

* ``"model"``: ``model.score(t, F[rows], mask[rows], vbar=norms*units, kv=...)`` as the training code
  defines it, one query at a time (``kv`` from the index when it stores psi's K/V projections);
* ``"fused"``: the same algebra rearranged so the per-frame work is query side. psi's
  attention logits are ``q·(W_k c_f + b_k) = (W_kᵀ q)·c_f + const`` and its output is
  ``Σ_f w_f (W_v c_f + b_v) = W_v (Σ_f w_f c_f) + b_v`` (the weights sum to 1), so instead of projecting
  every one of the K·f candidate frames by W_k and W_v (2·K·f·d² multiply-adds, the bulk of the cost)
  it projects K query rows (2·K·d²). Pairs of different queries are computed in one pass, which is
  what lets the service batch the rerank across requests.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gare import psi_fold as pf
from gare import psi_fold_cpu
from gare import psi_fold_queries as pfq
from gare.model import autocast
from gare.text_quant import encode_each
from gare_index import psi_consts
from gare_index.ncl_ann import Stage1Unavailable

RERANK_IMPLS = ("auto", "fold", "fused", "model")
DEFAULT_RERANK_IMPL = "auto"
# What "auto" means, from the committed measurements (tests/indexer/test_device_defaults.py ties these to them):
# on the CPU the fold is several times faster than fused at K = 256 (bench/results/psi_fold.md). On CUDA, with
# the candidates already on the GPU, fused's few kernels beat the fold's many small ones, but a search gathers
# the candidates from the memory-mapped index, and there the fold (one read per distinct video, no per-pair
# frame copies) is as fast for one query and ~2x faster for 32 (bench/results/gpu_bench.md, search section).
AUTO_RERANK_IMPL = {"cpu": "fold", "cuda": "fold"}
# The text encoder's "auto" precision: fp32 on the CPU (fp16 is CUDA-only; bf16 is slow on AVX2), and fp32 on
# CUDA too: in bench/results/gpu_bench.md fp16/bf16 autocast was slower than fp32 for the service's batch sizes
# (its casts add kernels to a launch-bound tower) and no more accurate.
AUTO_PRECISION = {"cpu": "fp32", "cuda": "fp32"}
DEFAULT_CANDIDATES = 256  # K, the stage-1 shortlist, when nobody says (service, compare, SearchOptions)
# The default for `ncl` follows the evidence (issue 17): on only if + psi + NCL(served) >= + psi in t2v R@1 and
# R@5 on both benchmark corpora (bench/results/ncl_served/); tests/test_ncl_default.py checks this constant
# against the committed results.
NCL_DEFAULT = False
NCL_DEFAULT_REASON = ("NCL biases are off by default: on the two benchmark corpora (bench/results/ncl_served) "
                      "adding them to the psi score did not keep t2v R@1 and R@5 at least as high as psi alone. "
                      "Why: the biases are fitted to the checkpoint's queue of training captions, whose view of which "
                      "videos are popular agrees less with the test queries' than two halves of the test captions "
                      "agree with each other (bench/results/ncl_served/explain_*.md); a bank of served queries "
                      "(GARE_QUERY_BANK_SIZE) is drawn like the queries")
log = logging.getLogger(__name__)
_PAIR_CHUNK = 512  # pairs per fused chunk: ~12 MB of float32 frames stays in cache (bigger chunks are slower)


@dataclass(frozen=True)
class SearchOptions:
    k: int = 10
    candidates: int = DEFAULT_CANDIDATES  # K: ANN shortlist size (>= k)
    rerank: bool = True  # psi stage; False = dual-tower cosine only
    ncl: bool = NCL_DEFAULT  # add the NCL video biases (default: NCL_DEFAULT, the evidence)
    ncl_stage1: bool = False  # choose the candidates by cos + b (the index's folded ANN, --ncl-stage1)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.candidates < self.k:
            raise ValueError(f"candidates (K={self.candidates}) must be >= k ({self.k})")


@dataclass
class Hit:
    id: int
    score: float  # what the ranking used: (psi score or cosine) + bias when ncl
    ann_score: float  # dual-tower cosine from the ANN stage
    psi_score: float | None  # s_tj, None when rerank is off
    bias: float  # b_j (reported even when ncl is off; then not added)


@dataclass
class QueryResult:
    hits: list[Hit]
    timings: dict[str, float] = field(default_factory=dict)  # seconds: encode, ann, rerank, total
    cached: bool = False  # the query embedding came from the service's cache (encode 0 for this query)


# ------------------------------------------------------------------------------------------ helpers
def resolve_precision(precision: str, device: torch.device | str) -> str:
    """'auto' -> AUTO_PRECISION for the device type (fp32 on CPU and CUDA, as measured); fp16 only on CUDA."""
    dev = torch.device(device)
    if precision == "auto":
        return AUTO_PRECISION.get(dev.type, "fp32")
    if precision == "fp16" and dev.type != "cuda":
        raise ValueError("fp16 is only supported on CUDA; use bf16 or fp32 on CPU")
    return precision


def resolve_rerank_impl(impl: str, device: torch.device | str) -> str:
    """'auto' -> AUTO_RERANK_IMPL for the device type (fold on CPU, fused on CUDA); other names as given."""
    if impl not in RERANK_IMPLS:
        raise ValueError(f"rerank impl must be one of {RERANK_IMPLS}, got {impl!r}")
    if impl == "auto":
        return AUTO_RERANK_IMPL.get(torch.device(device).type, "fold")
    return impl


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trim_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Drop the padding columns after the longest text of the batch.

    CLIP's text transformer is causal and t is read at the EOT token, so nothing after a text's EOT can
    change its embedding (gare.backbone.encode_text_tokens makes the same argument for L < 77):
    a 10-word query then costs ~14 token positions instead of max_words (32).
    """
    nonzero = (tokens != 0).any(dim=0)
    if not bool(nonzero.any()):
        return tokens
    last = int(torch.nonzero(nonzero).max()) + 1
    return tokens[:, :last]


def encode_queries(
    model: Any,
    texts: Sequence[str],
    precision: str = "fp32",
    *,
    trim: bool = True,
    tower: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Texts -> t (a, d) float32 on the model's device (un-normalised: psi needs |t|).

    Batch-invariant: a text's embedding is the same bits alone or in any batch (issue 24; the scheme is in
    gare.text_quant's docstring), so the service's micro-batches, its query cache and this offline path
    agree. `tower`: a gare.text_quant encoder (int8, onnx, fp16, ...: batch-invariant themselves) instead
    of the model's own encoder, which runs each text alone at its own length under `precision`'s autocast.
    `trim=False` (the model's own encoder only): the whole batch in one call at the full context length,
    what training computes; not batch-invariant, a reference for comparisons.
    """
    if not texts:
        return torch.zeros(0, model.cfg.embed_dim, device=model.device)
    tokens = model.tokenize(list(texts))
    if tower is not None:
        return tower(tokens).to(model.device).float()
    with torch.inference_mode(), autocast(model.device, precision):
        t = encode_each(model.encode_text, tokens) if trim else model.encode_text(tokens)
    return t.float()


def unit_rows(t: torch.Tensor | np.ndarray) -> np.ndarray:
    x = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    x = x.astype(np.float32, copy=False)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def ann_stage(version: Any, units: np.ndarray, candidates: int, *, ncl_stage1: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Stage 1 through :meth:`IndexVersion.search`: (cosines (q, K), ids (q, K)); missing results have id -1.

    ``ncl_stage1=True`` picks the candidates by cos + b (the NCL fold); the scores are still the cosines."""
    return version.search(units, int(candidates), ncl_stage1=ncl_stage1)


def _gather(version: Any, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows (may repeat) -> (inverse into the unique rows, frames fp16, masks, vbar f32 of the unique rows).

    Reading the unique rows in ascending order is what a memmap likes, and a video shared by several
    queries of a batch is read once."""
    uniq, inv = np.unique(rows, return_inverse=True)
    frames = np.asarray(version.frames[uniq])
    masks = np.asarray(version.masks[uniq])
    vbar = np.asarray(version.units[uniq], dtype=np.float32) * np.asarray(version.norms[uniq], dtype=np.float32)[:, None]
    return inv.reshape(-1), frames, masks, vbar


# ------------------------------------------------------------------------------------------ psi stage
class _FoldedPsi:
    """psi's attention weights folded for the query-side computation (see the module docstring).

    W_qk[h] = W_k,hᵀ W_q,h and b_qk[h] = W_k,hᵀ b_q,h turn the gap h into the vector that is dotted
    with the normalised frames; W_ov[h] = W_o[:, h] W_v,h and b_ov = W_o b_v + b_o map the attention-
    weighted mean frame straight to psi's attention output. Two d x d products per pair instead of
    four, and none per frame.
    """

    def __init__(self, psi: Any) -> None:
        d, H = psi.dim, psi.heads
        hd = d // H
        with torch.no_grad():
            wq = psi.q.weight.detach().float().view(H, hd, d)
            wk = psi.k.weight.detach().float().view(H, hd, d)
            wv = psi.v.weight.detach().float().view(H, hd, d)
            wo = psi.o.weight.detach().float().view(d, H, hd)
            self.w_qk = torch.einsum("hed,hec->hdc", wk, wq).reshape(H * d, d).contiguous()  # (H·d, d)
            self.b_qk = torch.einsum("hed,he->hd", wk, psi.q.bias.detach().float().view(H, hd)).reshape(H * d).contiguous()
            self.w_ov = torch.einsum("ohe,hed->ohd", wo, wv).reshape(d, H * d).contiguous()  # (d, H·d)
            self.b_ov = (psi.o.weight.detach().float() @ psi.v.bias.detach().float() + psi.o.bias.detach().float()).contiguous()
        self.key = _psi_key(psi)


def _psi_key(psi: Any) -> tuple:
    return tuple((p.data_ptr(), p._version, p.device) for p in (psi.q.weight, psi.q.bias, psi.k.weight, psi.v.weight,
                                                                psi.v.bias, psi.o.weight, psi.o.bias))


_FOLDED: dict[int, _FoldedPsi] = {}


def folded_psi(psi: Any) -> _FoldedPsi:
    """The folded weights of this psi, recomputed whenever its parameters change."""
    f = _FOLDED.get(id(psi))
    if f is None or f.key != _psi_key(psi):
        f = _FOLDED[id(psi)] = _FoldedPsi(psi)
        if len(_FOLDED) > 16:
            _FOLDED.pop(next(iter(_FOLDED)))
    return f


def fused_pair_scores(
    model: Any, t: torch.Tensor, frames: torch.Tensor, mask: torch.Tensor | None, vbar: torch.Tensor
) -> torch.Tensor:
    """s (P,) for P (text, video) pairs: t (P, d), frames (P, f, d), mask (P, f), vbar (P, d); float32.

    Equal to ``model.score`` on each pair (see the module docstring for the algebra). With
    ``model.cfg.reference_padding`` (imported checkpoints) psi attends over every row, padded ones too, as
    the authors' code does (their features and the all-rows v̄ are what the index stores for such models);
    the pooling masks padded rows either way.
    """
    psi = model.psi
    P, d = t.shape
    H = psi.heads
    hd = d // H
    fw = folded_psi(psi)
    h = psi.ln1(vbar - t)  # the semantic gap v̄ - t
    qk = torch.addmm(fw.b_qk, h, fw.w_qk.t()).view(P, H, d)  # W_kᵀ (W_q h + b_q); the q·b_k term is constant
    c = psi.ln1(frames)  # (P, f, d)
    logits = torch.einsum("phd,pfd->phf", qk, c) / math.sqrt(hd)
    if mask is not None and not getattr(model.cfg, "reference_padding", False):
        logits = logits.masked_fill(~mask.bool()[:, None, :], float("-inf"))
    w = logits.softmax(dim=-1)
    cbar = torch.einsum("phf,pfd->phd", w, c)  # attention-weighted mean of the normalised frames
    x = psi.ln2(torch.addmm(fw.b_ov, cbar.reshape(P, H * d), fw.w_ov.t()))
    x = psi.ln3(x + psi.drop(psi.ffn(x)))
    delta = psi.mu(x)
    # text-conditioned pooling p = Σ_f softmax_f(t·F_f / temp) F_f over the real frames
    pl = torch.einsum("pd,pfd->pf", t, frames) / model.cfg.temp
    if mask is not None:
        pl = pl.masked_fill(~mask.bool(), float("-inf"))
    p = torch.einsum("pf,pfd->pd", pl.softmax(dim=-1), frames)
    return F.cosine_similarity(t + delta, p, dim=-1, eps=1e-8)


def psi_scores(
    model: Any,
    version: Any,
    t: torch.Tensor,
    cand_ids: np.ndarray | Sequence[np.ndarray],
    *,
    impl: str = DEFAULT_RERANK_IMPL,
) -> list[np.ndarray]:
    """psi scores s_tj for each query's candidates: t (a, d); cand_ids[i] (K_i,) valid ids -> list of (K_i,)."""
    impl = resolve_rerank_impl(impl, t.device)
    lists = [np.asarray(c, dtype=np.int64).reshape(-1) for c in cand_ids]
    sizes = [c.size for c in lists]
    offs = np.cumsum([0] + sizes)
    if offs[-1] == 0:
        return [np.zeros(0, np.float32) for _ in lists]
    rows = version.rows(np.concatenate(lists))
    if impl == "fold" and not fold_usable(model, version):
        impl = "fused"
    with torch.inference_mode():
        if impl == "fold":
            flat = _psi_scores_fold(model, version, t, rows, sizes)
            return [flat[a:b] for a, b in zip(offs[:-1], offs[1:], strict=True)]
        if impl == "model":
            return _psi_scores_model(model, version, t, rows, offs)
        flat = _psi_scores_fused(model, version, t, rows, np.repeat(np.arange(len(lists)), sizes))
    return [flat[a:b] for a, b in zip(offs[:-1], offs[1:], strict=True)]


_WARNED: set[tuple[str, str]] = set()


def fold_usable(model: Any, version: Any) -> bool:
    """Whether `version` stores psi constants valid for model.psi; logs one WARNING per version when not."""
    fold = psi_consts.fold_of(model)
    why = psi_consts.fold_status(version, fold)
    if why is None:
        return True
    key = (str(getattr(version, "path", version.name)), fold.fingerprint)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("psi rerank: %s; using the fused path for this version (same scores, slower)", why)
    return False


def warm_up_rerank(impl: str, device: torch.device | str) -> None:
    """Compile the CPU kernel of the folded rerank (a few seconds, once per process) when `impl` on `device`
    will use it, so that no request pays for it."""
    if impl == "fold" and torch.device(device).type == "cpu" and psi_fold_cpu.available():
        psi_fold_cpu.warm_up()


def _kernel_reads(version: Any) -> bool:
    """Whether the CPU kernel can read this version's arrays as stored (float16/float32 frames and
    constants, float32 units and norms) and numba is importable."""
    ok = (np.float16, np.float32)
    return (version.frames.dtype in ok and version.psi_consts.dtype in ok and version.units.dtype == np.float32
            and np.asarray(version.norms).dtype == np.float32 and psi_fold_cpu.available())


def _padded(ids: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Flat per-query ids (the queries' runs of `sizes`) -> (len(sizes), max K) int64, each row padded with its
    first id (a valid row; the pads' scores are dropped by `_unpad`)."""
    out = np.zeros((len(sizes), max(sizes, default=0)), dtype=np.int64)
    offs = np.cumsum([0] + sizes)
    for i, (a, b) in enumerate(zip(offs[:-1], offs[1:], strict=True)):
        out[i, : b - a] = ids[a:b]
        out[i, b - a :] = ids[a] if b > a else 0
    return out


def _unpad(s: np.ndarray, sizes: list[int]) -> np.ndarray:
    return np.concatenate([s[i, :k] for i, k in enumerate(sizes)]) if len(sizes) > 1 else s[0, : sizes[0]].copy()


def _psi_scores_fold(model: Any, version: Any, t: torch.Tensor, rows: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Folded psi for the pairs (query i, rows of its candidates), flat in the callers' order.

    On the CPU the compiled kernel reads each candidate's rows straight from the memory-mapped arrays. Elsewhere
    the batch's candidate rows are read once, ascending (memmap friendly), into one VideoConstants that every
    query shares; each query's candidates are ids into it. Either way K is padded to the batch's largest."""
    dev = t.device
    fold = psi_consts.fold_of(model)
    q = pfq.fold_queries(t, fold, model.cfg.temp)
    if dev.type == "cpu" and _kernel_reads(version):
        s = psi_fold_cpu.pair_scores(q, version.frames, version.psi_consts, _padded(rows, sizes), vrows=version.units,
                                     vscale=version.norms)
        return _unpad(s, sizes)
    uniq, inv = np.unique(rows, return_inverse=True)
    v = psi_consts.gather(version, uniq, fold, dev)
    s = pf.pair_scores(q, v, torch.from_numpy(_padded(inv.reshape(-1), sizes)).to(dev)).cpu().numpy()
    return _unpad(s, sizes)


def rerank_scores(impl: str, model: Any, t: torch.Tensor, frames: torch.Tensor, mask: torch.Tensor | None, **kw: Any) -> torch.Tensor:
    """gare.psi_fold.rerank_scores ("fold", "model") plus this module's "fused" path, for P pairs (v̄ = the
    masked mean of `frames` on every path)."""
    impl = resolve_rerank_impl(impl, t.device)
    if impl != "fused":
        return pf.rerank_scores(impl, model, t, frames, mask, **kw)
    from gare.psi import masked_mean

    with torch.inference_mode():
        fr = frames.to(t.device, torch.float32)
        mk = None if mask is None else mask.to(t.device)
        return fused_pair_scores(model, t.float(), fr, mk, masked_mean(fr, mk))


def _psi_scores_model(model: Any, version: Any, t: torch.Tensor, rows: np.ndarray, offs: np.ndarray) -> list[np.ndarray]:
    """model.score per query (a video shared by several queries of a batch is read once)."""
    dev = t.device
    inv, frames_np, masks_np, vbar_np = _gather(version, rows)
    frames = torch.from_numpy(frames_np).to(dev)
    masks = torch.from_numpy(masks_np).to(dev)
    vbar = torch.from_numpy(vbar_np).to(dev)
    kv_src = version.kv if hasattr(version, "kv") else None
    out = []
    for i, (s0, s1) in enumerate(zip(offs[:-1], offs[1:], strict=True)):
        if s1 == s0:
            out.append(np.zeros(0, np.float32))
            continue
        sel = torch.from_numpy(inv[s0:s1]).to(dev)
        kv = None
        if kv_src is not None:
            r = rows[s0:s1]
            kv = (torch.from_numpy(np.asarray(kv_src[0][r])), torch.from_numpy(np.asarray(kv_src[1][r])))
        s = model.score(t[i : i + 1], frames[sel], masks[sel], vbar=vbar[sel], kv=kv, block_videos=max(128, s1 - s0))
        out.append(s[0].float().cpu().numpy())
    return out


def _psi_scores_fused(model: Any, version: Any, t: torch.Tensor, rows: np.ndarray, pair_q: np.ndarray) -> np.ndarray:
    """Scores of the pairs (t[pair_q[p]], video at rows[p]), in chunks of _PAIR_CHUNK pairs.

    Pairs are processed in ascending row order (sequential memmap reads, one copy per chunk) and the
    scores are put back in the callers' order.
    """
    dev = t.device
    order = np.argsort(rows, kind="stable")
    srows = rows[order]
    spair_q = torch.from_numpy(pair_q[order]).to(dev)
    scores = torch.empty(rows.shape[0], dtype=torch.float32)
    norms = version.norms
    for s0 in range(0, rows.shape[0], _PAIR_CHUNK):
        s1 = min(rows.shape[0], s0 + _PAIR_CHUNK)
        r = srows[s0:s1]
        fr = torch.from_numpy(np.asarray(version.frames[r])).to(dev).to(torch.float32)
        mk = torch.from_numpy(np.asarray(version.masks[r])).to(dev)
        vb = torch.from_numpy(np.asarray(version.units[r], dtype=np.float32) * np.asarray(norms[r], dtype=np.float32)[:, None]).to(dev)
        tq = t.index_select(0, spair_q[s0:s1]).float()
        scores[s0:s1] = fused_pair_scores(model, tq, fr, mk, vb).cpu()
    out = np.empty(rows.shape[0], dtype=np.float32)
    out[order] = scores.numpy()
    return out


def exhaustive_psi(model: Any, version: Any, t: torch.Tensor, *, block: int = 8192, impl: str = "fold",
                   progress: bool = False) -> np.ndarray:
    """psi scores of every gallery entry for each query (a, n), block by block (coverage, benchmarks, compare).

    impl "fold" (default, and what "auto" means here on every device: a whole gallery is one large product per
    block): the index's stored constants when valid, else the fold computed block by block (one log line);
    "fused": the fused pair path, query by query (the old reference)."""
    if impl == "auto":
        impl = "fold"
    n = version.n
    a = t.shape[0]
    out = np.empty((a, n), dtype=np.float32)
    dev = t.device
    if impl == "fold":
        fold = psi_consts.fold_of(model)
        why = psi_consts.fold_status(version, fold)
        if why is not None:
            log.info("exhaustive psi: %s; folding the constants block by block instead", why)
        q = pfq.fold_queries(t, fold, model.cfg.temp)
        starts = range(0, n, block)
        if progress:
            from tqdm import tqdm

            starts = tqdm(starts, desc="exhaustive psi (fold)", unit="block")
        with torch.inference_mode():
            for s0 in starts:
                v = psi_consts.block(version, s0, min(n, s0 + block), fold, dev, stored=why is None,
                                     reference_padding=psi_consts.reference_padding(model))
                out[:, s0 : s0 + v.n] = pf.exhaustive(q, v, device=dev).numpy()
        return out
    if impl != "fused":
        raise ValueError(f"exhaustive psi impl must be 'fold' or 'fused', got {impl!r}")
    with torch.inference_mode():
        for s0 in range(0, n, block):
            s1 = min(n, s0 + block)
            fr = torch.from_numpy(np.array(version.frames[s0:s1])).to(dev).float()
            mk = torch.from_numpy(np.array(version.masks[s0:s1])).to(dev)
            vb = torch.from_numpy(
                np.asarray(version.units[s0:s1], dtype=np.float32) * np.asarray(version.norms[s0:s1], dtype=np.float32)[:, None]
            ).to(dev)
            for i in range(a):
                ti = t[i : i + 1].float().expand(s1 - s0, -1)
                out[i, s0:s1] = fused_pair_scores(model, ti, fr, mk, vb).cpu().numpy()
    return out


# ------------------------------------------------------------------------------------------ ranking
def rank(
    ann_scores: np.ndarray,
    ids: np.ndarray,
    psi: np.ndarray | None,
    biases: np.ndarray,
    opts: SearchOptions,
) -> list[Hit]:
    """Final scores for one query's valid candidates; sorted by score desc, then id asc; top k."""
    base = ann_scores if psi is None else psi
    final = base + biases if opts.ncl else base.copy()
    order = np.lexsort((ids, -final))[: opts.k]
    return [
        Hit(
            id=int(ids[j]),
            score=float(final[j]),
            ann_score=float(ann_scores[j]),
            psi_score=None if psi is None else float(psi[j]),
            bias=float(biases[j]),
        )
        for j in order
    ]


def search_batch(
    model: Any,
    version: Any,
    texts: Sequence[str],
    options: SearchOptions | Sequence[SearchOptions] = SearchOptions(),
    *,
    precision: str = "fp32",
    rerank_impl: str = DEFAULT_RERANK_IMPL,
    on_units: Any = None,
    encoder: Callable[[list[str]], torch.Tensor] | None = None,
    tower: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[QueryResult]:
    """Search many queries with one text-encoder pass, one ANN call per distinct K and one rerank pass.

    Every result carries the batch's stage timings (seconds). `on_units`, when given, receives the unit
    query embeddings (n_q, d) as a float32 array (the service's adaptive query bank). `tower` chooses the
    text tower: a gare.text_quant encoder (``build_text_encoder(model, kind)``, what the service's
    `text_encoder` setting builds), None = the model's own at `precision`. `encoder`, when given, replaces
    ``encode_queries(model, texts, precision, tower=tower)``: texts -> t (n_q, d) float32 on the model's
    device (the service's query-embedding cache in front of that same call).
    """
    n_q = len(texts)
    opts = [options] * n_q if isinstance(options, SearchOptions) else list(options)
    if len(opts) != n_q:
        raise ValueError(f"{n_q} queries but {len(opts)} option sets")
    if n_q == 0:
        return []
    dev = model.device
    t0 = time.perf_counter()
    t = encoder(list(texts)) if encoder is not None else encode_queries(model, texts, precision, tower=tower)
    t = t.to(dev)
    _sync(dev)
    t1 = time.perf_counter()
    units = unit_rows(t)
    if on_units is not None:
        on_units(units.copy())

    ann_s: list[np.ndarray] = [np.zeros(0, np.float32)] * n_q
    ann_i: list[np.ndarray] = [np.zeros(0, np.int64)] * n_q
    by_k: dict[tuple[int, bool], list[int]] = {}
    for i, o in enumerate(opts):
        by_k.setdefault((o.candidates, o.ncl_stage1), []).append(i)
    for (K, folded), members in by_k.items():
        sc, ids = ann_stage(version, units[members], K, ncl_stage1=folded)
        for r, i in enumerate(members):
            ok = ids[r] >= 0
            ann_s[i], ann_i[i] = sc[r][ok], ids[r][ok]
    t2 = time.perf_counter()

    need = [i for i, o in enumerate(opts) if o.rerank]
    psi: list[np.ndarray | None] = [None] * n_q
    if need:
        got = psi_scores(model, version, t[need], [ann_i[i] for i in need], impl=rerank_impl)
        for i, s in zip(need, got, strict=True):
            psi[i] = s
    _sync(dev)
    t3 = time.perf_counter()

    biases = np.asarray(version.biases, dtype=np.float32)
    results = []
    for i, o in enumerate(opts):
        b = biases[version.rows(ann_i[i])] if ann_i[i].size else np.zeros(0, np.float32)
        hits = rank(ann_s[i], ann_i[i], psi[i], b, o)
        results.append(QueryResult(hits, {}))
    t4 = time.perf_counter()
    timings = {"encode": t1 - t0, "ann": t2 - t1, "rerank": t3 - t2, "rank": t4 - t3, "total": t4 - t0}
    for r in results:
        r.timings = dict(timings)
    return results


def search(
    model: Any,
    version: Any,
    query: str,
    options: SearchOptions = SearchOptions(),
    *,
    precision: str = "fp32",
    rerank_impl: str = DEFAULT_RERANK_IMPL,
    tower: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> QueryResult:
    """The offline search of one query (what the API must return for the same index, options and text tower:
    `tower` as in :func:`search_batch`, e.g. ``build_text_encoder(model, "int8")`` for a service on int8)."""
    return search_batch(model, version, [query], options, precision=precision, rerank_impl=rerank_impl, tower=tower)[0]


__all__ = [
    "RERANK_IMPLS", "DEFAULT_RERANK_IMPL", "AUTO_RERANK_IMPL", "AUTO_PRECISION", "resolve_rerank_impl", "DEFAULT_CANDIDATES", "fold_usable", "rerank_scores", "Stage1Unavailable", "SearchOptions", "Hit", "QueryResult", "resolve_precision", "trim_tokens",
    "encode_queries", "unit_rows", "ann_stage", "warm_up_rerank", "folded_psi", "fused_pair_scores", "psi_scores", "exhaustive_psi",
    "rank", "search_batch", "search",
]
