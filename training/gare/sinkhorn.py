"""NCL-style Sinkhorn-Knopp instance biases in dense form (SPEC section 5), the NCL normalisation diagnostics
and the bias fold of stage 1. The sparse form over stage-1 candidates is :mod:`gare.sinkhorn_sparse`.

Light module: numpy + torch only.

Conventions (NCL, Park et al. 2022, eqs. 5-13 and Fig. 4)
--------------------------------------------------------
* ``S = queries @ gallery.T`` is the dual-tower cosine (Q queries x N gallery items); ``gamma`` is the
  softmax temperature (``1 / exp(logit_scale)``).
* ``M = exp(S / gamma)``; ``beta = 1 / M.sum(0)``; ``n_iters`` times: ``alpha = 1 / (M beta)``,
  ``beta = 1 / (alpha^T M)``; ``alpha`` and ``beta`` are normalised to sum 1; the text biases are
  ``a = gamma log alpha`` and the video biases ``b = gamma log beta``.  Adjusted score:
  ``s*_ij = a_i + b_j + S_ij``; for text-to-video ranking only ``b`` matters.
* Summed retrieval probabilities.  ``P(v_j | t_i) = softmax_j((S_ij + b_j) / gamma)``.  Each query's row sums
  to 1, so ``sum_j sum_i P(v_j | t_i) = Q`` *exactly*, and the mean over videos of the per-video sum is
  ``Q / N``.  NCL's eq. 13 ("every video's summed probability is 1") is stated for a square problem
  (Q = N, one caption per video, Appendix A).  With a query queue of Q != N texts, the Sinkhorn fixed point
  makes every per-video sum equal to ``Q / N`` instead.  **Convention used here:** the per-video sums are
  reported rescaled by ``N / Q``, i.e. ``r_j = (N / Q) * sum_i P(v_j | t_i)``.  Then ``mean_j r_j == 1``
  always, ``r_j ~= 1`` for every j after the Sinkhorn biases (eq. 13), and for Q = N this is exactly the
  paper's quantity.  (The sum-to-one normalisation of ``alpha``/``beta`` only shifts every ``b_j`` by the
  same constant, which cancels in the softmax, so it does not change ``r``.)
* Normalisation error (eq. 5): ``mean_j |1 - r_j|``; for Q = N it is the paper's definition verbatim, for
  Q != N the target of the raw sum is ``Q / N`` (the only value the sums can average to).

Numerics.  With gamma = 0.01, ``exp(S / gamma)`` overflows float32 once a cosine exceeds ~0.887, so
:func:`sinkhorn_biases` works in the log domain (``log alpha = -logsumexp_j(S_ij / gamma + log beta_j)``
etc.), and in gallery chunks so the Q x N matrix never exists: each pass recomputes ``S`` chunk by chunk
with a float32 matmul; the logsumexp of a chunk is float32 and the running accumulators (log alpha, log
beta) are float64.  One pass per iteration: the chunk that updates ``log beta`` also feeds the running
row-logsumexp of the next ``log alpha``, so ``n_iters + 1`` matmul passes are made in total.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "sinkhorn_biases_naive",
    "sinkhorn_biases",
    "summed_retrieval_probabilities",
    "normalization_error",
    "served_score_matrix",
    "sinkhorn_biases_dense",
]

# Cap on the elements of one (Q x chunk) float32 block: ~1 GiB per temporary.  The effective chunk is
# min(chunk, block_elems // Q) so a 16k-query queue does not allocate 4 GiB blocks on a CPU host.
DEFAULT_BLOCK_ELEMS = 1 << 28


def sinkhorn_biases_naive(S: Tensor, gamma: float, n_iters: int = 4) -> tuple[Tensor, Tensor]:
    """Direct float64 transcription of NCL Fig. 4 (test reference; materialises ``exp(S / gamma)``).

    ``S`` is (Q, N) similarities (cosines).  Returns ``(a (Q,), b (N,))`` in float64 on S's device.
    Overflows for ``max(S) / gamma > ~709`` (float64); use :func:`sinkhorn_biases` for real data.
    """
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    S = torch.as_tensor(S).to(torch.float64)
    M = torch.exp(S / gamma)
    beta = 1.0 / M.sum(0)
    alpha = torch.ones(S.shape[0], dtype=torch.float64, device=S.device)
    for _ in range(n_iters):
        alpha = 1.0 / (M @ beta)
        beta = 1.0 / (alpha @ M)
    alpha = alpha / alpha.sum()
    beta = beta / beta.sum()
    return gamma * torch.log(alpha), gamma * torch.log(beta)


def as_tensor(x, device: torch.device | None = None) -> Tensor:
    # numpy (possibly a read-only memmap slice): copy, which also avoids the non-writable-array warning
    t = x if isinstance(x, Tensor) else torch.tensor(x)
    if device is not None and t.device != device:
        t = t.to(device, non_blocking=True)
    return t


def chunk_ranges(n: int, chunk: int) -> Iterator[tuple[int, int]]:
    for s in range(0, n, chunk):
        yield s, min(n, s + chunk)


def effective_chunk(chunk: int, n_queries: int, block_elems: int | None) -> int:
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if block_elems is not None and n_queries > 0:
        chunk = min(chunk, max(1, block_elems // n_queries))
    return chunk


def check_inputs(queries, gallery, gamma: float) -> None:
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    if queries.ndim != 2 or gallery.ndim != 2:
        raise ValueError(
            f"queries and gallery must be 2-D, got {tuple(queries.shape)} and {tuple(gallery.shape)}"
        )
    if queries.shape[1] != gallery.shape[1]:
        raise ValueError(f"dimension mismatch: queries d={queries.shape[1]}, gallery d={gallery.shape[1]}")
    if queries.shape[0] == 0:
        raise ValueError("at least one query is needed")


def with_progress(it, enabled: bool, total: int, desc: str):
    if not enabled:
        return it
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency, but stay light
        return it
    return tqdm(it, total=total, desc=desc)


@torch.no_grad()
def sinkhorn_biases(
    queries: Tensor,
    gallery: Tensor,
    gamma: float,
    n_iters: int = 4,
    *,
    chunk: int = 65536,
    device: torch.device | str | None = None,
    progress: bool = False,
    block_elems: int | None = DEFAULT_BLOCK_ELEMS,
) -> tuple[Tensor, Tensor]:
    """Log-domain, gallery-chunked Sinkhorn-Knopp biases of NCL (same iterates as the naive Fig. 4).

    ``queries`` (Q, d) and ``gallery`` (N, d) are already unit-normalised by the caller (``S = q @ g.T`` is the
    cosine; the maths does not require unit norm).  Both may be tensors or numpy arrays (a memmapped gallery
    is read chunk by chunk).  ``device`` defaults to the queries' device; gallery chunks are moved there.
    ``chunk`` is the number of gallery columns per block, further capped so a block has at most
    ``block_elems`` elements (None: no cap).  Returns ``(a (Q,), b (N,))`` float32 on CPU.
    """
    if n_iters < 1:
        raise ValueError(f"n_iters must be >= 1, got {n_iters}")
    check_inputs(queries, gallery, gamma)
    q_t = as_tensor(queries)
    dev = torch.device(device) if device is not None else q_t.device
    q = q_t.to(dev, torch.float32)
    n_q, n = q.shape[0], gallery.shape[0]
    if n == 0:
        return torch.zeros(n_q, dtype=torch.float32), torch.zeros(0, dtype=torch.float32)
    ch = effective_chunk(chunk, n_q, block_elems)
    inv_g = 1.0 / gamma

    def block(s: int, e: int) -> Tensor:  # (Q, e - s) float32 logits S / gamma
        g = as_tensor(gallery[s:e], dev).to(torch.float32)
        return (q @ g.T) * inv_g

    return sinkhorn_blocks(block, n_q, n, gamma, n_iters, ch, dev, progress)


def sinkhorn_blocks(
    block: Callable[[int, int], Tensor], n_q: int, n: int, gamma: float, n_iters: int, ch: int,
    dev: torch.device, progress: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-domain Fig. 4 over a (n_q, n) logit matrix ``S / gamma`` given column block by column block.

    ``block(s, e)`` returns the float32 logits of columns s..e (n_q, e - s); entries of -inf are absent
    (M_ij = 0).  A column with no finite entry has ``beta = 1 / 0``: its log beta is +inf here and the
    caller decides what it means (see :func:`gare.sinkhorn_sparse.sinkhorn_biases_sparse`).  ``n_iters + 1`` passes over the
    blocks; returns ``(a (n_q,), b (n,))`` float32 on CPU (un-normalised when a column is empty).
    """
    log_beta = torch.empty(n, dtype=torch.float64, device=dev)
    neg_inf = torch.full((n_q,), -math.inf, dtype=torch.float64, device=dev)
    # Pass 0: beta = 1 / M.sum(0); also accumulate the row logsumexp for the first alpha.
    acc = neg_inf.clone()
    n_chunks = (n + ch - 1) // ch
    for s, e in with_progress(chunk_ranges(n, ch), progress, n_chunks, "sinkhorn init"):
        L = block(s, e)
        lb = -torch.logsumexp(L, dim=0)
        log_beta[s:e] = lb.double()
        acc = torch.logaddexp(acc, _row_lse(L, lb))
    log_alpha = -acc
    for it in range(n_iters):
        last = it == n_iters - 1
        la32 = drop_empty(log_alpha).float()  # a query with no entry (alpha = 1 / 0) weighs nothing
        acc = neg_inf.clone()
        for s, e in with_progress(chunk_ranges(n, ch), progress, n_chunks, f"sinkhorn {it + 1}/{n_iters}"):
            L = block(s, e)
            # beta = 1 / (alpha^T M) on this chunk's columns
            lb = -torch.logsumexp(L + la32[:, None], dim=0)
            log_beta[s:e] = lb.double()
            if not last:  # running row logsumexp for the next alpha = 1 / (M beta)
                acc = torch.logaddexp(acc, _row_lse(L, lb))
        if not last:
            log_alpha = -acc
    return biases_from_logs(log_alpha, log_beta, gamma)


