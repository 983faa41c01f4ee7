"""The filter language of a search: a JSON object in the style of Chroma's ``where`` and MongoDB, compiled against
an index's fields (:mod:`gare_index.fields`) and evaluated into a boolean mask over the version's rows.

    {"channel": "news", "year": {"$gte": 2020}, "tags": {"$in": ["sport"]},
     "folder": {"$prefix": "/videos/2021"}, "$or": [{...}, {...}], "$not": {...}}

A field maps to a value (equality) or to an object of operators, all of which must hold: ``$eq $ne $gt $gte $lt
$lte $in $nin $prefix $not``. Keys ``$and`` / ``$or`` take a non-empty list of filters, ``$not`` a filter; the
keys of one object all hold. Per type: string -- $eq $ne $in $nin $prefix; tags (a list of strings) -- $eq / $ne
(has / has not the tag), $in (has any of), $nin (has none of); number and date -- $eq $ne $gt $gte $lt $lte $in
$nin (dates as ISO 8601 strings or seconds since the epoch). ``$prefix`` on ``folder`` and ``path`` matches whole
path components (``/a/b`` matches ``/a/b`` and ``/a/b/c``, not ``/a/bc``).

A video without a value for a field matches no comparison except ``$ne`` and ``$nin`` (MongoDB's rule), and
``$not`` is the complement of what it wraps.

Evaluation is vectorised over the columns (numpy: each comparison is one pass over an (n,) array, or over the
(row, tag) pairs of a tags field); a 1M-row table filters in milliseconds. A bad filter raises
:class:`FilterError` whose message names the place (``filter.$or[1].year``) and the problem.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gare_index.fields import BUILTIN_FIELDS, Column, FieldError, build_column, date_seconds

log = logging.getLogger(__name__)

MAX_DEPTH = 8  # nesting of $and / $or / $not
MAX_NODES = 256  # comparisons and connectives in one filter
MAX_LIST = 1024  # values of one $in / $nin
MAX_TEXT = 16_384  # characters of the filter as JSON
COMPARE_OPS = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$prefix")
OPS_BY_KIND: dict[str, tuple[str, ...]] = {
    "string": ("$eq", "$ne", "$in", "$nin", "$prefix"),
    "tags": ("$eq", "$ne", "$in", "$nin"),
    "number": ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin"),
    "date": ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin"),
}
PATH_FIELDS = ("folder", "path")


class FilterError(ValueError):
    """A filter that cannot be compiled: the message names where (``filter.year``) and what is wrong."""


@dataclass(frozen=True)
class Cmp:
    """One comparison: ``field op value`` (value normalised: str, float, or a tuple of them for $in/$nin)."""

    field: str
    kind: str
    op: str
    value: Any


@dataclass(frozen=True)
class And:
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class Or:
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class Not:
    part: Node


Node = Cmp | And | Or | Not


@dataclass(frozen=True)
class Filter:
    """A compiled filter: its tree and its canonical JSON text (sorted keys; what a result cache keys on)."""

    root: Node = field(compare=False)  # equal texts compile to equivalent trees (only the order of parts differs)
    text: str

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(_fields(self.root))


def _fields(node: Node) -> list[str]:
    if isinstance(node, Cmp):
        return [node.field]
    if isinstance(node, Not):
        return _fields(node.part)
    return [f for p in node.parts for f in _fields(p)]


# ------------------------------------------------------------------------------------------ compiling
def schema_of(user_fields: Mapping[str, str] | None) -> dict[str, str]:
    """Every field a filter may name: the built-in ones and the index's own (name -> type)."""
    return {**BUILTIN_FIELDS, **dict(user_fields or {})}


