"""What an index's manifest says about its stage 1 and its NCL biases: the chosen K, whether the biases are on by
default for it, and one line for people.

The builder's CLI, the service's /v1/index and the page read these; they only read the manifest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gare_index.store import IndexManifest

STAGE1_KEY = "stage1"  # the manifest entry


def index_default_candidates(manifest: IndexManifest | Mapping[str, Any] | None) -> int | None:
    """The K an index chose for itself (manifest["stage1"]["default_candidates"]), or None."""
    st = (manifest.stage1 if hasattr(manifest, "stage1") else (manifest or {}).get(STAGE1_KEY)) or {}
    k = st.get("default_candidates")
    return int(k) if isinstance(k, int) and k > 0 else None


def index_ncl_default(manifest: IndexManifest | Mapping[str, Any] | None) -> tuple[bool, str] | None:
    """The index's own NCL default and why (manifest["biases"]["default"], decided at build time on validation
    captions), or None when the build had no validation captions (the search's default applies)."""
    b = (manifest.biases if hasattr(manifest, "biases") else (manifest or {}).get("biases")) or {}
    d = b.get("default")
    if not isinstance(d, Mapping) or not isinstance(d.get("on"), bool):
        return None
    return d["on"], str(d.get("reason") or "")


def public_biases(binfo: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The manifest's biases record as GET /v1/index shows it: without the server paths it keeps for the builder
    (the fresh queue's caption source, the validation captions the default was decided on)."""
    if binfo is None:
        return None
    out = dict(binfo)
    for key in ("queue", "default"):
        if isinstance(out.get(key), Mapping):
            out[key] = {k: v for k, v in out[key].items() if k != "source"}
    return out


def describe_stage1(st: Mapping[str, Any] | None) -> str:
    """One line for CLIs: recall, setting, latency, coverage at the default K, query source."""
    if not st:
        return "stage 1: not tuned"
    K = st.get("default_candidates")
    cov = (st.get("coverage") or {}).get(str(K)) if K else None
    if not K:
        tail = f"no measured K reached psi coverage {st.get('coverage_target')}"
    elif st.get("coverage_met") is False:  # the best measured K: users get this share of psi's answers
        tail = (f"NOT met: psi top-{st.get('coverage_top')} coverage {cov:.4f} < target {st.get('coverage_target')} "
                f"at the default K={K}, the best measured")
    else:
        tail = f"psi top-{st.get('coverage_top')} coverage {cov:.4f} at the default K={K}"
    dv = st.get("deviation")
    dev = (f"; Δ deviation mean {dv['delta_mean_abs']:.4f}, 95th percentile {dv['delta_p95_abs']:.4f} "
           f"(authors: {dv['authors']})" if dv else "")
    past = (f" (above the latency budget {st.get('latency_budget_ms')} ms: recall first, ceiling "
            f"{st.get('latency_ceiling_ms')} ms)" if st.get("outcome") == "above-budget" else "")
    effort = st.get("coverage_effort") or {}
    if effort.get("raised"):  # the recall was measured at the tuned effort; the index serves the raised one
        how = (f"with {st.get('index_type')} {effort.get('from')}, p50 {st.get('p50_ms'):.3f} ms{past}; search effort "
               f"raised for psi's coverage to {st.get('setting')}, p50 {st.get('p50_ms_default_k'):.3f} ms at K={K}")
    else:
        how = f"with {st.get('index_type')} {st.get('setting')}, p50 {st.get('p50_ms'):.3f} ms{past}"
    return (f"stage 1: recall@{st.get('recall_at')} of the exact top-{st.get('recall_k')} {st.get('recall'):.4f} "
            f"(target {st.get('recall_target')}) {how}; {tail}{dev}; queries: {st.get('query_source')}")


def describe_biases(binfo: dict[str, Any] | None) -> str:
    """One line for people: how the biases of an index were computed (the /v1/index and the page use it)."""
    b = binfo or {}
    if b.get("source") in (None, "none") or not b.get("n_queries"):
        return "no NCL biases (the checkpoint has no query queue)"
    src = {"checkpoint-queue": "the checkpoint's training queue", "traffic": "a bank of served queries",
           "checkpoint-queue+traffic": "the training queue mixed with a bank of served queries"}.get(b["source"], b["source"])
    s = b.get("served") or {}
    if b.get("score") == "served":
        how = (f"fitted to the psi score the search ranks by ({s.get('form')}: exact psi on each queue query's top "
               f"{s.get('k')} stage-1 candidates, {'the cosine' if s.get('fill') == 'dual' else 'nothing'} elsewhere)")
    else:
        how = "fitted to the dual-tower cosine"
    return f"Sinkhorn (NCL, {b.get('n_iters')} iterations, gamma {b.get('gamma', 0):.4g}) over {b['n_queries']} queries " \
           f"from {src}, {how}"
