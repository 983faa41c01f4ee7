"""A device-resident copy of an index version: what stage 1 and the psi rerank read, as torch tensors on one or
more devices, so that a query copies no candidate rows from the host.

Per device, a contiguous range of rows (the gallery split evenly over the devices, in row order) holds:

- the stage-1 vectors (m, d) float32 (``ann_units`` when the index has InvGC-corrected ones, else ``units``),
  the NCL biases (m,) float32 and the ids (m,) int64 (stage 1 answers ids, and breaks ties by id);
- what :func:`gare_index.psi_consts.gather` reads for a candidate: the frames (m, f, d) as stored (float16, or
  int8 with their (m, f) float32 scales, dequantised on gather as :class:`gare_index.frame_quant.QuantFrames`
  does), the served psi constants (m, 10f + 5f² + 2), the units (m, d) and norms (m,) of v̄ = norm * unit.

:func:`estimate` sizes the copy before anything is copied, :func:`check_fits` refuses it (:class:`ResidentTooLarge`,
naming the bytes, the cap and the free memory) when a device cannot take its share; :meth:`ResidentIndex.copy`
streams the arrays from the memory maps in blocks. :meth:`ResidentIndex.search` is the exact stage 1 (one matrix
product and top-k per device, merged across devices, ties by id ascending); :meth:`ResidentIndex.gather` is the
rerank's candidates as :class:`gare.psi_fold_videos.VideoConstants` by ``index_select`` on the device tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gare.psi_fold_videos import VideoConstants
from gare_index.frame_quant import QuantFrames
from gare_index.version_protocol import SearchVersion

log = logging.getLogger(__name__)

__all__ = ["ResidentTooLarge", "ResidentEstimate", "ResidentShard", "ResidentIndex", "estimate", "check_fits",
           "split_rows", "device_list", "free_bytes", "WORKSPACE_QUERIES"]

# Queries a stage-1 call may hold at once in the estimate's workspace: per query and row, the scores, the
# ranking key (cos + b) and the comparison of the tie check, 4 bytes each.
WORKSPACE_QUERIES = 64
_WORKSPACE_BYTES_PER_QUERY_ROW = 12
_COPY_BLOCK_BYTES = 64 << 20  # host bytes read from a memory map per copy to a device


class ResidentTooLarge(RuntimeError):
    """The resident copy does not fit a device (the cap or its free memory); the caller keeps the CPU path."""


def device_list(devices: Sequence[str | torch.device] | None) -> list[torch.device]:
    """The devices as torch.device with an index for CUDA ("cuda" -> the current one); default: every CUDA
    device, else ["cpu"]."""
    if devices is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(n)] or [torch.device("cpu")]
    out = []
    for d in devices:
        dev = torch.device(d)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        out.append(dev)
    if not out:
        raise ValueError("devices must name at least one device, got an empty list")
    return out


def split_rows(n: int, parts: int) -> list[tuple[int, int]]:
    """n rows in `parts` contiguous ranges [start, stop), in order, sizes differing by at most one."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    bounds = [n * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def free_bytes(device: torch.device) -> int | None:
    """Free memory on `device`: CUDA's free bytes, the host's MemAvailable for the CPU, None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


@dataclass(frozen=True)
class ResidentEstimate:
    """The bytes a resident copy takes: per device (its row range's arrays and the stage-1 workspace)."""

    version: str
    devices: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]  # each device's rows [start, stop)
    row_bytes: int  # bytes per gallery row over every array copied
    workspace_queries: int
    bytes: tuple[int, ...]  # per device: rows * row_bytes + the workspace of workspace_queries queries

    @property
    def total(self) -> int:
        return int(sum(self.bytes))

    def as_dict(self) -> dict[str, object]:
        return {"version": self.version, "devices": list(self.devices), "ranges": [list(r) for r in self.ranges],
                "row_bytes": self.row_bytes, "bytes": list(self.bytes), "total": self.total}


def _nbytes_per_row(a: np.ndarray) -> int:
    shape = tuple(a.shape)
    return int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(a.dtype).itemsize


def _frame_arrays(version: SearchVersion) -> tuple[np.ndarray, np.ndarray | None]:
    """(the stored frame values, their per-frame scales or None): int8 frames are copied as int8 + scales."""
    fr = version.frames
    return (fr.q, fr.scales) if isinstance(fr, QuantFrames) else (fr, None)