def compile_filter(spec: Any, schema: Mapping[str, str]) -> Filter:
    """Check and compile a filter object against `schema` (name -> type, :func:`schema_of`)."""
    try:
        text = json.dumps(spec, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise FilterError(f"filter: not a JSON object ({e})") from None
    if len(text) > MAX_TEXT:
        raise FilterError(f"filter: too long ({len(text)} characters as JSON, at most {MAX_TEXT})")
    if not isinstance(spec, Mapping):
        raise FilterError(f"filter: must be a JSON object, got {type(spec).__name__}")
    budget = [MAX_NODES]
    root = _compile_obj(spec, schema, "filter", 0, budget)
    return Filter(root, text)


def _spend(budget: list[int], where: str) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise FilterError(f"{where}: the filter is too long (more than {MAX_NODES} conditions)")


def _compile_obj(obj: Any, schema: Mapping[str, str], where: str, depth: int, budget: list[int]) -> Node:
    if depth > MAX_DEPTH:
        raise FilterError(f"{where}: nested too deep (at most {MAX_DEPTH} levels of $and/$or/$not)")
    if not isinstance(obj, Mapping):
        raise FilterError(f"{where}: must be an object, got {json.dumps(obj)[:80]}")
    if not obj:
        raise FilterError(f"{where}: an empty object (name a field or $and/$or/$not)")
    parts: list[Node] = []
    for key, val in obj.items():
        if not isinstance(key, str):
            raise FilterError(f"{where}: keys must be strings, got {key!r}")
        here = f"{where}.{key}"
        if key in ("$and", "$or"):
            if not isinstance(val, list) or not val:
                raise FilterError(f"{here}: must be a non-empty list of filters")
            _spend(budget, here)
            subs = tuple(_compile_obj(v, schema, f"{here}[{i}]", depth + 1, budget) for i, v in enumerate(val))
            parts.append(And(subs) if key == "$and" else Or(subs))
        elif key == "$not":
            _spend(budget, here)
            parts.append(Not(_compile_obj(val, schema, here, depth + 1, budget)))
        elif key.startswith("$"):
            raise FilterError(f"{here}: unknown operator {key!r} at the top of a filter (use $and, $or, $not, or a "
                              "field name)")
        else:
            parts.append(_compile_field(key, val, schema, here, depth, budget))
    return parts[0] if len(parts) == 1 else And(tuple(parts))


def _compile_field(name: str, val: Any, schema: Mapping[str, str], where: str, depth: int, budget: list[int]) -> Node:
    if name not in schema:
        raise FilterError(f"{where}: unknown field {name!r} (fields of this index: {', '.join(sorted(schema))})")
    kind = schema[name]
    if not isinstance(val, Mapping):
        _spend(budget, where)
        return _cmp(name, kind, "$eq", val, where)
    if not val:
        raise FilterError(f"{where}: an empty object of operators")
    parts: list[Node] = []
    for op, arg in val.items():
        here = f"{where}.{op}"
        if op == "$not":
            if depth + 1 > MAX_DEPTH:
                raise FilterError(f"{here}: nested too deep (at most {MAX_DEPTH} levels of $and/$or/$not)")
            _spend(budget, here)
            parts.append(Not(_compile_field(name, arg, schema, here, depth + 1, budget)))
            continue
        if op not in COMPARE_OPS:
            raise FilterError(f"{here}: unknown operator {op!r} (operators: {', '.join(COMPARE_OPS)}, $not)")
        _spend(budget, here)
        parts.append(_cmp(name, kind, op, arg, here))
    return parts[0] if len(parts) == 1 else And(tuple(parts))


def _scalar(kind: str, v: Any, where: str, *, tag: bool = False) -> Any:
    if kind in ("string", "tags"):
        if not isinstance(v, str):
            what = "a tag (a string)" if kind == "tags" else "a string"
            raise FilterError(f"{where}: field is {kind}, the value must be {what}; got {json.dumps(v)[:80]}")
        return v
    if kind == "number":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise FilterError(f"{where}: field is a number, the value must be a number; got {json.dumps(v)[:80]}")
        return float(v)
    try:
        return date_seconds(v)
    except FieldError:
        raise FilterError(f"{where}: field is a date, the value must be an ISO 8601 date (e.g. \"2020-03-01\") or "
                          f"seconds since the epoch; got {json.dumps(v)[:80]}") from None


def _cmp(name: str, kind: str, op: str, arg: Any, where: str) -> Cmp:
    if op not in OPS_BY_KIND[kind]:
        raise FilterError(f"{where}: {op} does not apply to field {name!r} of type {kind} "
                          f"(its operators: {', '.join(OPS_BY_KIND[kind])})")
    if op in ("$in", "$nin"):
        if not isinstance(arg, list):
            raise FilterError(f"{where}: {op} takes a list of values; got {json.dumps(arg)[:80]}")
        if len(arg) > MAX_LIST:
            raise FilterError(f"{where}: {len(arg)} values, at most {MAX_LIST}")
        vals = tuple(sorted({_scalar(kind, v, f"{where}[{i}]") for i, v in enumerate(arg)}))
        return Cmp(name, kind, op, vals)
    if isinstance(arg, (list, Mapping)):
        raise FilterError(f"{where}: {op} takes one value; got {json.dumps(arg)[:80]}")
    v = _scalar(kind, arg, where)
    if op == "$prefix" and name in PATH_FIELDS:
        v = v.rstrip("/") or "/"
    return Cmp(name, kind, op, v)


# ------------------------------------------------------------------------------------------ evaluating
class FieldTable:
    """The columns a filter reads, over the rows of one version (row order of ids.npy), built on first use
    from `load(name)` -> a :class:`Column`, or the stored values of that field (list of n), and kept."""

    def __init__(self, n: int, schema: Mapping[str, str], load: Any) -> None:
        self.n, self.schema, self._load = int(n), dict(schema), load
        self._cols: dict[str, Column] = {}

    def column(self, name: str) -> Column:
        col = self._cols.get(name)
        if col is None:
            got = self._load(name)
            col = got if isinstance(got, Column) else build_column(name, self.schema[name], got)
            if col.n != self.n:
                raise ValueError(f"field {name!r}: {col.n} values for {self.n} rows")
            self._cols[name] = col
        return col


def evaluate(f: Filter, table: FieldTable) -> np.ndarray:
    """The rows (n,) bool that pass `f`."""
    return _eval(f.root, table)


def _eval(node: Node, table: FieldTable) -> np.ndarray:
    if isinstance(node, Cmp):
        return _eval_cmp(node, table.column(node.field))
    if isinstance(node, Not):
        return ~_eval(node.part, table)
    out = _eval(node.parts[0], table)
    for p in node.parts[1:]:
        if isinstance(node, And):
            if not out.any():
                break
            out &= _eval(p, table)
        else:
            out |= _eval(p, table)
    return out


def _codes_of(col: Column, values: tuple[str, ...] | list[str]) -> np.ndarray:
    """The vocabulary codes (int32) of those of `values` the column has."""
    vocab = col.vocab
    if vocab is None or not len(vocab) or not len(values):
        return np.zeros(0, np.int32)
    v = np.asarray(list(values), dtype=object)
    pos = np.searchsorted(vocab, v)
    pos = np.clip(pos, 0, len(vocab) - 1)
    hit = vocab[pos] == v
    return pos[hit].astype(np.int32)


def _prefix_codes(col: Column, prefix: str) -> np.ndarray:
    vocab = col.vocab
    if vocab is None or not len(vocab):
        return np.zeros(0, np.int32)
    if col.name in PATH_FIELDS:
        base = prefix.rstrip("/")
        keep = [i for i, s in enumerate(vocab) if s == prefix or s == base or s.startswith(base + "/")]
    else:
        # the vocabulary is sorted: the strings with this prefix are one contiguous run
        lo = int(np.searchsorted(vocab, prefix, side="left"))
        keep = []
        for i in range(lo, len(vocab)):
            if not vocab[i].startswith(prefix):
                break
            keep.append(i)
    return np.asarray(keep, dtype=np.int32)


def _eval_cmp(c: Cmp, col: Column) -> np.ndarray:
    n = col.n
    if col.kind in ("number", "date"):
        x = col.values
        present = ~np.isnan(x)
        with np.errstate(invalid="ignore"):
            if c.op == "$eq":
                return x == c.value
            if c.op == "$ne":
                return ~(x == c.value)
            if c.op == "$gt":
                return x > c.value
            if c.op == "$gte":
                return x >= c.value
            if c.op == "$lt":
                return x < c.value
            if c.op == "$lte":
                return x <= c.value
        hit = np.isin(x, np.asarray(c.value, dtype=np.float64)) & present
        return hit if c.op == "$in" else ~hit
    if col.kind == "string":
        if c.op == "$prefix":
            want = _prefix_codes(col, c.value)
        else:
            want = _codes_of(col, c.value if isinstance(c.value, tuple) else (c.value,))
        # a lookup table over the vocabulary, shifted by one so that code -1 (no value) reads slot 0 (False)
        lut = np.zeros(len(col.vocab) + 1, dtype=bool)
        lut[want.astype(np.int64) + 1] = True
        hit = lut[col.codes.astype(np.int64) + 1] if want.size else np.zeros(n, dtype=bool)
        return ~hit if c.op in ("$ne", "$nin") else hit
    # tags: a row matches when any of its (row, tag) pairs has one of the wanted tags
    want = _codes_of(col, c.value if isinstance(c.value, tuple) else (c.value,))
    hit = np.zeros(n, dtype=bool)
    if want.size and col.codes is not None and col.codes.size:
        lut = np.zeros(len(col.vocab), dtype=bool)
        lut[want] = True
        hit[col.owner[lut[col.codes]]] = True
    return ~hit if c.op in ("$ne", "$nin") else hit
