"""The OpenAPI document says what the server accepts: property-based fuzzing (schemathesis) of every operation
with every conformance check, positive_data_acceptance ("valid data should have been accepted") and
negative_data_rejection ("invalid data should have been rejected") among them, with API keys off, on (an admin
key sent) and required for search (a search key sent, and none); and the requests the document used to allow
while the server refused them, one by one.

What JSON Schema cannot state is left out of the positive cases here, and the server answers 422 for it by
design: `candidates >= k` (a comparison of two fields; the field's description says it) and the fields of a
`filter` (they are the served index's own columns, checked when the search compiles the filter; the document
describes them in words).

Fast: a derandomised run of a few examples per operation; the robustness campaign's slow run
(tests/robustness/test_robust_hostile.py, `-m slow`) sends many more through the same driver
(tests/service/openapi_fuzz.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from gare_serve.app import create_app
from tests.service.openapi_fuzz import PIL_FORMATS, assert_clean, run_fuzz
from tests.service.support import copy_index, png_bytes, settings

ADMIN = "conformance-admin-key"
SEARCH = "conformance-search-key"


def fuzz_all(index: Any, *, max_examples: int, derandomize: bool) -> dict[str, Any]:
    """The four key setups: keys off (none configured), keys on (an admin key sent), search needing a key (a
    search key sent; and none sent)."""
    try:
        from schemathesis.python.asgi import shutdown_lifespans
    except ImportError:  # pragma: no cover - older schemathesis
        def shutdown_lifespans() -> None:
            return None

    out: dict[str, Any] = {}
    try:
        out["keys_off"] = run_fuzz(create_app(settings(index)), max_examples=max_examples, derandomize=derandomize)
        keyed = create_app(settings(index, admin_keys=ADMIN, search_keys=SEARCH))
        out["keys_on_admin"] = run_fuzz(keyed, max_examples=max_examples, derandomize=derandomize,
                                        headers={"Authorization": f"Bearer {ADMIN}"})
        required = create_app(settings(index, admin_keys=ADMIN, search_keys=SEARCH, require_key_for_search=True))
        out["search_key_required"] = run_fuzz(required, max_examples=max_examples, derandomize=derandomize,
                                              headers={"X-API-Key": SEARCH})
        out["search_key_required_none_sent"] = run_fuzz(required, max_examples=max(3, max_examples // 3),
                                                        derandomize=derandomize, modes=("positive",))
    finally:
        shutdown_lifespans()
    return out


@pytest.fixture(scope="module")
def index(service_env, tmp_path_factory):
    return copy_index(service_env["index"], tmp_path_factory.mktemp("conformance") / "index")


def test_fuzz_every_check_keys_off_and_on(index):
    out = fuzz_all(index, max_examples=10, derandomize=True)
    print({name: (r["requests"], r["5xx"], len(r["failures"])) for name, r in out.items()})
    assert_clean(out)


# ------------------------------------------------------------------ what the document used to allow
@pytest.fixture(scope="module")
def client(index):
    with TestClient(create_app(settings(index)), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("body,accepted", [
    ({}, False),  # before: valid per the document (no field required), refused by the server
    ({"query": "a red circle", "k": 3.0}, True),  # before: an integer per JSON Schema, refused by the server
    ({"query": "a red circle", "k": 3.5}, False),
    ({"query": None, "video_id": 1}, False),  # null is no kind of query: refused by both now
    ({"query": "   "}, False),  # blank: the pattern says so now
    ({"video_id": 2**63}, False),  # one past int64: the float bound 9.223372036854776e18 let it through
    ({"query": "a red circle", "video_id": 1}, False),
])
def test_search_body_schema_and_server_agree(client, body, accepted):
    import jsonschema

    doc = client.get("/openapi.json").json()
    schema = {**doc["components"]["schemas"]["SearchRequest"], "components": doc["components"]}
    valid = jsonschema.Draft202012Validator(schema).is_valid(body)
    r = client.post("/v1/search", json=body)
    assert valid is accepted, (body, "schema")
    assert (r.status_code == 200) is accepted, (body, r.status_code, r.text)


def test_image_part_schema_declares_what_the_server_takes(client):
    doc = client.get("/openapi.json").json()
    content = doc["paths"]["/v1/search/image"]["post"]["requestBody"]["content"]["multipart/form-data"]
    types = {t.strip() for t in content["encoding"]["image"]["contentType"].split(",")}
    assert types == set(PIL_FORMATS)  # before: no encoding (any part Content-Type, or none, looked valid)
    body = doc["components"]["schemas"][content["schema"]["$ref"].rsplit("/", 1)[1]]
    assert body["properties"]["image"]["minLength"] == 1  # before: an empty part looked valid
    assert body["properties"]["candidates"]["type"] == "integer"  # a form cannot send null
    # and the server refuses exactly those
    assert client.post("/v1/search/image", files={"image": ("x.png", b"", "image/png")}).status_code == 422
    r = client.post("/v1/search/image", files={"image": ("x.bin", b"\x89PNG", "application/octet-stream")})
    assert r.status_code == 415, r.text


def _patterns(doc: dict[str, Any]) -> set[str]:
    schemas = doc["components"]["schemas"]
    return {schemas["SearchRequest"]["properties"]["query"]["pattern"],
            schemas["BatchSearchRequest"]["properties"]["queries"]["items"]["pattern"]}


def test_query_pattern_means_the_servers_blank_in_json_schemas_own_regex_dialect(client):
    """JSON Schema's `pattern` is an ECMA-262 regular expression (what fuzzers and other languages' validators
    follow), run here by Node.js over every code point: it must pass exactly the characters that are not white
    space as the server strips them (str.isspace). Before: `\\S`, which in ECMA-262 passes U+0085 and U+001C-U+001F
    (a query of "\\u0085\\u0085" was valid by the document, 422 from the server) and refuses U+FEFF."""
    import json
    import shutil
    import subprocess

    from tests.conftest import require

    node = shutil.which("node")
    require(node is not None, "node (Node.js) runs the document's patterns as ECMA-262 regular expressions")
    (pattern,) = _patterns(client.get("/openapi.json").json())
    script = ("const p = new RegExp(process.argv[1], 'u'); const out = [];"
              "for (let c = 0; c < 0x110000; c++) { if (c >= 0xd800 && c < 0xe000) continue;"
              " if (p.test(String.fromCodePoint(c))) out.push(c); } console.log(JSON.stringify(out));")
    got = subprocess.run([node, "-e", script, pattern], capture_output=True, text=True, timeout=120, check=True)
    passed = set(json.loads(got.stdout))
    text = {c for c in range(0x110000) if not 0xD800 <= c < 0xE000 and not chr(c).isspace()}
    assert passed == text, (sorted(passed - text)[:10], sorted(text - passed)[:10])
    for blank in ("\u0085\u0085", "\x1c", " \u3000 "):  # and the server refuses exactly those
        assert client.post("/v1/search", json={"query": blank}).status_code == 422, repr(blank)
        assert client.post("/v1/search/batch", json={"queries": ["a red circle", blank]}).status_code == 422
    assert client.post("/v1/search", json={"query": "\ufeff"}).status_code == 200  # not white space to either


def test_an_image_form_field_sent_twice_is_refused(client):
    """The document says `candidates` is one integer; two parts named candidates are an array, which the form
    parser used to reduce to one of them (200). Now 422 naming the field."""
    png = png_bytes()
    r = client.post("/v1/search/image", files=[("image", ("a.png", png, "image/png"))],
                    data={"candidates": ["20", "30"]})
    assert r.status_code == 422 and "candidates" in r.text, r.text
    r = client.post("/v1/search/image", files=[("image", ("a.png", png, "image/png")),
                                               ("image", ("b.png", png, "image/png"))])
    assert r.status_code == 422 and "image" in r.text, r.text
    assert client.post("/v1/search/image", files={"image": ("a.png", png, "image/png")},
                       data={"candidates": "20"}).status_code == 200

