"""The evidence checks, the one test module that reads bench/ (tests/test_layers.py allows no other).

Three kinds only:
- each generated report equals what its script renders from the committed JSON (no hand edits; rerun the
  script's --render / --render-only to refresh a report after changing its renderer);
- each "auto" default of the product equals the winner of the committed measurement it follows (a rerun that
  changes the winner fails here until the default follows it);
- the functions a report's verdict rests on, against hand-computed cases (the peer report's recall matching).
A report's wording, a README phrase or a figure quoted in prose is never tested here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest

from bench import (
    frames_int8,
    gpu_bench,
    peer_clip_retrieval,
    quickstart,
    ray_faults,
    robustness,
    serve_bench,
    serve_http,
    sharded,
    stage1_peers,
    worker_spread,
)
from gare.text_quant import DEFAULT_CPU_TEXT_ENCODER, DEFAULT_CUDA_TEXT_ENCODER
from gare_search.query import resolve_precision
from gare_search.search import NCL_DEFAULT

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RESULTS = BENCH / "results"


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        pytest.fail(f"{path.relative_to(REPO)} is missing: run the bench script that writes it", pytrace=False)
    return json.loads(path.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------ generated report == render(JSON)
REPORTS: list[tuple[str, Callable[[dict], str], Path, Path]] = [
    ("quickstart", quickstart.markdown, RESULTS / "quickstart.json", REPO / "docs" / "quickstart-times.md"),
    ("serve_bench", serve_bench.markdown, RESULTS / "serve_bench.json", RESULTS / "serve_bench.md"),
    ("serve_http", serve_http.markdown, RESULTS / "serve_http.json", RESULTS / "serve_http.md"),
    ("sharded", sharded.markdown, RESULTS / "sharded.json", RESULTS / "sharded.md"),
    ("worker_spread", worker_spread.markdown, RESULTS / "worker_spread.json", RESULTS / "worker_spread.md"),
    ("peer_clip_retrieval", peer_clip_retrieval.markdown, RESULTS / "peer_clip_retrieval.json",
     RESULTS / "peer_clip_retrieval.md"),
    ("robustness", robustness.results_md, RESULTS / "robustness.json", RESULTS / "robustness.md"),
    ("ray_faults", ray_faults.markdown, RESULTS / "ray_faults.json", RESULTS / "ray_faults.md"),
    ("frames_int8", frames_int8.markdown, RESULTS / "frames_int8.json", RESULTS / "frames_int8.md"),
    ("stage1_peers", stage1_peers.markdown, RESULTS / "stage1_peers.json", RESULTS / "stage1_peers.md"),
]


@pytest.mark.parametrize(("name", "render", "src", "report"), REPORTS, ids=[r[0] for r in REPORTS])
def test_generated_report_is_the_render_of_its_json(name, render, src, report):
    assert report.read_text(encoding="utf-8") == render(_json(src)), (
        f"{report.relative_to(REPO)} differs from what bench/{name}.py renders from {src.relative_to(REPO)}")


def test_current_gpu_report_is_the_render_of_its_json():
    """bench/results/gpu_bench.md is what bench/gpu_bench.py renders from its JSON (targets included). The earlier
    runs under bench/results/history/ stay as they were written, whatever the renderer has become."""
    src = RESULTS / "gpu_bench.json"
    if not src.exists():
        pytest.skip("no current GPU report yet: one run of bench/gpu_check.sh on a lent GPU writes it")
    assert (RESULTS / "gpu_bench.md").read_text(encoding="utf-8") == gpu_bench.markdown(_json(src))


def test_robustness_page_block_is_the_render_of_its_json():
    """docs/robustness.md: the block between the generator's markers is what bench/robustness.py writes there."""
    page = (REPO / "docs" / "robustness.md").read_text(encoding="utf-8")
    block = page.split(robustness.START, 1)[1].split(robustness.END, 1)[0]
    data = _json(RESULTS / "robustness.json")
    assert block == robustness.page_block(data)


