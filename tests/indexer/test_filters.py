"""The filter language (gare_index.filters) against a naive Python evaluation over random records, and its errors."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from gare_index.fields import FieldError, coerce, date_seconds, infer_type, merge_schema, parse_field_spec
from gare_index.filters import MAX_DEPTH, FieldTable, FilterError, compile_filter, evaluate

SCHEMA = {"channel": "string", "tags": "tags", "year": "number", "published": "date", "folder": "string"}
CHANNELS = ["news", "sport", "music", "newsroom", "film"]
TAGS = ["a", "b", "c", "d", "e"]
FOLDERS = ["/v", "/v/a", "/v/a/b", "/v/ab", "/w"]


def _records(rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        out.append({
            "channel": rng.choice(CHANNELS + [None]),
            "tags": None if rng.random() < 0.1 else sorted(set(rng.sample(TAGS, rng.randint(0, 3)))),
            "year": None if rng.random() < 0.1 else float(rng.randint(2015, 2024)),
            "published": None if rng.random() < 0.1 else f"20{rng.randint(15, 24)}-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}",
            "folder": rng.choice(FOLDERS),
        })
    return out


def _table(recs: list[dict]) -> FieldTable:
    def load(name: str) -> list:
        vals = [r[name] for r in recs]
        return [json.dumps(v) if name == "tags" and v is not None else v for v in vals]
    return FieldTable(len(recs), SCHEMA, load)


# ---- the naive reference: one record at a time, straight from the language's definition
def _cmp(kind: str, field: str, op: str, arg, x) -> bool:
    if kind == "date":
        arg = [date_seconds(a) for a in arg] if isinstance(arg, list) else date_seconds(arg)
        x = None if x is None else date_seconds(x)
    if x is None:
        return op in ("$ne", "$nin")
    if kind == "tags":
        has = set(x) & (set(arg) if isinstance(arg, list) else {arg})
        return bool(has) if op in ("$eq", "$in") else not has
    if op == "$eq":
        return x == arg
    if op == "$ne":
        return x != arg
    if op == "$in":
        return x in arg
    if op == "$nin":
        return x not in arg
    if op == "$prefix":
        if field == "folder":
            b = arg.rstrip("/")
            return x == b or x.startswith(b + "/")
        return x.startswith(arg)
    return {"$gt": x > arg, "$gte": x >= arg, "$lt": x < arg, "$lte": x <= arg}[op]


def naive(spec, rec) -> bool:
    ok = True
    for k, v in spec.items():
        if k == "$and":
            ok &= all(naive(s, rec) for s in v)
        elif k == "$or":
            ok &= any(naive(s, rec) for s in v)
        elif k == "$not":
            ok &= not naive(v, rec)
        elif isinstance(v, dict):
            for op, arg in v.items():
                ok &= (not naive({k: arg}, rec)) if op == "$not" else _cmp(SCHEMA[k], k, op, arg, rec[k])
        else:
            ok &= _cmp(SCHEMA[k], k, "$eq", v, rec[k])
    return ok


def _leaf(rng: random.Random) -> dict:
    field = rng.choice(list(SCHEMA))
    kind = SCHEMA[field]
    pick = {
        "string": lambda: rng.choice(CHANNELS + ["nope"]) if field == "channel" else rng.choice(FOLDERS),
        "tags": lambda: rng.choice(TAGS + ["z"]),
        "number": lambda: float(rng.randint(2014, 2025)) if rng.random() < 0.5 else rng.randint(2014, 2025),
        "date": lambda: f"20{rng.randint(15, 24)}-0{rng.randint(1, 9)}-15",
    }[kind]
    ops = {"string": ["$eq", "$ne", "$in", "$nin", "$prefix"], "tags": ["$eq", "$ne", "$in", "$nin"],
           "number": ["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin"],
           "date": ["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin"]}[kind]
    op = rng.choice(ops)
    if op == "$prefix" and field == "channel":
        return {field: {"$prefix": rng.choice(["new", "n", "sp", "x"])}}
    arg = [pick() for _ in range(rng.randint(0, 3))] if op in ("$in", "$nin") else pick()
    if op == "$eq" and rng.random() < 0.5:
        return {field: arg}
    if rng.random() < 0.1:
        return {field: {"$not": {op: arg}}}
    return {field: {op: arg}}


def _spec(rng: random.Random, depth: int = 0) -> dict:
    r = rng.random()
    if depth >= 3 or r < 0.4:
        return _leaf(rng)
    if r < 0.6:
        return {"$and": [_spec(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if r < 0.8:
        return {"$or": [_spec(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if r < 0.9:
        return {"$not": _spec(rng, depth + 1)}
    out: dict = {}
    for _ in range(3):
        out.update(_leaf(rng))
    return out


def test_filters_match_a_naive_evaluation_over_random_records():
    rng = random.Random(7)
    recs = _records(rng, 400)
    table = _table(recs)
    seen = set()
    for _ in range(600):
        spec = _spec(rng)
        mask = evaluate(compile_filter(spec, SCHEMA), table)
        want = np.array([naive(spec, r) for r in recs])
        assert np.array_equal(mask, want), spec
        seen.add(int(want.sum()) // 40)
    assert len(seen) >= 8  # the random filters span selectivities from none to all


@pytest.mark.parametrize("spec, words", [
    ({"chanel": "news"}, ["filter.chanel", "unknown field 'chanel'"]),
    ({"year": "2020"}, ["filter.year", "number"]),
    ({"year": {"$prefix": "20"}}, ["filter.year.$prefix", "does not apply", "number"]),
    ({"channel": {"$gt": "a"}}, ["filter.channel.$gt", "does not apply"]),
    ({"published": {"$gte": "March 2020"}}, ["filter.published.$gte", "ISO 8601"]),
    ({"tags": {"$in": "sport"}}, ["filter.tags.$in", "list"]),
    ({"$or": []}, ["filter.$or", "non-empty list"]),
    ({"$or": [{"channel": "a"}, {"chanel": "b"}]}, ["filter.$or[1].chanel"]),
    ({"channel": {"$regex": "a"}}, ["filter.channel.$regex", "unknown operator"]),
    ({"$nor": [{"channel": "a"}]}, ["filter.$nor", "unknown operator"]),
    ({"year": {"$eq": True}}, ["filter.year.$eq", "number"]),
    ({}, ["empty object"]),
    ([1], ["must be a JSON object"]),
    ({"year": {"$in": list(range(2000))}}, ["2000 values"]),
])
def test_bad_filters_name_the_problem(spec, words):
    with pytest.raises(FilterError) as e:
        compile_filter(spec, SCHEMA)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_too_deep_and_too_long():
    spec: dict = {"channel": "news"}
    for _ in range(MAX_DEPTH + 1):
        spec = {"$not": spec}
    with pytest.raises(FilterError, match="too deep"):
        compile_filter(spec, SCHEMA)
    wide = {"$or": [{"year": i} for i in range(400)]}
    with pytest.raises(FilterError, match="too long"):
        compile_filter(wide, SCHEMA)
    huge = {"channel": {"$in": ["x" * 100] * 500}}
    with pytest.raises(FilterError, match="too long"):
        compile_filter(huge, SCHEMA)


def test_canonical_text_keys_the_cache():
    a = compile_filter({"year": {"$gte": 2020}, "channel": "news"}, SCHEMA)
    b = compile_filter({"channel": "news", "year": {"$gte": 2020}}, SCHEMA)
    c = compile_filter({"channel": "news", "year": {"$gte": 2021}}, SCHEMA)
    assert a.text == b.text != c.text


def test_field_types_inference_and_coercion():
    assert parse_field_spec("channel:string, tags:tags,year:number,published:date") == {
        "channel": "string", "tags": "tags", "year": "number", "published": "date"}
    with pytest.raises(FieldError, match="unknown type 'int'"):
        parse_field_spec("year:int")
    with pytest.raises(FieldError, match="reserved"):
        parse_field_spec("duration:number")
    assert infer_type("y", ["2020", "2021", ""]) == "number"
    assert infer_type("d", ["2020-03-01", "2021-01-02T10:00:00Z"]) == "date"
    assert infer_type("t", [["a"], None]) == "tags"
    assert infer_type("s", ["x", "2020"]) == "string"
    assert coerce("t", "tags", "b|a|b") == '["a", "b"]'
    assert coerce("t", "tags", '["x"]') == '["x"]'
    with pytest.raises(FieldError, match="field 'y' is a number; got 'abc'"):
        coerce("y", "number", "abc")
    assert merge_schema(None, {"a": "string"}, [{"b": "1"}, {"b": "2.5"}], adding=False) == {"a": "string", "b": "number"}
    with pytest.raises(FieldError, match=r"columns \['c'\]"):
        merge_schema({"a": "string"}, {}, [{"c": "x"}], adding=True)
    with pytest.raises(FieldError, match="a: string in the index, number here"):
        merge_schema({"a": "string"}, {"a": "number"}, [], adding=True)


def test_captions_and_objects_are_left_out_of_the_fields_unless_declared():
    """A caption manifest (gare-train's format: captions plus an attributes object) builds: its captions and
    objects are not fields; a declared column must still fit its type."""
    from gare_index.fields import ignored_columns

    rows = [{"captions": ["a dog"], "attributes": {"background": "white"}, "channel": "news", "flag": True},
            {"captions": ["a cat"], "attributes": {"background": "gray"}, "channel": "sport", "flag": False}]
    ign = ignored_columns(rows, {})
    assert set(ign) == {"captions", "attributes", "flag"} and "objects" in ign["attributes"]
    kept = [{k: v for k, v in r.items() if k not in ign} for r in rows]
    assert merge_schema(None, {}, kept, adding=False) == {"channel": "string"}
    assert ignored_columns(rows, {"captions": "tags"}).keys() == {"attributes", "flag"}  # declared: kept, typed
