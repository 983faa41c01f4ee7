"""The report of `gare-index compare`: result.md (the side-by-side table and notes) and compare.png.

Rendered from the result dict :func:`gare_build.compare.run_compare` measures (and writes as result.json), so a
result read back from JSON renders the same report.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

TOP = 10  # coverage reference: the exhaustive top-10

__all__ = ["TOP", "write_compare_report"]


def _f(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}"


def _at(d: dict[Any, Any], k: int) -> Any:
    """d[k] for int keys, also after a JSON round trip (string keys)."""
    return d[k] if k in d else d.get(str(k))


def write_compare_report(result: dict[str, Any], out: Path) -> dict[str, str]:
    """Write result.md and compare.png of a `gare-index compare` result into ``out``; their paths (and result.json's)."""
    out = Path(out)
    paths = {"json": str(out / "result.json"), "md": str(out / "result.md"), "plot": str(out / "compare.png")}
    ks = result["coverage_ks"]
    K = result["candidates"]
    show = [k for k in ks if k in (16, 32)] + [K]
    d = result["data"]
    lines = [
        f"# gare-index compare: {d['dataset']}", "",
        f"{result['n_queries']} test captions as queries against a gallery of {result['n_gallery']} videos "
        f"({'test videos only' if d['gallery'] == 'test' else 'test + training videos'}); K = {K} candidates; "
        f"{result['index_type']} ANN; checkpoint `{Path(result['checkpoint']).name}`.", "",
        "| method | stage 1 | stage 2 | R@1 | R@5 | R@10 | MdR | MnR | norm err | "
        + " | ".join(f"cov@{k}" for k in show) + " | search ms/query (p50) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(show) + "---:|",
    ]
    for name, r in result["rows"].items():
        m = r["t2v"]
        lines.append(
            f"| {name} | {r['stage1']} | {r['stage2']} | {_f(m['R1'])} | {_f(m['R5'])} | {_f(m['R10'])} | {_f(m['MdR'])} | "
            f"{_f(m['MnR'])} | {_f(r['norm_err_t2v'], 3)} | "
            + " | ".join(_f(_at(r["coverage_psi_top10"], k), 3) for k in show)
            + f" | {_f(r['latency'].get('search_ms_p50'), 2)} |")
    enc = [r["latency"].get("encode_ms_p50") for r in result["rows"].values() if r["latency"].get("n")]
    lines += [
        "",
        "- R@k, MdR, MnR: text-to-video, through the two-stage search (a ground truth outside the K candidates is "
        "ranked after them in stage-1 order).",
        "- norm err: NCL eq. 5 t2v normalisation error of the row's score over the whole gallery for these queries "
        f"(gamma = {_f(result['ncl']['gamma'], 4)}).",
        f"- cov@K: share of the exhaustive psi top-{TOP} inside the row's stage-1 top K (averaged over queries).",
        f"- search ms/query: stage 1 + psi + ranking of one query at a time (k = 10), the best of "
        f"{result['rows'][next(iter(result['rows']))]['latency'].get('repeats', 1)} runs, median over "
        f"{result['rows'][next(iter(result['rows']))]['latency'].get('n', 0)} queries, "
        f"{(result.get('latency_threads') or {}).get('torch', '?')} torch / {(result.get('latency_threads') or {}).get('faiss', '?')} "
        "faiss thread(s); the combinations are interleaved query by query; "
        f"text encoding excluded (the same for every row: {_f(float(np.median(enc)) if enc else None, 2)} ms).",
    ]
    if result["k_ge_gallery"]:
        lines.append(f"- K = {K} >= the {result['n_gallery']} gallery videos: every video is a candidate, so cov@{K} is "
                     "trivially 1 and rows that differ only in stage 1 give the same reranked results.")
    lines += ["", f"Coverage of the exhaustive top-{TOP} inside stage 1's top K (psi and psi + b references):", "",
              "| method | reference | " + " | ".join(f"K={k}" for k in ks) + " |", "|---|---|" + "---:|" * len(ks)]
    for name, r in result["rows"].items():
        for ref, key in (("psi", "coverage_psi_top10"), ("psi + b", "coverage_psi_b_top10")):
            lines.append(f"| {name} | {ref} | " + " | ".join(_f(_at(r[key], k), 3) for k in ks) + " |")
    ncl = result["ncl"]
    if ncl.get("bank"):
        bk = ncl["bank"]["biases"]
        tr = bk.get("traffic") or {}
        lines += ["", f"Bank rows: biases recomputed by `gare-index biases --from-traffic {Path(tr.get('file', '?')).name} "
                  f"--traffic-weight {tr.get('traffic_weight')}` ({tr.get('traffic_queries')} bank + {tr.get('train_queries')} "
                  f"training-queue queries); t2v normalisation error of the test captions with them "
                  f"{_f(ncl['norm_err_test_after'], 3)} -> {_f(ncl['bank']['norm_err_test_after'], 3)} (checkpoint-queue biases -> bank biases)."]
    lines += ["", f"NCL biases: source {ncl['bias_source']} ({ncl['queue']} queries); t2v normalisation error of the "
              f"test captions {_f(ncl['norm_err_test_before'], 3)} -> {_f(ncl['norm_err_test_after'], 3)} with the biases"
              + (f", of the training queue {_f(ncl['norm_err_queue_before'], 3)} -> {_f(ncl['norm_err_queue_after'], 3)}."
                 if "norm_err_queue_before" in ncl else ".")]
    inv = result.get("invgc")
    if inv:
        sel = inv.get("selection") or {}
        if sel.get("method") == "grid":
            lines.append(f"InvGC: r_g = {inv['r_g']:g}, r_q = {inv['r_q']:g}, k = {inv['k_percent']:g}%, chosen by a "
                         f"{len(sel.get('tried', []))}-point grid on {sel.get('validation')} ({sel.get('n_val_captions')} "
                         f"captions, {sel.get('n_val_videos')} videos): validation dual-tower R@1 "
                         f"{_f(sel.get('baseline'))} at r = 0 -> {_f(sel.get('score'))}.")
        else:
            lines.append(f"InvGC: r_g = {inv['r_g']:g}, r_q = {inv['r_q']:g} (given), k = {inv['k_percent']:g}%.")
        lines.append(f"Ĝ / Q̂: the checkpoint's queues ({inv['n_train_videos']} training videos, "
                     f"{inv['n_train_queries']} training queries).")
    for note in result.get("notes") or []:
        lines.append(f"Note: {note}")
    Path(paths["md"]).write_text("\n".join(lines) + "\n", encoding="utf-8")

    import matplotlib  # the plotting library loads only when a report is drawn

    matplotlib.use("Agg")  # no display: the figure goes to a file
    import matplotlib.pyplot as plt

    names = list(result["rows"])
    r1 = [result["rows"][n]["t2v"]["R1"] for n in names]
    r10 = [result["rows"][n]["t2v"]["R10"] for n in names]
    ms = [result["rows"][n]["latency"].get("search_ms_p50", 0.0) for n in names]
    palette = {"plain": "#4c72b0", "invgc": "#dd8452", "bank": "#55a868"}
    colors = [palette.get(result["rows"][n]["index"], "#8172b3") for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(names) + 1.8), sharey=True)
    y = np.arange(len(names))
    h = 0.38
    axes[0].barh(y - h / 2, r1, height=h, color=colors)
    axes[0].barh(y + h / 2, r10, height=h, color=colors, alpha=0.45)
    axes[0].set_xlabel("t2v R@1 (solid) and R@10 (light), %")
    axes[0].set_yticks(y, names)
    axes[0].invert_yaxis()
    for yi, a, b in zip(y, r1, r10, strict=True):
        axes[0].text(a, yi - h / 2, f" {a:.1f}", va="center", fontsize=7)
        axes[0].text(b, yi + h / 2, f" {b:.1f}", va="center", fontsize=7)
    axes[1].barh(y, ms, color=colors)
    axes[1].set_xlabel("search latency, median ms/query (text encoding excluded)")
    for yi, v in zip(y, ms, strict=True):
        axes[1].text(v, yi, f" {v:.2f}", va="center", fontsize=7)
    from matplotlib.patches import Patch

    used = [k for k in palette if any(result["rows"][n]["index"] == k for n in names)]
    label = {"plain": "plain index", "invgc": "InvGC stage-1 vectors", "bank": "biases from the query bank"}
    fig.legend([Patch(color=palette[k]) for k in used], [label[k] for k in used], loc="lower center", ncol=len(used),
               fontsize=8, frameon=False)
    for ax, vals in ((axes[0], r10 + r1), (axes[1], ms)):
        ax.set_xlim(0, 1.15 * max([v for v in vals if np.isfinite(v)] + [1e-3]))
    fig.suptitle(f"{d['dataset']}: {result['n_queries']} queries, {result['n_gallery']} videos, K = {K}", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(paths["plot"], dpi=120)
    plt.close(fig)
    return paths
