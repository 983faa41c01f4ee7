"""The README demo (gare_demo.demo): every stage real (generated mp4 files, gare-cpu-demo-cnn trained here, a real
index with the generator's fields), its run record, the second run reusing everything, the suggested queries,
filters on the library's fields over HTTP, and (slow) the held-out quality it promises, measured over HTTP."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from gare.checkpoint import read_checkpoint
from gare.config import get_model_config
from gare_demo import demo
from gare_index.fields import BUILTIN_FIELDS
from gare_index.store import open_index
from gare_serve.app import create_app
from gare_serve.settings import Settings


def _client(index, corpus) -> TestClient:
    # the demo's own serving settings (gare_demo.main -> gare-serve: defaults, the corpus as library root)
    return TestClient(create_app(Settings(index=index, library_root=corpus, trusted_hosts="testserver")))


def _post(client: TestClient):
    def post(path: str, body: dict) -> dict:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    return post


def test_demo_stages_then_a_second_run_reuses_them(tmp_path, monkeypatch):
    root = tmp_path / "demo"
    index, corpus, examples = demo.prepare(root, n_videos=24, epochs=1)
    rec = json.loads((root / demo.RUN_FILE).read_text())
    assert [s["name"] for s in rec["stages"]] == ["corpus", "training", "index", "held-out check"]
    assert not any(s["reused"] for s in rec["stages"])
    train = rec["stages"][1]
    assert train["model"] == demo.DEMO_MODEL == "gare-cpu-demo-cnn" and train["epochs_run"] == 1
    assert len(list((corpus / "videos").glob("*.mp4"))) == 24 and (index / "CURRENT").is_file()
    # the demo's model is the registered one with the demo's overrides (none: 32 px frames), as the checkpoint records
    ckpt = read_checkpoint(root / "model" / "best.safetensors")
    assert ckpt.config == get_model_config(demo.DEMO_MODEL, **demo.DEMO_MODEL_OVERRIDES) and ckpt.config.image_size == 32
    held = [c for c, _ in demo.heldout_captions(corpus)]
    q = rec["heldout"]
    assert q["queries"] == len(held) > 0 and 0 <= q["hits"] <= q["queries"] and q["k"] == 10
    ranks = q["ranks"]
    assert len(ranks) == len(held) and all(0 <= r <= 10 for r in ranks)
    assert q["recall"] == {str(k): sum(0 < r <= k for r in ranks) for k in (1, 5, 10)} and q["recall"]["10"] == q["hits"]
    # the suggestions are held-out captions, those found first ahead of the others, the corpus order within each
    firsts = [c for c, r in zip(held, ranks, strict=True) if r == 1]
    assert examples == (firsts + [c for c, r in sorted(zip(held, ranks, strict=True), key=lambda t: t[1] or 99)
                                  if r != 1])[:4]
    # the held-out check is the served search: recomputing it gives the same ranks, and so does the HTTP API
    again = demo.heldout_quality(index, corpus, root / "model" / "best.safetensors")
    assert again["ranks"] == ranks

    # nothing is rebuilt: generating, training, indexing or the held-out search would fail the second run
    def rebuilt(*args, **kwargs):
        raise AssertionError("the second run rebuilt a stage")

    for name in ("generate_corpus", "Trainer", "index_main", "heldout_quality"):
        monkeypatch.setattr(demo, name, rebuilt)
    outputs = [root / "model" / "best.safetensors", index / "CURRENT", root / demo.QUALITY_FILE]
    before = [(p.stat().st_mtime_ns, p.read_bytes()) for p in outputs]
    assert demo.prepare(root, n_videos=24, epochs=1)[2] == examples
    assert [(p.stat().st_mtime_ns, p.read_bytes()) for p in outputs] == before
    rec2 = json.loads((root / demo.RUN_FILE).read_text())
    assert all(s["reused"] for s in rec2["stages"]) and rec2["heldout"] == q


def test_demo_library_fields_filter_over_http(tmp_path):
    """Every video carries the generator's attributes as fields; a filter on them returns exactly the videos
    the generator drew that way (compared with captions.jsonl, not with the manifest the index was built from)."""
    root = tmp_path / "demo"
    index, corpus, _ = demo.prepare(root, n_videos=24, epochs=1)
    attrs = {}
    with open(corpus / "captions.jsonl") as fh:
        for line in fh:
            rec = json.loads(line)
            attrs[rec["video"].split("/")[-1]] = rec["attributes"]
    with _client(index, corpus) as c:
        post = _post(c)
        with open_index(index) as version:
            assert {f: t for f, t in version.field_schema.items() if f not in BUILTIN_FIELDS} == {
                "background": "string", "colors": "tags", "shapes": "tags", "motions": "tags", "speeds": "tags",
                "objects": "number", "events": "number", "split": "string"}

        def found(flt: dict) -> set[str]:
            body = post("/v1/search", {"query": "a shape moves", "k": 24, "filter": flt})
            return {hit["metadata"]["path"].split("/")[-1] for hit in body["results"]}

        for bg in sorted({a["background"] for a in attrs.values()}):
            assert found({"background": bg}) == {n for n, a in attrs.items() if a["background"] == bg}, bg
        shape = attrs["video0.mp4"]["events"][0]["shape"]
        assert found({"shapes": {"$in": [shape]}}) == {
            n for n, a in attrs.items() if any(e["shape"] == shape for e in a["events"])}
        assert found({"objects": {"$gte": 3}}) == {
            n for n, a in attrs.items() if sum(e["count"] for e in a["events"]) >= 3}
        assert found({"events": 2, "split": "test"}) == {
            n for n, a in attrs.items() if len(a["events"]) == 2 and a["split"] == "test"}
        # the HTTP API ranks the held-out captions as the offline check did
        q = json.loads((root / demo.QUALITY_FILE).read_text())
        assert demo.heldout_recall_over_api(post, corpus)["ranks"] == q["ranks"]


@pytest.mark.slow
def test_demo_model_finds_held_out_captions(tmp_path):
    """The README demo as it runs (200 videos, its epoch budget), measured over HTTP with the demo's serving
    settings: of the 40 held-out captions, the right video first for at least 20, in the top 5 for at least 37 and
    in the top 10 for at least 37 (two full runs measured R@1 27, R@5 40, R@10 40; seed 1 gave 22, 39, 40; the bar
    leaves room for another machine's floats)."""
    root = tmp_path / "demo"
    index, corpus, examples = demo.prepare(root, n_videos=200, epochs=demo.DEFAULT_EPOCHS)
    with _client(index, corpus) as c:
        q = demo.heldout_recall_over_api(_post(c), corpus)
    assert q["queries"] == 40 and q["recall"]["10"] >= 37 and q["recall"]["5"] >= 37 and q["recall"]["1"] >= 20, q
    # the first suggestion (the curl example the demo prints) was ranked first offline; over HTTP (the int8 text
    # tower by default on the CPU) it stays near the top
    assert 0 < q["ranks"][[c for c, _ in demo.heldout_captions(corpus)].index(examples[0])] <= 5, q