def drop_empty(x: Tensor) -> Tensor:
    """+inf (1 / an empty sum) -> -inf, so that the entry drops out of the next logsumexp instead of giving nan."""
    return torch.where(torch.isinf(x) & (x > 0), torch.full_like(x, -math.inf), x)


def _row_lse(L: Tensor, lb: Tensor) -> Tensor:
    """Row logsumexp of L + lb (float64); empty columns (lb = +inf, every entry -inf) contribute nothing."""
    return torch.logsumexp(L + drop_empty(lb)[None, :], dim=1).double()


def biases_from_logs(log_alpha: Tensor, log_beta: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    ok_a, ok_b = torch.isfinite(log_alpha), torch.isfinite(log_beta)
    if bool(ok_a.any()):
        log_alpha = log_alpha - torch.logsumexp(log_alpha[ok_a], dim=0)
    if bool(ok_b.any()):
        log_beta = log_beta - torch.logsumexp(log_beta[ok_b], dim=0)
    return (gamma * log_alpha).float().cpu(), (gamma * log_beta).float().cpu()


@torch.no_grad()
def _summed_probs_raw(queries, gallery, gamma: float, b, chunk: int, block_elems: int | None) -> Tensor:
    """sum_i softmax_j((S_ij + b_j) / gamma) per gallery item j, float64 on CPU (two chunked passes)."""
    check_inputs(queries, gallery, gamma)
    q = as_tensor(queries).to(torch.float32)
    dev = q.device
    n_q, n = q.shape[0], gallery.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.float64)
    if b is not None:
        b = as_tensor(b, dev).to(torch.float32).reshape(-1)
        if b.shape[0] != n:
            raise ValueError(f"b has {b.shape[0]} entries for a gallery of {n}")
    ch = effective_chunk(chunk, n_q, block_elems)
    inv_g = 1.0 / gamma

    def block(s: int, e: int) -> Tensor:
        g = as_tensor(gallery[s:e], dev).to(torch.float32)
        L = q @ g.T
        if b is not None:
            L = L + b[s:e][None, :]
        return L * inv_g

    log_z = torch.full((n_q,), -math.inf, dtype=torch.float64, device=dev)
    for s, e in chunk_ranges(n, ch):
        log_z = torch.logaddexp(log_z, torch.logsumexp(block(s, e), dim=1).double())
    lz32 = log_z.float()
    out = torch.empty(n, dtype=torch.float64)
    for s, e in chunk_ranges(n, ch):
        out[s:e] = torch.exp(block(s, e) - lz32[:, None]).double().sum(0).cpu()
    return out


