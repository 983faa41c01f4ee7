"""Finding the clips to index: directory walks, JSONL/JSON/CSV manifests, file scans and segment windows.

Everything here is cheap (no model): it turns `--videos DIR|MANIFEST` into a list of :class:`Clip` with
size, mtime, sha256 checksum, duration and fps filled in, and a list of :class:`Skip` (file and reason)
for everything that cannot be indexed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import os
import sys
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gare.video import VIDEO_EXTENSIONS, VideoDecodeError, probe_video

log = logging.getLogger(__name__)

MANIFEST_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv")
MANIFEST_COLUMNS = ("video", "path", "start", "end", "id")  # what a manifest row means to the builder; the rest are fields


@dataclass
class Clip:
    """One index entry: a whole video (start = end = None) or a window of it (seconds)."""

    path: str  # absolute
    start: float | None = None
    end: float | None = None
    id: int | None = None  # requested by the manifest, then the assigned id
    source: str = ""  # "manifest.jsonl:3" for manifest rows
    size: int = 0
    mtime: float = 0.0
    checksum: str = ""
    duration: float | None = None
    fps: float | None = None
    explicit_id: bool = False
    # the manifest's other columns (raw, as read: CSV text or JSON values), then as stored (gare_index.fields)
    fields: dict[str, Any] | None = None

    @property
    def seg(self) -> tuple[str, float | None, float | None]:
        return (self.path, self.start, self.end)

    @property
    def cache_key(self) -> str:
        """What the features depend on (besides the model): file content and window."""
        return f"{self.checksum}|{fmt_time(self.start)}|{fmt_time(self.end)}"


@dataclass
class Skip:
    path: str
    reason: str
    start: float | None = None
    end: float | None = None
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: v for k, v in d.items() if v not in (None, "")}


def fmt_time(t: float | None) -> str:
    return "-" if t is None else f"{float(t):.3f}"


def seg_of(path: str, start: Any, end: Any) -> tuple[str, float | None, float | None]:
    """Normalised (path, start, end) key (times rounded to the millisecond, as stored)."""
    return (str(path), None if start is None else round(float(start), 3), None if end is None else round(float(end), 3))


def is_manifest(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in MANIFEST_SUFFIXES


# ------------------------------------------------------------------------------------------ discovery
def walk_videos(directory: Path) -> tuple[list[Clip], list[Skip]]:
    """Video files under `directory`, recursively, sorted by path; other files come back as `ignored`."""
    clips: list[Clip] = []
    ignored: list[Skip] = []
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue  # hidden and temporary files (e.g. half-written downloads)
            p = os.path.abspath(os.path.join(dirpath, name))
            if Path(name).suffix.lower() in VIDEO_EXTENSIONS:
                clips.append(Clip(p))
            else:
                ignored.append(Skip(p, f"not a video file type ({Path(name).suffix or 'no extension'})"))
    clips.sort(key=lambda c: c.path)
    return clips, ignored


def _opt_float(value: Any, what: str) -> float | None:
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"invalid {what} {value!r} (seconds expected)") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"invalid {what} {value!r} (must be finite and >= 0)")
    return v


def _opt_id(value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    try:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        v = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"invalid id {value!r} (a non-negative integer expected)") from None
    if v < 0 or v >= 2**63:
        raise ValueError(f"invalid id {value!r} (a non-negative integer expected)")
    return v


def _manifest_rows(path: Path) -> Iterable[tuple[int, Mapping[str, Any] | None, str | None]]:
    """(line number, row, parse error) for every row of a JSONL / JSON / CSV / TSV manifest."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    yield i, None, f"invalid JSON ({e.msg})"
                    continue
                yield i, row if isinstance(row, dict) else None, None if isinstance(row, dict) else "not a JSON object"
    elif suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            data = data.get("videos", data.get("items"))
        if not isinstance(data, list):
            raise ValueError(f"{path}: a JSON manifest must be a list of objects (or {{'videos': [...]}})")
        for i, row in enumerate(data, 1):
            yield i, row if isinstance(row, dict) else None, None if isinstance(row, dict) else "not a JSON object"
    else:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh, delimiter="\t" if suffix == ".tsv" else ",")
            cols = reader.fieldnames or []
            if "video" not in cols and "path" not in cols:
                raise ValueError(f"{path}: no 'video' column (columns: {cols})")
            for i, row in enumerate(reader, 2):
                yield i, row, None


