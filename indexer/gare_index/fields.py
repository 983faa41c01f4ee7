"""A library's own fields on every indexed video: their types, how manifest values become stored values, the
schema an index records, and the columns a filter is evaluated over.

Four types: ``string``, ``tags`` (a list of strings), ``number`` (float) and ``date`` (ISO 8601; compared as
seconds since the epoch, UTC; a date without a zone is UTC, a date without a time is its midnight). A manifest
declares them (``--fields channel:string,year:number``) or they are inferred from the values. The schema
(name -> type) is recorded in the version's manifest (``fields``) and the values in meta.sqlite's ``fields``
table (one column per field); every later ``add`` must agree with it (:func:`merge_schema`).

Some fields are always there, read from the ``videos`` table (:data:`BUILTIN_FIELDS`): ``duration``, ``folder``
(the file's absolute directory), ``mtime`` (the file's modification time, a date), ``path``, ``id``, ...
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

FIELD_TYPES: tuple[str, ...] = ("string", "tags", "number", "date")
# Always available, read from the videos table (folder is derived from path); a user field may not take these names.
BUILTIN_FIELDS: dict[str, str] = {
    "id": "number", "path": "string", "folder": "string", "duration": "number", "mtime": "date",
    "size": "number", "fps": "number", "start": "number", "end": "number",
}
# Manifest columns that already mean something to the builder (never user fields) and names the store uses.
RESERVED_NAMES = frozenset({*BUILTIN_FIELDS, "video", "checksum", "frames_used", "status", "rowid", "metadata"})
FIELDS_TABLE = "fields"  # meta.sqlite table: id INTEGER PRIMARY KEY, one column per user field
MAX_FIELDS = 64
MAX_TAGS = 256  # tags per video
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?(Z|[+-]\d{2}:?\d{2})?$")
_SQL_TYPES = {"string": "TEXT", "tags": "TEXT", "number": "REAL", "date": "TEXT"}


class FieldError(ValueError):
    """A field declaration or value that cannot go into the index (the message names the field and the value)."""


# ------------------------------------------------------------------------------------------ declarations
def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise FieldError(f"field name {name!r} is not valid (letters, digits and _, not starting with a digit, "
                         "at most 64 characters)")
    if name in RESERVED_NAMES:
        raise FieldError(f"field name {name!r} is reserved (built-in fields: {', '.join(sorted(RESERVED_NAMES))})")
    return name


def check_type(name: str, kind: str) -> str:
    if kind not in FIELD_TYPES:
        raise FieldError(f"field {name!r}: unknown type {kind!r} (types: {', '.join(FIELD_TYPES)})")
    return kind


def parse_field_spec(text: str | None) -> dict[str, str]:
    """``"channel:string,tags:tags,year:number,published:date"`` -> {name: type} (the ``--fields`` option)."""
    out: dict[str, str] = {}
    if not text:
        return out
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, kind = part.partition(":")
        if not sep:
            raise FieldError(f"--fields entry {part!r} must be name:type (types: {', '.join(FIELD_TYPES)})")
        name, kind = check_name(name.strip()), kind.strip()
        out[name] = check_type(name, kind)
    return out


def sql_type(kind: str) -> str:
    return _SQL_TYPES[kind]


# ------------------------------------------------------------------------------------------ values
def date_seconds(value: Any) -> float:
    """An ISO 8601 date/datetime string (or seconds since the epoch) -> seconds since the epoch, UTC."""
    if isinstance(value, bool):
        raise FieldError(f"{value!r} is not a date (ISO 8601 expected)")
    if isinstance(value, (int, float)):
        v = float(value)
        if not math.isfinite(v):
            raise FieldError(f"{value!r} is not a date (finite seconds since the epoch expected)")
        return v
    if not isinstance(value, str) or not _DATE_RE.match(value.strip()):
        raise FieldError(f"{value!r} is not a date (ISO 8601 expected, e.g. 2020-03-01 or 2020-03-01T12:00:00Z)")
    s = value.strip()
    try:
        d = _dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise FieldError(f"{value!r} is not a date (ISO 8601 expected, e.g. 2020-03-01)") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=_dt.UTC)
    return d.timestamp()


def _is_date_text(v: Any) -> bool:
    if not isinstance(v, str) or not _DATE_RE.match(v.strip()):
        return False
    try:
        date_seconds(v)
    except FieldError:
        return False
    return True


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        f = float(v)
        return f if math.isfinite(f) else None
    if isinstance(v, str):
        try:
            f = float(v.strip())
        except ValueError:
            return None
        return f if math.isfinite(f) else None
    return None


def _tags_of(v: Any) -> list[str] | None:
    """A list of strings, or a CSV cell holding a JSON list or ``a|b|c``; None when it is not one."""
    if isinstance(v, list):
        return v if all(isinstance(x, str) for x in v) else None
    if isinstance(v, str):
        s = v.strip()
        if s.startswith("["):
            try:
                x = json.loads(s)
            except json.JSONDecodeError:
                return None
            return x if isinstance(x, list) and all(isinstance(t, str) for t in x) else None
        return [t.strip() for t in s.split("|") if t.strip()]
    return None


def is_missing(v: Any) -> bool:
    return v is None or (isinstance(v, str) and v.strip() == "")


def coerce(name: str, kind: str, value: Any) -> Any:
    """A manifest value of field `name` as stored: str (string), JSON text of a sorted unique list (tags), float
    (number), normalised ISO text (date); None when missing. FieldError names the field, value and type."""
    if is_missing(value):
        return None
    if kind == "string":
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return value if isinstance(value, str) else str(value)
        raise FieldError(f"field {name!r} is a string; got {value!r}")
    if kind == "number":
        f = _number(value)
        if f is None:
            raise FieldError(f"field {name!r} is a number; got {value!r}")
        return f
    if kind == "date":
        try:
            secs = date_seconds(value)
        except FieldError:
            raise FieldError(f"field {name!r} is a date (ISO 8601, e.g. 2020-03-01); got {value!r}") from None
        if isinstance(value, str):
            return value.strip()
        return _dt.datetime.fromtimestamp(secs, _dt.UTC).isoformat()
    tags = _tags_of(value)
    if tags is None:
        raise FieldError(f"field {name!r} is tags (a list of strings, or a|b|c in CSV); got {value!r}")
    if len(tags) > MAX_TAGS:
        raise FieldError(f"field {name!r}: {len(tags)} tags, at most {MAX_TAGS}")
    return json.dumps(sorted(set(tags)), ensure_ascii=False)


def infer_type(name: str, values: Iterable[Any]) -> str:
    """The type of a column from its non-missing values: tags if any is a list, else number if all are numbers,
    else date if all are ISO dates, else string."""
    vals = [v for v in values if not is_missing(v)]
    if not vals:
        return "string"
    if any(isinstance(v, bool) for v in vals):
        raise FieldError(f"field {name!r}: true/false values are not a field type (declare it a string or number)")
    if any(isinstance(v, list) for v in vals):
        return "tags"
    if any(isinstance(v, dict) for v in vals):
        raise FieldError(f"field {name!r}: objects are not a field type (string, tags, number, date)")
    if all(_number(v) is not None for v in vals):
        return "number"
    if all(_is_date_text(v) for v in vals):
        return "date"
    return "string"


def stored_value(kind: str, value: Any) -> Any:
    """A stored value as a result's metadata shows it (tags: the list)."""
    if value is None:
        return None
    if kind == "tags":
        return json.loads(value) if isinstance(value, str) else list(value)
    return value