def _stage1_vectors(version: SearchVersion) -> np.ndarray:
    """The vectors stage 1 ranks by (the InvGC-corrected ones when the index has them)."""
    return getattr(version, "stage1_units", version.units)


def estimate(version: SearchVersion, devices: Sequence[str | torch.device] | None, consts: np.ndarray, *,
             workspace_queries: int = WORKSPACE_QUERIES) -> ResidentEstimate:
    """The resident copy's bytes per device, before anything is copied: `consts` (n, W) the served psi constants."""
    devs = device_list(devices)
    fr, fscale = _frame_arrays(version)
    stage1 = _stage1_vectors(version)
    row = (_nbytes_per_row(version.units) + 4 + 4 + 8  # units, norms, biases, ids
           + _nbytes_per_row(fr) + (0 if fscale is None else _nbytes_per_row(fscale)) + _nbytes_per_row(consts)
           + (0 if stage1 is version.units else _nbytes_per_row(stage1)))
    ranges = split_rows(version.n, len(devs))
    need = tuple((b - a) * row + workspace_queries * (b - a) * _WORKSPACE_BYTES_PER_QUERY_ROW for a, b in ranges)
    return ResidentEstimate(version=version.name, devices=tuple(str(d) for d in devs), ranges=tuple(ranges),
                            row_bytes=row, workspace_queries=workspace_queries, bytes=need)


def check_fits(est: ResidentEstimate, cap_bytes: int | None, *, free: dict[str, int | None] | None = None) -> None:
    """Raise :class:`ResidentTooLarge` when a device's share (devices named twice add up) exceeds `cap_bytes`
    (per device; None = no cap) or the device's free memory (`free`: device -> bytes, default measured now)."""
    if cap_bytes is not None and cap_bytes < 0:
        raise ValueError(f"cap_bytes must be >= 0 or None, got {cap_bytes}")
    per: dict[str, int] = {}
    for dev, b in zip(est.devices, est.bytes, strict=True):
        per[dev] = per.get(dev, 0) + b
    for dev, need in per.items():
        have = free.get(dev) if free is not None else free_bytes(torch.device(dev))
        over_cap = cap_bytes is not None and need > cap_bytes
        if over_cap or (have is not None and need > have):
            rows = sum(b - a for d, (a, b) in zip(est.devices, est.ranges, strict=True) if d == dev)
            limit = f"the cap of {cap_bytes:,} bytes" if over_cap else f"the {have:,} bytes free there"
            cap = "no cap" if cap_bytes is None else f"cap {cap_bytes:,} bytes"
            fr = "free memory unknown" if have is None else f"{have:,} bytes free"
            raise ResidentTooLarge(
                f"index version {est.version} does not fit on {dev}: its resident copy needs {need:,} bytes there "
                f"({rows:,} rows x {est.row_bytes:,} bytes of stage-1 vectors, frames, psi constants, units, norms, "
                f"biases and ids, plus the stage-1 workspace of {est.workspace_queries} queries), over {limit} "
                f"({cap}, {fr}); the search keeps the CPU path (memory-mapped index, the candidates' rows copied "
                f"per query)")


