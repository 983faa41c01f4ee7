"""The schemathesis driver the API tests share (tests/service/test_openapi_conformance.py, the robustness
campaign's tests/robustness/test_robust_hostile.py): every operation of an app's /openapi.json, positive and
negative data, every conformance check schemathesis registers, images a client following the document sends.

What JSON Schema cannot state is left out of the positive cases, and the server answers 422 for it by design:
`candidates >= k` (a comparison of two fields; the field's description says it) and the fields of a `filter`
(they are the served index's own columns, checked when the search compiles the filter).
"""

from __future__ import annotations

import io
import json
import math
import re
from typing import Any

from hypothesis import HealthCheck, Phase, assume, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from gare_serve.settings import Settings

# the longest side / shortest side the tests' servers accept (Settings.max_image_aspect's default)
MAX_ASPECT = int(Settings.model_fields["max_image_aspect"].default)
PIL_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP"}


def image_bytes(fmt: str) -> st.SearchStrategy[bytes]:
    """Small valid images of one format: what a client that follows the document's part Content-Types sends (the
    schema cannot say "a decodable PNG"; a media type strategy can)."""
    from PIL import Image

    @st.composite
    def one(draw: st.DrawFn) -> bytes:
        # within the document's words for the part: long side at most MAX_ASPECT x the short side (the server's
        # max_image_aspect default); a 48x2 image is refused with a 422 by design
        w = draw(st.integers(1, 48))
        h = draw(st.integers(-(-w // MAX_ASPECT), min(48, w * MAX_ASPECT)))
        colour = tuple(draw(st.integers(0, 255)) for _ in range(3))
        buf = io.BytesIO()
        Image.new("RGB", (w, h), colour).save(buf, format=fmt)
        return buf.getvalue()

    return one()


def register_image_media_types() -> None:
    import schemathesis

    for media_type, fmt in PIL_FORMATS.items():
        schemathesis.openapi.media_type(media_type, image_bytes(fmt))


# Left out: `ignored_auth`. It probes each operation with no key and a made-up one and expects 401/403 because the
# document lists the key schemes on every keyed route; a deployment leaves search open unless
# require_key_for_search (the document does not mark the schemes optional there), and with a valid key sent by
# the run its probes carry that key. Keys and roles have their own tests (test_key_roles.py).
NOT_SCHEMA_CHECKS = {"ignored_auth"}


def all_checks() -> list[Any]:
    """Every response check schemathesis registers but NOT_SCHEMA_CHECKS (built-in ones: server errors, status
    codes, content types, response schemas and headers, positive data accepted, negative data rejected, ...)."""
    from schemathesis.checks import CHECKS, load_all_checks

    load_all_checks()
    return [c for c in CHECKS.get_all() if callable(c) and not isinstance(c, type)
            and getattr(c, "__name__", "") not in NOT_SCHEMA_CHECKS]


def _ints(v: Any) -> list[int]:
    if isinstance(v, bool):
        return []
    if isinstance(v, int):
        return [v]
    if isinstance(v, dict):
        return [i for x in v.values() for i in _ints(x)]
    if isinstance(v, list):
        return [i for x in v for i in _ints(x)]
    return []


def _beyond_json_schema(case: Any) -> bool:
    """A positive case with candidates < k or with a filter (the rules the document states in words only), or an
    id of 2**63 or more: the document's exclusiveMaximum 9.223372036854776e18 is 2**63 exactly, but the generator
    and the checks compare in doubles, where 2**63 + 190 equals it (a tool's rounding, not the document's)."""
    body = case.body if isinstance(case.body, dict) else {}
    if "filter" in body:
        return True
    if any(i >= 2**63 for i in _ints(body) + _ints(dict(case.path_parameters or {}))):
        return True
    k, cand = body.get("k", 10), body.get("candidates")
    try:
        return cand is not None and int(cand) < int(k)
    except (TypeError, ValueError):
        return False


def form_properties(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """path -> the properties of its multipart/form-data body (the $ref resolved), from an OpenAPI document."""
    out = {}
    for path, item in doc.get("paths", {}).items():
        for op in item.values():
            body = (op.get("requestBody") or {}).get("content", {}).get("multipart/form-data") if isinstance(op, dict) else None
            if body:
                sch = body["schema"]
                if "$ref" in sch:
                    sch = doc["components"]["schemas"][sch["$ref"].rsplit("/", 1)[1]]
                out[path] = sch.get("properties", {})
    return out


def _same_bytes_as_a_valid_form(case: Any, props: dict[str, dict[str, Any]]) -> bool:
    """A negative multipart case that a form cannot tell from a valid one: a form sends text, so an empty array is
    no part at all (the same bytes as leaving the optional field out) and the string "7" the same part as the
    integer 7 (when 7 is within the field's bounds). No server can refuse those; a field sent twice (a two-element
    array) or a string that is not such an integer is still sent and refused."""
    media = getattr(case, "media_type", None) or ""
    body = case.body if isinstance(case.body, dict) else {}
    if not media.startswith("multipart/"):
        return False
    for name, v in body.items():
        if isinstance(v, list) and not v:
            return True
        p = props.get(name, {})
        if p.get("type") == "integer" and isinstance(v, str) and re.fullmatch(r"\s*[+-]?\d+\s*", v):
            n = int(v)
            if p.get("minimum", -math.inf) <= n <= p.get("maximum", math.inf):
                return True
    return False


def run_fuzz(app: Any, *, max_examples: int, derandomize: bool, headers: dict[str, str] | None = None,
             modes: tuple[str, ...] = ("positive", "negative")) -> dict[str, Any]:
    """Every operation of the app's /openapi.json through schemathesis with every check; returns the counts per
    operation and status, the 5xx count and the failed checks."""
    import schemathesis
    from schemathesis.core.failures import FailureGroup
    from schemathesis.generation import GenerationMode

    register_image_media_types()
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    forms = form_properties(schema.raw_schema)
    checks = all_checks()
    stats: dict[str, dict[str, int]] = {}
    failures: list[dict[str, Any]] = []

    def make_test(op: Any, mode: str) -> Any:
        @hsettings(max_examples=max_examples, deadline=None, derandomize=derandomize, database=None,
                   phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
        def one(case: Any) -> None:
            if mode == "positive":
                assume(not _beyond_json_schema(case))
            else:
                assume(not _same_bytes_as_a_valid_form(case, forms.get(case.path, {})))
            r = case.call(headers=headers)
            key = f"{op.label} [{mode}]"
            stats.setdefault(key, {})
            stats[key][str(r.status_code)] = stats[key].get(str(r.status_code), 0) + 1
            try:
                case.validate_response(r, checks=checks)
            except FailureGroup as fg:
                for f in fg.exceptions:
                    failures.append({"operation": op.label, "mode": mode, "status": r.status_code,
                                     "check": getattr(f, "title", type(f).__name__), "message": str(f)[:500],
                                     "curl": case.as_curl_command()[:500]})

        return one

    ops = [o.ok() for o in schema.get_all_operations()]
    for op in ops:
        for mode in modes:
            try:
                make_test(op, mode)()
            except Unsatisfiable:
                pass  # nothing to negate (GET /healthz has no parameters)
    total = sum(sum(v.values()) for v in stats.values())
    five = sum(n for v in stats.values() for c, n in v.items() if c.startswith("5"))
    return {"operations": len(ops), "requests": total, "5xx": five, "failures": failures, "stats": stats}


def assert_clean(out: dict[str, Any]) -> None:
    for name, r in out.items():
        assert r["requests"] > 0, name
        assert r["5xx"] == 0, (name, r["stats"])
        assert not r["failures"], (name, json.dumps(r["failures"][:6], indent=1))
