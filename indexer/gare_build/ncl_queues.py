"""The banks of queries NCL fits the video biases to: the traffic query bank of `gare-index biases --from-traffic`
(validated served query embeddings, mixed with the checkpoint's training queue) and the fresh queue (the
training captions re-encoded with the final text tower, instead of the embeddings pushed during training, most of
them by model states far from the final one: docs/postprocessing.md).

:func:`load_query_bank` validates a float32 (n, d) file of query embeddings written by gare-serve's query bank
(never unpickled): the text tower's raw t, as psi scores it (banks written before the bank kept |t| hold unit rows,
which :func:`served_norms` scales to a reference |t|); :func:`mix_queues` mixes it with the checkpoint's training queue so that a given fraction of the
queue NCL fits the biases to is traffic (seeded: same inputs, same queue). ``gare-index tune --from-bank`` reads
the same files (:func:`gare_build.tuning.queries.bank_queries`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from gare.annotations import carve_validation, load_dataset, load_manifest
from gare.checkpoint import file_sha256
from gare_build.checkpoint_data import resolve_data_root

log = logging.getLogger(__name__)

TRAFFIC_SEED = 0
MAX_BANK_ROWS = 10_000_000  # a bank bigger than this is refused (the service keeps a bounded queue)

BIAS_QUEUES = ("fresh", "stale")  # the queue NCL fits to: training captions re-encoded now, or the pushed embeddings
FRESH_SEED = 0
DEFAULT_QUEUE_SIZE = 16384  # NCL's queue size, when the checkpoint does not say its own

UNIT_TOL = 1e-2  # a bank row whose |t| is within this of 1 is a unit row (written without its norm)

__all__ = ["TRAFFIC_SEED", "MAX_BANK_ROWS", "BIAS_QUEUES", "UNIT_TOL", "load_query_bank", "served_norms", "mix_queues",
           "training_captions", "FreshQueueUnavailable"]


class FreshQueueUnavailable(ValueError):
    """The training captions of a fresh queue cannot be found or read (the message says which and why)."""


def training_captions(ckpt: Any, source: str | os.PathLike | None = None) -> tuple[list[str], dict[str, Any]]:
    """The caption texts of the fresh queue and where they came from (for the manifest).

    ``source``: a caption manifest (.csv / .jsonl: every caption, used whole) or a `gare-train synth` folder (its
    training split), or None: the training data the checkpoint names (``train_args["data"]``, paths resolved
    against the cwd and the checkpoint's folders). From a training split, the validation part is carved off as
    `gare-train fit` did (the checkpoint's val_fraction and seed), so the queue holds only captions it trained on.
    Raises FreshQueueUnavailable with the reason when there is nothing to read."""
    ta = dict(getattr(ckpt, "train_args", None) or {})
    if source is not None:
        p = Path(source).expanduser().absolute()
        if p.is_file():
            try:
                rs = load_manifest(p, name="bias-captions")
            except (OSError, ValueError, KeyError) as e:
                raise FreshQueueUnavailable(f"--bias-captions {source}: {e}") from None
            return list(rs.captions), {"captions": f"manifest {p.name}", "sha256": file_sha256(p)}
        if p.is_dir() and (p / "train.csv").is_file() and (p / "MSRVTT_data.json").is_file():
            spec: dict[str, Any] = {"kind": "synth", "root": str(p)}
        else:
            raise FreshQueueUnavailable(f"--bias-captions {source}: not a caption manifest (.csv/.jsonl) or a "
                                        "`gare-train synth` folder")
    else:
        spec = ta.get("data") or {}
        if not spec:
            name = Path(getattr(ckpt, "path", None) or "the-checkpoint").name  # a name, not a server path (GET /v1/index)
            raise FreshQueueUnavailable(f"{name} names no training data; pass --bias-captions (a caption manifest or a "
                                        "synth folder)")
        spec = resolve_data_root(spec, getattr(ckpt, "path", None))
    try:
        full = load_dataset(spec, "train")
    except (OSError, KeyError, ValueError) as e:
        raise FreshQueueUnavailable(f"cannot read the training captions {spec}: {e}") from None
    frac, seed = float(ta.get("val_fraction") or 0.0), int(ta.get("seed", 0))
    train = carve_validation(full, frac, seed)[0] if 0 < frac < 1 else full
    where = spec.get("root") or spec.get("anno_dir") or spec.get("train")
    # names, not server paths, in the descriptions (GET /v1/index shows them); bias_queue records the full source
    return list(train.captions), {"captions": f"{spec.get('kind')} {Path(str(where)).name}: training split"
                                  + (f" less the validation part (fraction {frac:g}, seed {seed})" if 0 < frac < 1 else "")}


def fresh_rows(n: int, size: int, seed: int = FRESH_SEED) -> np.ndarray:
    """Which of n captions enter a queue of `size`: all when they fit, else a seeded sample (sorted)."""
    return _subsample(n, size, np.random.default_rng(seed))


def load_query_bank(path: str | os.PathLike, d: int, *, max_rows: int = MAX_BANK_ROWS) -> tuple[np.ndarray, dict[str, Any]]:
    """A validated bank of served query embeddings: float32 (n, d) as stored, finite, non-zero rows.

    The rows are the text tower's raw t (gare_serve.engine.traffic_bank), the vectors psi scores; stage 1 and the
    dual-tower score use their directions. ``info["unit_rows"]`` counts the rows of unit length: a bank written
    before the service kept |t| holds only those, and :func:`served_norms` gives them a norm before psi scores them.
    Never unpickles (``allow_pickle=False``); any problem raises ValueError with the reason."""

    p = Path(path).expanduser().absolute()
    if not p.is_file():
        raise ValueError(f"--from-traffic {path}: no such file")
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except ValueError as e:  # object arrays (pickles) and bad headers
        raise ValueError(f"--from-traffic {p}: not a plain numeric .npy array ({e})") from None
    except (OSError, EOFError) as e:
        raise ValueError(f"--from-traffic {p}: unreadable .npy file ({e})") from None
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"--from-traffic {p}: an .npy array is expected, not an .npz archive")
    if arr.dtype != np.float32:
        raise ValueError(f"--from-traffic {p}: dtype {arr.dtype}, expected float32 (query embeddings)")
    if arr.ndim != 2 or arr.shape[1] != d:
        raise ValueError(f"--from-traffic {p}: shape {arr.shape}, expected (n, {d}) for this index (d={d})")
    n = int(arr.shape[0])
    if n == 0:
        raise ValueError(f"--from-traffic {p}: the bank is empty")
    if n > max_rows:
        raise ValueError(f"--from-traffic {p}: {n} rows, more than the {max_rows} accepted")
    x = np.array(arr, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        bad = int((~np.isfinite(x)).any(axis=1).sum())
        raise ValueError(f"--from-traffic {p}: {bad} rows hold NaN or infinite values")
    norms = np.linalg.norm(x, axis=1)
    if np.any(norms < 1e-6):
        raise ValueError(f"--from-traffic {p}: {int((norms < 1e-6).sum())} rows are zero vectors")
    unit = int((np.abs(norms - 1.0) <= UNIT_TOL).sum())
    info = {"file": str(p), "sha256": file_sha256(p), "rows": n, "unit_rows": unit, "non_unit_rows": n - unit}
    return x, info


def served_norms(x: np.ndarray, reference: float | None) -> tuple[np.ndarray, dict[str, Any]]:
    """Bank rows (n, d) as psi scores them, and the record of what was done to them.

    psi is not scale-invariant (q = v̄ - t), so a row must carry the |t| the service served it with. Rows of raw t
    are kept. Unit rows (a bank written before the service kept |t|) are scaled to the mean |t| of the bank's own
    raw rows when it has some, else to ``reference`` (the mean |t| of the same text tower's caption embeddings:
    the checkpoint's training queue), else left at |t| = 1, which the record says. The tower's |t| varies little
    from text to text, so a mean is close; the record names the scale (``bank_scale``) and where it came from."""
    norms = np.linalg.norm(x, axis=1)
    unit = np.abs(norms - 1.0) <= UNIT_TOL
    m = int(unit.sum())
    if m == 0:
        return x, {"unit_rows": 0}
    if m < x.shape[0]:
        scale, src = float(norms[~unit].mean()), "the mean |t| of the bank's served rows"
    elif reference is not None and reference > 0:
        scale, src = float(reference), "the mean |t| of the checkpoint's training queue"
    else:
        log.warning("%d query-bank rows are unit vectors and nothing gives their |t|: psi scores them at |t| = 1, "
                    "which no served query has", m)
        return x, {"unit_rows": m, "bank_scale": 1.0, "bank_scale_from": "none: psi scores these rows at |t| = 1"}
    out = x.copy()
    out[unit] *= np.float32(scale)
    return out, {"unit_rows": m, "bank_scale": round(scale, 6), "bank_scale_from": src}


def _subsample(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if k >= n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=k, replace=False))


def mix_queues(train: np.ndarray | None, bank: np.ndarray, weight: float, *, seed: int = TRAFFIC_SEED
               ) -> tuple[np.ndarray, dict[str, Any]]:
    """The mixed query queue: a fraction `weight` of traffic queries, the rest from the training queue.

    Size: the training queue's (Q), or the bank's when there is no training queue. When the bank holds fewer
    than weight * Q rows, all of it is used and the training part shrinks so the fraction stays `weight`.
    Rows are subsampled without replacement by a seeded generator (same inputs, same queue)."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"--traffic-weight must be in [0, 1], got {weight}")
    rng = np.random.default_rng(seed)
    n_b = int(bank.shape[0])
    q = 0 if train is None else int(train.shape[0])
    if q == 0:
        n_t, n_q = n_b, 0
    else:
        n_t = int(round(weight * q))
        n_q = q - n_t
        if n_t > n_b:
            n_t = n_b
            n_q = min(q, int(round(n_b * (1.0 - weight) / weight))) if weight > 0 else q
    parts = []
    if n_q:
        assert train is not None
        parts.append(np.asarray(train, dtype=np.float32)[_subsample(q, n_q, rng)])
    if n_t:
        parts.append(bank[_subsample(n_b, n_t, rng)])
    mixed = np.concatenate(parts) if parts else np.zeros((0, bank.shape[1]), np.float32)
    info = {"traffic_weight": float(weight), "traffic_queries": n_t, "train_queries": n_q,
            "weight_effective": round(n_t / max(1, n_t + n_q), 6), "seed": seed}
    if q == 0:
        info["note"] = "the checkpoint has no training query queue: traffic queries only"
    return mixed, info