def summed_retrieval_probabilities(
    queries: Tensor,
    gallery: Tensor,
    gamma: float,
    b: Tensor | None = None,
    *,
    chunk: int = 65536,
    rescale: bool = True,
    block_elems: int | None = DEFAULT_BLOCK_ELEMS,
) -> Tensor:
    """Per gallery video, the text-to-video retrieval probabilities summed over the queries (NCL eq. 13).

    ``P(v_j | t_i) = softmax_j((q_i . g_j + b_j) / gamma)``.  With ``rescale=True`` (default) the sums are
    multiplied by ``N / Q`` so that their mean is exactly 1 and, after the Sinkhorn biases, every entry is
    ~1 (for Q = N this is the paper's quantity unchanged).  ``rescale=False`` returns the raw sums, whose
    mean is ``Q / N``.  Returns a float64 (N,) CPU tensor.
    """
    raw = _summed_probs_raw(queries, gallery, gamma, b, chunk, block_elems)
    if rescale:
        raw = raw * (gallery.shape[0] / queries.shape[0])
    return raw


def normalization_error(
    queries: Tensor,
    gallery: Tensor,
    gamma: float,
    b: Tensor | None = None,
    *,
    chunk: int = 65536,
    block_elems: int | None = DEFAULT_BLOCK_ELEMS,
) -> float:
    """NCL eq. 5 text-to-video normalisation error ``mean_j |1 - r_j|``.

    ``r_j = (N / Q) sum_i P(v_j | t_i)`` (see :func:`summed_retrieval_probabilities`): for Q = N this is the
    paper's ``E_j |1 - sum_i P_t2v(v_j | t_i)|`` verbatim; for Q != N the raw sums are compared with their
    only attainable common value ``Q / N`` (equivalently: the error is measured relative to the target).
    0 means every video is equally represented; the video-to-text error is obtained by swapping roles.
    """
    r = summed_retrieval_probabilities(queries, gallery, gamma, b, chunk=chunk, block_elems=block_elems)
    if r.numel() == 0:
        return 0.0
    return float(torch.mean(torch.abs(1.0 - r)))