# ------------------------------------------------------------------------------------------ schema
# a caption manifest's texts (what gare-train and --ncl-val read from the same file): captions, never a field
CAPTION_COLUMNS = frozenset({"caption", "captions"})


def ignored_columns(raw: Sequence[Mapping[str, Any]], declared: Mapping[str, str]) -> dict[str, str]:
    """Manifest columns that are not fields, name -> why: caption columns, and undeclared columns whose values
    are no field type (objects, true/false), as the project's own caption manifests carry (``attributes``). A
    declared column is never ignored: its values must fit its type."""
    columns: dict[str, list[Any]] = {}
    for r in raw:
        for k, v in r.items():
            columns.setdefault(k, []).append(v)
    out = {}
    for k, vals in columns.items():
        if k in declared:
            continue
        if k in CAPTION_COLUMNS:
            out[k] = "captions"
            continue
        try:
            infer_type(k, vals)
        except FieldError as e:
            out[k] = str(e)
    return out


def merge_schema(prev: Mapping[str, str] | None, declared: Mapping[str, str], raw: Sequence[Mapping[str, Any]],
                 *, adding: bool) -> dict[str, str]:
    """The schema of a new version: ``prev`` (the current version's, None for none), ``declared`` (``--fields``)
    and the columns of the manifest rows ``raw`` (name -> raw value). A build may declare new fields; an add must
    keep the current schema: a new column or another type is a FieldError naming it (nothing is written)."""
    prev = dict(prev or {})
    columns: dict[str, list[Any]] = {}
    for r in raw:
        for k, v in r.items():
            columns.setdefault(k, []).append(v)
    for k in columns:
        check_name(k)
    for k, t in declared.items():
        check_name(k)
        check_type(k, t)
    if adding and prev is not None:
        unknown = sorted(set(columns) - set(prev))
        if unknown:
            raise FieldError(f"the manifest has columns {unknown} that the index does not have (its fields: "
                             f"{', '.join(f'{k}:{t}' for k, t in sorted(prev.items())) or 'none'}); fields are fixed "
                             "when the index is built: rebuild with `gare-index build` to add them")
        clash = {k: t for k, t in declared.items() if k in prev and prev[k] != t}
        extra = sorted(set(declared) - set(prev))
        if clash or extra:
            raise FieldError(f"--fields {declared} disagrees with the index's fields {prev} "
                             f"({', '.join(f'{k}: {prev.get(k)} in the index, {t} here' for k, t in clash.items())}"
                             f"{'; not in the index: ' + str(extra) if extra else ''})")
        out = dict(prev)
    else:
        out = dict(declared)
        for k, vals in columns.items():
            if k not in out:
                out[k] = infer_type(k, vals)
    if len(out) > MAX_FIELDS:
        raise FieldError(f"{len(out)} fields, at most {MAX_FIELDS}")
    return dict(sorted(out.items()))