def read_manifest(path: Path) -> tuple[list[Clip], list[Skip]]:
    """Clips listed in a manifest (`video` path column, optional `start`/`end` seconds and `id`)."""
    base = path.parent
    clips: list[Clip] = []
    skipped: list[Skip] = []
    for line, row, error in _manifest_rows(path):
        where = f"{path.name}:{line}"
        if row is None:
            skipped.append(Skip(where, f"manifest row unreadable: {error}", source=where))
            continue
        video = row.get("video", row.get("path"))
        if not video or not isinstance(video, str):
            skipped.append(Skip(where, f"manifest row has no 'video' path (got {video!r})", source=where))
            continue
        p = os.path.abspath(os.path.join(base, os.path.expanduser(video)))
        try:
            start = _opt_float(row.get("start"), "start")
            end = _opt_float(row.get("end"), "end")
            vid = _opt_id(row.get("id"))
        except ValueError as e:
            skipped.append(Skip(p, str(e), source=where))
            continue
        start = None if start is None else round(start, 3)
        end = None if end is None else round(end, 3)
        if start is not None and end is not None and end <= start:
            skipped.append(Skip(p, f"end {end:g} <= start {start:g}", start, end, where))
            continue
        if Path(p).suffix.lower() not in VIDEO_EXTENSIONS:
            skipped.append(Skip(p, f"unsupported file type {Path(p).suffix or '(no extension)'!r}", start, end, where))
            continue
        extra = {str(k): v for k, v in row.items() if k not in MANIFEST_COLUMNS and k is not None}
        clips.append(Clip(p, start, end, vid, where, explicit_id=vid is not None, fields=extra or None))
    return clips, skipped


def discover(videos: str | os.PathLike) -> tuple[list[Clip], list[Skip], list[Skip]]:
    """(clips, skipped, ignored) for a directory, a manifest or a single video file."""
    src = Path(videos).expanduser()
    if src.is_dir():
        clips, ignored = walk_videos(src)
        return clips, [], ignored
    if is_manifest(src):
        clips, skipped = read_manifest(src)
        return clips, skipped, []
    if src.is_file() and src.suffix.lower() in VIDEO_EXTENSIONS:
        return [Clip(os.path.abspath(src))], [], []
    if not src.exists():
        raise ValueError(f"--videos {videos}: no such file or directory")
    raise ValueError(f"--videos {videos}: not a directory, a manifest ({', '.join(MANIFEST_SUFFIXES)}) or a video file")


# ------------------------------------------------------------------------------------------ scanning
def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _stat_reason(path: str, e: OSError) -> str:
    if isinstance(e, FileNotFoundError):
        return "file not found (vanished or a dangling link)"
    if isinstance(e, PermissionError):
        return "permission denied"
    return f"cannot read: {e.strerror or e}"


def _scan_one(clip: Clip, known: Mapping[str, Mapping[str, Any]]) -> Clip | Skip:
    p = clip.path
    try:
        st = os.stat(p)
    except OSError as e:
        return Skip(p, _stat_reason(p, e), clip.start, clip.end, clip.source)
    if not os.path.isfile(p):
        return Skip(p, "not a regular file", clip.start, clip.end, clip.source)
    if st.st_size == 0:
        return Skip(p, "empty file", clip.start, clip.end, clip.source)
    clip.size, clip.mtime = int(st.st_size), float(st.st_mtime)
    prev = known.get(p)
    if prev is not None and prev.get("size") == clip.size and prev.get("mtime") == clip.mtime and prev.get("checksum"):
        # Unchanged since it was indexed (size and mtime): trust the stored checksum and probe results.
        clip.checksum = prev["checksum"]
        clip.duration, clip.fps = prev.get("duration"), prev.get("fps")
        if clip.duration and clip.fps:
            return clip
    else:
        try:
            clip.checksum = sha256_file(p)
        except OSError as e:
            return Skip(p, _stat_reason(p, e), clip.start, clip.end, clip.source)
    try:
        info = probe_video(p)
    except VideoDecodeError as e:
        return Skip(p, e.reason, clip.start, clip.end, clip.source)
    except Exception as e:  # noqa: BLE001 - a decoder library error is a bad file, not a crash
        return Skip(p, f"cannot probe: {type(e).__name__}: {str(e)[:200]}", clip.start, clip.end, clip.source)
    clip.duration, clip.fps = float(info.duration), float(info.fps)
    return clip


