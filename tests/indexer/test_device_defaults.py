"""The "auto" defaults of the search follow the committed measurements, per device type.

- rerank on the CPU: the fold (bench/results/psi_fold.json: faster than fused at K = 256, one thread);
- rerank on CUDA: the faster in the two-stage search as served on the lent GPU (bench/results/gpu_bench.json);
- text-encoder precision on CUDA: the faster on that GPU at one query and at 32 (the service's micro-batches
  stay at or below that).
A rerun that changes the winner fails here until the constant in gare_search/search.py follows it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gare_search import search as S

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _gpu_sections() -> dict:
    res = json.loads((RESULTS / "gpu_bench.json").read_text())
    assert not res["quick"], "the committed GPU figures must come from a full run"
    return res["sections"]


def test_cpu_rerank_default_is_the_faster_path_measured():
    rr = json.loads((RESULTS / "psi_fold.json").read_text())["rerank"]
    faster = min(("fold", "fused", "model"), key=lambda k: rr[k]["median_s"])
    assert S.AUTO_RERANK_IMPL["cpu"] == faster
    assert S.resolve_rerank_impl("auto", "cpu") == faster


def test_cuda_rerank_default_is_the_faster_path_in_the_served_search():
    """On CUDA the choice is made on the search as served (candidates gathered from the memory-mapped index):
    the implementation with the least total search time over one query and a batch of 32."""
    se = _gpu_sections()["search"]
    assert se["ok"], se.get("error")
    total: dict[str, float] = {}
    for row in se["result"]["rows"]:
        if row["rerank_impl"] in ("fold", "fused", "model"):
            total[row["rerank_impl"]] = total.get(row["rerank_impl"], 0.0) + row["search_ms"]
    assert {"fold", "fused"} <= set(total)
    assert S.AUTO_RERANK_IMPL["cuda"] == min(total, key=total.get), total
    assert S.resolve_rerank_impl("auto", "cuda") == S.AUTO_RERANK_IMPL["cuda"]


@pytest.mark.parametrize("batch", [1, 32])
def test_cuda_text_precision_default_is_the_faster_one_measured(batch):
    te = _gpu_sections()["text_encoder"]
    assert te["ok"], te.get("error")
    ms = {r["precision"]: r["ms_per_call"] for r in te["result"]["rows"]
          if r["batch"] == batch and r.get("impl", "model") == "model"}
    assert set(ms) == {"fp32", "fp16", "bf16"}
    assert S.resolve_precision("auto", "cuda") == min(ms, key=ms.get)


def test_cuda_text_encoder_default_is_the_fastest_faithful_one_measured():
    """gare.text_quant.DEFAULT_CUDA_TEXT_ENCODER (what `text_encoder: auto` serves on CUDA at fp32): of the
    model's own fp32 tower and the half-precision towers, the least time at one query plus 32 among those whose
    R@1 (+psi) on the benchmark model stayed within 0.5 point of CPU fp32."""
    from gare.text_quant import DEFAULT_CUDA_TEXT_ENCODER

    sec = _gpu_sections()
    rows = sec["text_encoder"]["result"]["rows"]
    fid = sec["fidelity"]["result"]
    ref = fid["cpu_reference"]["psi"]["R1"]
    names = {"fp32": ("model", "fp32", "fp32"), "fp16": ("tower", "fp16", "fp16 tower"), "bf16": ("tower", "bf16", "bf16 tower")}
    cost = {}
    for kind, (impl, prec, fid_name) in names.items():
        if abs(fid["precisions"][fid_name]["psi"]["R1"] - ref) > 0.5:
            continue
        cost[kind] = sum(r["ms_per_call"] for r in rows
                         if r.get("impl", "model") == impl and r["precision"] == prec and r["batch"] in (1, 32))
    assert DEFAULT_CUDA_TEXT_ENCODER == min(cost, key=cost.get), cost


def test_cuda_fidelity_of_the_chosen_precision_was_measured():
    """The chosen CUDA precision kept R@1 (+psi) within 0.5 point of CPU fp32 on the trained benchmark model."""
    fi = _gpu_sections()["fidelity"]
    assert fi["ok"], fi.get("error")
    got = fi["result"]["precisions"][S.resolve_precision("auto", "cuda")]["psi"]["R1"]
    assert abs(got - fi["result"]["cpu_reference"]["psi"]["R1"]) <= 0.5


def test_gpu_report_is_generated_from_its_json():
    """bench/results/gpu_bench.md is what bench/gpu_bench.py renders from the committed JSON (no hand edits),
    and the run it records passed every section on a GPU."""
    import sys

    sys.path.insert(0, str(RESULTS.parent))
    try:
        import gpu_bench
    finally:
        sys.path.remove(str(RESULTS.parent))
    res = json.loads((RESULTS / "gpu_bench.json").read_text())
    assert (RESULTS / "gpu_bench.md").read_text() == gpu_bench.markdown(res)
    assert all(s["ok"] for s in res["sections"].values())
    env = res["sections"]["env"]["result"]
    assert env["device"] == "cuda" and res["commit"] != "unknown"
    # docs/index-format.md says faiss-gpu was not run on that machine: its environment line must show why
    doc = " ".join((RESULTS.parents[1] / "docs" / "index-format.md").read_text().split())
    assert "not yet run on a GPU" in doc and "CAGRA is not implemented" in doc
    assert env["faiss_gpus"] == 0 and not env["faiss_cagra"] and not env["shared_libraries"]["libcublas.so.12"]
    last = (RESULTS / "gpu_cuda_tests.log").read_text().strip().splitlines()[-1]  # the CUDA tests of that run
    assert " passed in " in last and "failed" not in last and "error" not in last, last