# ---------------------------------------------------------------- biases of the served score
# The service ranks by the psi score s_tj on each query's stage-1 candidates (SPEC §4), so the biases must
# normalise *that* score (SPEC §5); biases fitted to the dual-tower cosine and added to psi were measured to
# lower R@1 (bench/results/ncl_served/).  The scorer is a callable so that any exact psi implementation plugs in (the
# model's block scorer, the fused pair scorer of the search, a folded psi).

MatrixScorer = Callable[[np.ndarray, np.ndarray], Tensor]
"""``scorer(query_idx (a,), gallery_rows (b,)) -> (a, b)`` served scores (float; any device)."""

_DEFAULT_DENSE_ELEMS = 1 << 28  # a dense (Q, N) float32 served matrix of at most 1 GiB


@torch.no_grad()
def served_score_matrix(scorer: MatrixScorer, n_queries: int, n_gallery: int, *, chunk: int = 1024,
                        max_elems: int | None = _DEFAULT_DENSE_ELEMS, progress: bool = False) -> Tensor:
    """The dense (Q, N) float32 CPU matrix of served scores, scored gallery block by gallery block.

    Refuses (ValueError) when Q x N exceeds ``max_elems``: use :func:`gare.sinkhorn_sparse.sinkhorn_biases_sparse` there."""
    if max_elems is not None and n_queries * n_gallery > max_elems:
        raise ValueError(f"a dense {n_queries} x {n_gallery} served-score matrix exceeds max_elems={max_elems}; "
                         "use the sparse form (gare.sinkhorn_sparse.sinkhorn_biases_sparse)")
    S = torch.empty(n_queries, n_gallery, dtype=torch.float32)
    qi = np.arange(n_queries)
    n_chunks = (n_gallery + chunk - 1) // max(chunk, 1)
    for s, e in with_progress(chunk_ranges(n_gallery, chunk), progress, n_chunks, "served scores"):
        blk = torch.as_tensor(scorer(qi, np.arange(s, e))).float().cpu()
        if blk.shape != (n_queries, e - s):
            raise ValueError(f"scorer returned shape {tuple(blk.shape)} for a ({n_queries}, {e - s}) block")
        S[:, s:e] = blk
    return S