def scan(clips: list[Clip], known: Mapping[str, Mapping[str, Any]] | None = None, threads: int = 4,
         progress: bool = False) -> tuple[list[Clip], list[Skip]]:
    """Stat, checksum (sha256) and probe every distinct file; `known` maps path -> previous metadata row.

    A file whose size and mtime equal its previous row keeps that row's checksum (no re-hash).
    """
    known = known or {}
    by_path: dict[str, list[Clip]] = {}
    for c in clips:
        by_path.setdefault(c.path, []).append(c)
    firsts = [v[0] for v in by_path.values()]
    from tqdm.auto import tqdm

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        results = list(tqdm(pool.map(lambda c: _scan_one(c, known), firsts), total=len(firsts), desc="scan",
                            unit="file", disable=not progress, file=sys.stderr))
    ok: list[Clip] = []
    skipped: list[Skip] = []
    result_by_path = {c.path: r for c, r in zip(firsts, results, strict=True)}
    for c in clips:
        r = result_by_path[c.path]
        if isinstance(r, Skip):
            skipped.append(Skip(c.path, r.reason, c.start, c.end, c.source))
            continue
        c.size, c.mtime, c.checksum, c.duration, c.fps = r.size, r.mtime, r.checksum, r.duration, r.fps
        ok.append(c)
    return ok, skipped


# ------------------------------------------------------------------------------------------ segments
def segment_windows(duration: float, seconds: float, overlap: float = 0.0) -> list[tuple[float, float]]:
    """Windows [start, end) of `seconds` every `seconds - overlap` covering [0, duration].

    A video no longer than one window gives one window (0, duration). A last window shorter than
    min(1 s, seconds / 4) is merged into the previous one (its end is extended), so no entry is a sliver.
    """
    if not (seconds > 0):
        raise ValueError(f"segment length must be > 0, got {seconds}")
    if not (0 <= overlap < seconds):
        raise ValueError(f"overlap must be >= 0 and < the segment length {seconds}, got {overlap}")
    duration = max(float(duration), 0.0)
    step = seconds - overlap
    out: list[tuple[float, float]] = []
    s = 0.0
    while True:
        e = min(s + seconds, duration)
        out.append((round(s, 3), round(e, 3)))
        if e >= duration - 1e-6:
            break
        s += step
    if len(out) > 1 and out[-1][1] - out[-1][0] < min(1.0, seconds / 4):
        last = out.pop()
        out[-1] = (out[-1][0], last[1])
    return out


def expand_segments(clips: list[Clip], seconds: float | None, overlap: float) -> tuple[list[Clip], list[Skip]]:
    """Split clips without a window into `seconds` windows; clips with start/end stay as they are."""
    if not seconds:
        return clips, []
    out: list[Clip] = []
    skipped: list[Skip] = []
    for c in clips:
        if c.start is not None or c.end is not None:
            out.append(c)
            continue
        wins = segment_windows(c.duration or 0.0, seconds, overlap)
        if c.explicit_id and len(wins) > 1:
            skipped.append(Skip(c.path, f"manifest id {c.id} given for a video split into {len(wins)} segments", source=c.source))
            continue
        for s, e in wins:
            out.append(Clip(c.path, s, e, c.id, c.source, c.size, c.mtime, c.checksum, c.duration, c.fps, c.explicit_id,
                            fields=c.fields))
    return out, skipped