def coerce_row(schema: Mapping[str, str], raw: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """One clip's manifest fields as stored (the columns it gives; an empty value is None)."""
    unknown = sorted(set(raw) - set(schema))
    if unknown:
        raise FieldError(f"{where}: columns {unknown} are not fields of the index ({sorted(schema)})")
    out = {}
    for k, v in raw.items():
        try:
            out[k] = coerce(k, schema[k], v)
        except FieldError as e:
            raise FieldError(f"{where}: {e}" if where else str(e)) from None
    return out


# ------------------------------------------------------------------------------------------ columns
@dataclass
class Column:
    """One field over a version's rows (row order of ids.npy). number/date: ``values`` (n,) float64, NaN when
    missing. string: ``codes`` (n,) int32 into the sorted ``vocab`` (-1 when missing). tags: ``codes`` (m,) int32
    of every (row, tag) pair, ``owner`` (m,) int64 its row, ``vocab`` sorted."""

    name: str
    kind: str
    n: int
    values: np.ndarray | None = None
    codes: np.ndarray | None = None
    owner: np.ndarray | None = None
    vocab: np.ndarray | None = None  # (u,) str, sorted


def build_column(name: str, kind: str, raw: Sequence[Any]) -> Column:
    """A :class:`Column` from the stored values of one field, one per row (None when missing)."""
    n = len(raw)
    if kind in ("number", "date"):
        vals = np.full(n, np.nan, dtype=np.float64)
        for i, v in enumerate(raw):
            if v is not None:
                vals[i] = date_seconds(v) if kind == "date" else float(v)
        return Column(name, kind, n, values=vals)
    if kind == "string":
        present = [i for i, v in enumerate(raw) if v is not None]
        vocab, inv = np.unique(np.array([str(raw[i]) for i in present], dtype=object), return_inverse=True) \
            if present else (np.zeros(0, dtype=object), np.zeros(0, np.int64))
        codes = np.full(n, -1, dtype=np.int32)
        codes[np.asarray(present, dtype=np.int64)] = inv.astype(np.int32)
        return Column(name, kind, n, codes=codes, vocab=vocab)
    owners: list[int] = []
    tags: list[str] = []
    for i, v in enumerate(raw):
        if v is None:
            continue
        for t in stored_value("tags", v):
            owners.append(i)
            tags.append(t)
    vocab, inv = np.unique(np.array(tags, dtype=object), return_inverse=True) if tags else (
        np.zeros(0, dtype=object), np.zeros(0, np.int64))
    return Column(name, kind, n, codes=inv.astype(np.int32), owner=np.asarray(owners, dtype=np.int64), vocab=vocab)


def folder_of(path: str) -> str:
    return os.path.dirname(path)