def _copy(src: np.ndarray, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """Rows start:stop of a numpy array or memmap as one tensor on `device`, read in blocks of ~64 MB."""
    shape = (stop - start, *tuple(src.shape)[1:])
    dtype = torch.from_numpy(np.zeros(0, dtype=np.dtype(src.dtype))).dtype
    out = torch.empty(shape, dtype=dtype, device=device)
    block = max(1, _COPY_BLOCK_BYTES // max(1, _nbytes_per_row(src)))
    for a in range(start, stop, block):
        b = min(stop, a + block)
        # np.array: a writable host copy of the block (torch refuses to wrap a read-only memmap without a warning)
        out[a - start : b - start].copy_(torch.from_numpy(np.array(src[a:b])))  # type: ignore[index]
    return out


@dataclass(frozen=True)
class ResidentShard:
    """One device's rows [start, stop) of the gallery (m = stop - start)."""

    device: torch.device
    start: int
    stop: int
    stage1: torch.Tensor  # (m, d) float32: the vectors stage 1 ranks by (the same tensor as units without InvGC)
    ids: torch.Tensor  # (m,) int64
    biases: torch.Tensor  # (m,) float32
    units: torch.Tensor  # (m, d) float32: v̄ / |v̄|
    norms: torch.Tensor  # (m,) float32: |v̄|
    frames: torch.Tensor  # (m, f, d) as stored: float16 (or float32), or int8 with frame_scales
    frame_scales: torch.Tensor | None  # (m, f) float32 for int8 frames
    packed: torch.Tensor  # (m, W) the served psi constants


def _select(sh: ResidentShard, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(frames, packed, vbar) of the shard's local rows: frames as gather reads them (int8 dequantised to float32
    as QuantFrames, vbar = unit * norm in float32: the same operations as the host path, bitwise equal)."""
    fr = sh.frames.index_select(0, local)
    if sh.frame_scales is not None:
        fr = fr.to(torch.float32) * sh.frame_scales.index_select(0, local)[..., None]
    vb = sh.units.index_select(0, local) * sh.norms.index_select(0, local)[:, None]
    return fr, sh.packed.index_select(0, local), vb


def _order_by_key_then_id(key: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Permutation (a, c) sorting each row by key descending, then id ascending (two stable sorts)."""
    by_id = torch.argsort(ids, dim=1, stable=True)
    k2 = key.gather(1, by_id)
    return by_id.gather(1, torch.sort(k2, dim=1, descending=True, stable=True).indices)


def _topk_by_id(key: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (a, k) of each row's top k of key (a, m) by key descending then ids (m,) ascending, k <= m: top-k,
    then the rows with ties at the k-th value take the tied entries of smallest id (torch.topk picks any)."""
    v, p = key.topk(k, dim=1)
    kth = v[:, -1:]  # (a, 1)
    tie_rows = torch.nonzero((key >= kth).sum(1) > k).flatten().tolist()  # rare: a tie across the boundary
    for r in tie_rows:
        above = torch.nonzero(key[r] > kth[r]).flatten()
        tied = torch.nonzero(key[r] == kth[r]).flatten()
        tied = tied[torch.argsort(ids[tied], stable=True)][: k - above.numel()]
        p[r] = torch.cat([above, tied])
    return p.gather(1, _order_by_key_then_id(key.gather(1, p), ids[p]))


class ResidentIndex:
    """An index version's stage-1 vectors and rerank data on one or more devices (see the module docstring)."""

    def __init__(self, name: str, shards: list[ResidentShard], fingerprint: str, dim: int, max_frames: int,
                 est: ResidentEstimate) -> None:
        self.name, self.shards, self.fingerprint = name, shards, fingerprint
        self.dim, self.max_frames, self.estimate = dim, max_frames, est
        self.n = sum(sh.stop - sh.start for sh in shards)

    @property
    def devices(self) -> list[torch.device]:
        return [sh.device for sh in self.shards]

    @classmethod
    def copy(cls, version: SearchVersion, consts: np.ndarray, fingerprint: str, est: ResidentEstimate) -> ResidentIndex:
        """Copy `version`'s arrays and its served constants `consts` (n, W) (valid for psi `fingerprint`) onto
        est's devices, each its range of rows. Check the estimate first (:func:`check_fits`)."""
        if tuple(consts.shape)[0] != version.n:
            raise ValueError(f"psi constants have {tuple(consts.shape)[0]} rows, version {version.name} "
                             f"has {version.n}")
        fr, fscale = _frame_arrays(version)
        stage1 = _stage1_vectors(version)
        ids = np.asarray(version.ids, dtype=np.int64)
        biases = np.asarray(version.biases, dtype=np.float32)
        norms = np.asarray(version.norms, dtype=np.float32)
        shards = []
        for dev_name, (a, b) in zip(est.devices, est.ranges, strict=True):
            dev = torch.device(dev_name)
            units = _copy(version.units, a, b, dev)
            shards.append(ResidentShard(
                device=dev, start=a, stop=b, stage1=units if stage1 is version.units else _copy(stage1, a, b, dev),
                ids=_copy(ids, a, b, dev), biases=_copy(biases, a, b, dev), units=units, norms=_copy(norms, a, b, dev),
                frames=_copy(fr, a, b, dev), frame_scales=None if fscale is None else _copy(fscale, a, b, dev),
                packed=_copy(consts, a, b, dev)))
        log.info("index version %s resident on %s: %s bytes (rows %s)", version.name, ", ".join(est.devices),
                 f"{est.total:,}", est.ranges)
        return cls(version.name, shards, fingerprint, int(stage1.shape[1]), version.max_frames, est)

    # ---------------------------------------------------------------------------------------- the rerank's rows
    def gather(self, rows: np.ndarray, device: torch.device | str) -> VideoConstants:
        """The constants of gallery rows `rows` (ascending, unique, int64) as VideoConstants on `device`, as
        :func:`gare_index.psi_consts.gather` gives them: index_select on each device's tensors, then the selected
        rows (not the gallery) move to `device` when it is another device."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows[0] < 0 or rows[-1] >= self.n or (rows.size > 1 and not (np.diff(rows) > 0).all())):
            raise ValueError(f"rows must be ascending, unique and in [0, {self.n}) for index version {self.name}, "
                             f"got {rows[:8].tolist()}{' ...' if rows.size > 8 else ''}")
        dev = torch.device(device)
        parts = []
        for sh in self.shards:
            lo, hi = np.searchsorted(rows, [sh.start, sh.stop])
            if hi > lo or (rows.size == 0 and sh is self.shards[0]):  # no rows: one empty selection, for the shapes
                local = torch.from_numpy(rows[lo:hi] - sh.start).to(sh.device)  # (r,) int64: indices, not rows
                parts.append(tuple(x.to(dev) for x in _select(sh, local)))
        fr, pk, vb = (p[0] if len(p) == 1 else torch.cat(p) for p in zip(*parts, strict=True))
        return VideoConstants(frames=fr, packed=pk, fingerprint=self.fingerprint, vbar=vb)

    # ---------------------------------------------------------------------------------------- stage 1
    def search(self, queries: np.ndarray, k: int, *, ncl_stage1: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Exact stage 1: (cosines (q, k) float32, ids (q, k) int64) of each query's top k by cos(t, v̂_j) (or by
        cos + b_j with `ncl_stage1`), ties by id ascending; missing results (k > n) id -1, score -inf."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        q = np.ascontiguousarray(np.atleast_2d(np.asarray(queries, dtype=np.float32)))
        if q.shape[1] != self.dim:
            raise ValueError(f"queries have d={q.shape[1]}, index version {self.name} has d={self.dim}")
        a = q.shape[0]
        if a == 0:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        host = torch.from_numpy(q)
        keys, coss, idss = [], [], []
        out_dev = self.shards[0].device
        with torch.inference_mode():
            # every device's product is launched before any top-k waits on the host (the tie check), so that
            # several GPUs compute their ranges at the same time
            scored = []
            for sh in self.shards:
                if sh.stop > sh.start:
                    s = torch.mm(host.to(sh.device), sh.stage1.t())  # (a, m) cosines
                    scored.append((sh, s, s + sh.biases if ncl_stage1 else s))
            for sh, s, key in scored:
                p = _topk_by_id(key, sh.ids, min(k, sh.stop - sh.start))  # (a, k') positions in the range
                keys.append(key.gather(1, p).to(out_dev))
                coss.append(s.gather(1, p).to(out_dev))
                idss.append(sh.ids[p].to(out_dev))
            if not keys:
                return np.full((a, k), -np.inf, np.float32), np.full((a, k), -1, np.int64)
            key, cos, ids = (x[0] if len(x) == 1 else torch.cat(x, 1) for x in (keys, coss, idss))
            if len(keys) > 1:  # each device's top k with ties by id: their union sorted the same way holds the top k
                o = _order_by_key_then_id(key, ids)[:, :k]
                cos, ids = cos.gather(1, o), ids.gather(1, o)
            cos_np, ids_np = cos.cpu().numpy(), ids.cpu().numpy()
        if cos_np.shape[1] < k:  # fewer rows than k: padded like the ANN
            pad = k - cos_np.shape[1]
            cos_np = np.concatenate([cos_np, np.full((a, pad), -np.inf, np.float32)], 1)
            ids_np = np.concatenate([ids_np, np.full((a, pad), -1, np.int64)], 1)
        return np.ascontiguousarray(cos_np, dtype=np.float32), np.ascontiguousarray(ids_np, dtype=np.int64)

    def release(self) -> None:
        """Drop the device tensors (a closed version frees its memory even while someone holds this object)."""
        self.shards = []
        self.n = 0