# ------------------------------------------------------------------------------ auto default == measured winner
def _gpu_section(name: str) -> dict[str, Any]:
    """Section `name` of the newest committed full GPU run (bench/results/gpu_bench.json, or the earlier runs in
    bench/results/history/, by date) that ran it: a run may leave a section out (the fidelity inputs did not travel
    to every lent GPU)."""
    paths = [*RESULTS.glob("gpu_bench*.json"), *(RESULTS / "history").glob("gpu_bench*.json")]
    runs = sorted((_json(p) for p in paths), key=lambda r: r["date"], reverse=True)
    assert runs and not runs[0]["quick"], "the committed GPU figures must come from a full run"
    for res in runs:  # a section the run listed as not run (no inputs, no time left) did not measure anything
        if not res["quick"] and name in res["sections"] and not res["sections"][name].get("skipped"):
            return res["sections"][name]
    pytest.fail(f"no committed GPU run has a {name!r} section", pytrace=False)


def test_cpu_text_encoder_default_is_the_measured_choice():
    """`text_encoder: auto` on the CPU serves DEFAULT_CPU_TEXT_ENCODER: the choice bench/text_encoder.py made by
    the rule its report states."""
    assert DEFAULT_CPU_TEXT_ENCODER == _json(RESULTS / "text_encoder.json")["choice"]["default"]


def test_cuda_precision_default_follows_the_measured_rule():
    """`precision: auto` on CUDA (gare_search.query.AUTO_PRECISION) is fp32, the exact one, unless a half precision
    of the model's own tower was faster at both 1 and 32 queries per call (then the fastest of those at 1 + 32)."""
    te = _gpu_section("text_encoder")
    assert te["ok"], te.get("error")
    ms = {b: {r["precision"]: r["ms_per_call"] for r in te["result"]["rows"]
              if r["batch"] == b and r.get("impl", "model") == "model"} for b in (1, 32)}
    assert all(set(m) == {"fp32", "fp16", "bf16"} for m in ms.values()), ms
    faster = [p for p in ("fp16", "bf16") if all(ms[b][p] < ms[b]["fp32"] for b in ms)]
    want = min(faster, key=lambda p: ms[1][p] + ms[32][p]) if faster else "fp32"
    assert resolve_precision("auto", "cuda") == want, ms


def test_cuda_precision_default_kept_the_measured_accuracy():
    """The precision chosen on CUDA kept R@1 (+psi) within 0.5 point of CPU fp32 on the benchmark model."""
    fi = _gpu_section("fidelity")
    assert fi["ok"], fi.get("error")
    got = fi["result"]["precisions"][resolve_precision("auto", "cuda")]["psi"]["R1"]
    assert abs(got - fi["result"]["cpu_reference"]["psi"]["R1"]) <= 0.5


def test_cuda_text_encoder_default_is_the_fastest_faithful_one_measured():
    """DEFAULT_CUDA_TEXT_ENCODER (what `text_encoder: auto` serves on CUDA at fp32): of the model's own fp32 tower
    and the half-precision towers, the least time at one query plus 32 among those whose R@1 (+psi) on the
    benchmark model stayed within 0.5 point of CPU fp32."""
    rows = _gpu_section("text_encoder")["result"]["rows"]
    fid = _gpu_section("fidelity")["result"]
    ref = fid["cpu_reference"]["psi"]["R1"]
    # the encoders `text_encoder` offers on CUDA (gare_search.text_encoder): the model's own and the fp16 tower
    names = {"fp32": ("model", "fp32", "fp32"), "fp16": ("tower", "fp16", "fp16 tower")}
    cost = {}
    for kind, (impl, prec, fid_name) in names.items():
        if abs(fid["precisions"][fid_name]["psi"]["R1"] - ref) > 0.5:
            continue
        cost[kind] = sum(r["ms_per_call"] for r in rows
                         if r.get("impl", "model") == impl and r["precision"] == prec and r["batch"] in (1, 32))
    assert DEFAULT_CUDA_TEXT_ENCODER == min(cost, key=cost.get), cost


def test_frames_default_is_the_measured_choice():
    """A new index stores its frames as bench/results/frames_int8.md chose by its stated rule."""
    from gare_index.frame_quant import DEFAULT_FRAME_DTYPE

    assert DEFAULT_FRAME_DTYPE == _json(RESULTS / "frames_int8.json")["choice"]["default"]