@torch.no_grad()
def sinkhorn_biases_dense(S: Tensor, gamma: float, n_iters: int = 4, *, chunk: int = 65536) -> tuple[Tensor, Tensor]:
    """Fig. 4 (log domain, chunked) on an explicit (Q, N) score matrix, e.g. :func:`served_score_matrix`.

    Entries of -inf are absent (M_ij = 0).  Returns ``(a (Q,), b (N,))`` float32 on CPU."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    if n_iters < 1:
        raise ValueError(f"n_iters must be >= 1, got {n_iters}")
    S = torch.as_tensor(S)
    if S.ndim != 2 or S.shape[0] == 0:
        raise ValueError(f"S must be a non-empty 2-D matrix, got shape {tuple(S.shape)}")
    n_q, n = S.shape
    if n == 0:
        return torch.zeros(n_q, dtype=torch.float32), torch.zeros(0, dtype=torch.float32)
    inv_g = 1.0 / gamma
    ch = effective_chunk(chunk, n_q, DEFAULT_BLOCK_ELEMS)
    return sinkhorn_blocks(lambda s, e: S[:, s:e].float() * inv_g, n_q, n, gamma, n_iters, ch, S.device)


# ---------------------------------------------------------------- NCL biases inside stage 1
def fold_biases(units: np.ndarray | Tensor, biases: np.ndarray | Tensor, c: float = 1.0) -> np.ndarray:
    """Gallery side of the exact bias fold: [v̂_j ; b_j / c] (n, d + 1) float32.

    With the query folded as [t̂ ; c] (`fold_query`), the inner product is cos(t, v_j) + b_j, so an inner-product
    ANN ranks candidates by the biased score and stage 1 already chooses them with the biases. Any c > 0 is
    exact; c = 1 keeps the extra coordinate as small as the biases themselves (|b| << 1 for γ = 0.01), so
    the folded vectors stay near unit norm and IVF/HNSW behave as on the plain vectors.
    """
    if c <= 0:
        raise ValueError(f"c must be > 0, got {c}")
    u = np.asarray(units, dtype=np.float32)
    b = np.asarray(biases, dtype=np.float32).reshape(-1, 1)
    if len(u) != len(b):
        raise ValueError(f"{len(u)} vectors but {len(b)} biases")
    return np.ascontiguousarray(np.concatenate([u, b / c], axis=1))


def fold_query(queries: np.ndarray | Tensor, c: float = 1.0) -> np.ndarray:
    """Query side of the fold: [t̂ ; c] (q, d + 1) float32 (t̂ already unit-normalised)."""
    q = np.asarray(queries, dtype=np.float32)
    return np.ascontiguousarray(np.concatenate([q, np.full((len(q), 1), c, dtype=np.float32)], axis=1))