def test_ncl_default_follows_the_served_bias_measurements():
    """`ncl` is on only if + psi + NCL(served dense) >= + psi in t2v R@1 and R@5 on both benchmark corpora
    (bench/ncl_served.py accuracy)."""
    verdicts = {}
    for name in ("bench", "corpus2"):
        data = _json(RESULTS / "ncl_served" / f"{name}.json")
        psi, served = data["rows"]["+ psi"]["t2v"], data["rows"]["+ psi + NCL(served dense)"]["t2v"]
        verdicts[name] = served["R1"] >= psi["R1"] and served["R5"] >= psi["R5"]
        assert data["served_dense_ge_psi"] == verdicts[name], name  # the report's verdict is its rows'
    assert NCL_DEFAULT == all(verdicts.values()), verdicts


def test_the_committed_ray_fault_campaign_is_the_targets_and_its_verdict_is_its_observations():
    """bench/results/ray_faults.json (linked from the README's Ray section) ran the campaign of issue 41's target:
    two replicas per shard, one replica killed at a time every <= 10 s, the product's shard timeout; its verdict is
    PASS exactly when every recorded check held, and the answers it counted agree with those checks."""
    from gare_serve.ray_serve.deployment import SHARD_TIMEOUT_S  # Ray is a test requirement (tests/serve_ray)

    data = _json(RESULTS / "ray_faults.json")
    cfg, verdict, summary = data["config"], data["verdict"], data["summary"]
    assert cfg["replicas"] >= 2 and cfg["kill"] == "one" and cfg["kill_every"] <= 10.0
    assert cfg["shard_timeout_s"] == SHARD_TIMEOUT_S
    assert verdict["verdict"] == ("PASS" if all(c["ok"] for c in verdict["checks"]) else "FAILED")
    checks = {c["what"]: c["observed"] for c in verdict["checks"]}
    assert checks["wrong answers"] == summary["wrong"] and checks["partial answers"] == summary["partial"]


# the peer report's recall matching (bench.peer_clip_retrieval): each server is scored against its own exact
# top-10, and the peer's matched efSearch is the smallest reaching gare-serve's recall, written into the copy it serves
def test_top10_is_the_ten_best_in_order():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((7, 500)).astype(np.float32)
    assert np.array_equal(peer_clip_retrieval.top10(s), np.argsort(-s, axis=1, kind="stable")[:, :10])


def test_recall_at_10_counts_the_exact_answers_found():
    exact = [list(range(10)), list(range(10, 20))]
    got = [[0, 1, 2, 3, 4, 5, 6, 7, 8, 99], list(range(20, 30))]  # 9 of 10, then 0 of 10
    assert peer_clip_retrieval.recall_at_10(got, exact) == 0.45
    assert peer_clip_retrieval.recall_at_10(exact, exact) == 1.0


def test_the_matched_ef_is_the_smallest_reaching_the_target_and_the_copy_serves_it(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3000, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = rng.standard_normal((40, 32)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    index = faiss.IndexHNSWFlat(32, 8, faiss.METRIC_INNER_PRODUCT)  # few links: recall rises visibly with efSearch
    index.add(x)
    index.hnsw.efSearch = 400  # the file's own ("autofaiss's") setting
    (tmp_path / "peer_index" / "metadata").mkdir(parents=True)
    faiss.write_index(index, str(tmp_path / "peer_index" / "image.index"))
    np.save(tmp_path / "peer_queries.npy", q)
    exact = peer_clip_retrieval.top10(q @ x.T).tolist()

    def recall(ef: int) -> float:
        index.hnsw.efSearch = ef
        return peer_clip_retrieval.recall_at_10(index.search(q, 10)[1].tolist(), exact)

    target = recall(24)
    assert target < recall(400)  # the test means something: a smaller efSearch loses recall here
    got = peer_clip_retrieval.choose_ef(tmp_path, exact, target)
    m = got["matched_ef"]
    assert got["reached"] and got["default_ef"] == 400 and got["default_recall"] == recall(400)
    assert got["matched_recall"] == recall(m) >= target
    assert m <= 24 and recall(m - 1) < target  # the smallest: one less misses the target
    served = faiss.read_index(str(tmp_path / "peer_index_matched" / "image.index"))
    assert faiss.downcast_index(served).hnsw.efSearch == m  # what clip-retrieval loads
    assert (tmp_path / "peer_index_matched" / "metadata").resolve() == (tmp_path / "peer_index" / "metadata").resolve()
