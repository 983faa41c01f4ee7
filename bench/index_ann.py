"""Recall@10 against latency for each ANN index type at 100k and 1M clustered unit vectors (d = 512).

Data: `indexer.ann.clustered_vectors(n, 512, n // 1000 clusters, spread 2.0)` (broad, overlapping clusters: a
query's top 10 spans several IVF cells, unlike tight blobs where every index type scores 1.0; a harder set
with many small diffuse clusters, `--cluster-size 33 --spread 1.5`, is in results/index_ann_hard.md),
queries: `perturbed_queries` (noise 0.5) of random members; ground truth: exact inner-product top-10 (faiss IndexFlatIP).
Latency: one query at a time on one thread (what a search request costs), median over `--latency-queries`;
batch: the whole query set in one call on all cores, per query. Build times include IVF training (on a sample, as `indexer.ann` does).

HNSW at 1M: building it takes longer than this benchmark's budget on a 2-core CPU; the build rate is
measured on the first `--hnsw-1m-probe` insertions of the 1M set and the full build is extrapolated
(labelled as such); recall at 1M is not measured for HNSW.
"""

from __future__ import annotations

import argparse
import gc
import time

from index_common import table, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--latency-queries", type=int, default=100)
    ap.add_argument("--nlist", type=int, nargs="+", default=[1024, 1024],
                    help="IVF cells per size (default_nlist would be 1265 and 4000: see the notes)")
    ap.add_argument("--cluster-size", type=int, default=1000)
    ap.add_argument("--spread", type=float, default=2.0)
    ap.add_argument("--noise", type=float, default=0.5)
    ap.add_argument("--hnsw-max", type=int, default=200_000, help="largest n for a full HNSW build")
    ap.add_argument("--hnsw-1m-probe", type=int, default=100_000)
    args = ap.parse_args()
    started = time.time()

    import faiss
    import numpy as np

    from indexer.ann import (
        AnnIndex,
        AnnParams,
        build_index,
        clustered_vectors,
        perturbed_queries,
        recall_at_k,
    )

    threads = faiss.omp_get_max_threads()
    rows, data, notes = [], [], []
    k = 10
    for si, n in enumerate(args.sizes):
        t0 = time.time()
        x = clustered_vectors(n, args.dim, max(1, n // args.cluster_size), seed=0, spread=args.spread)
        q = perturbed_queries(x, args.queries, seed=1, noise=args.noise)
        ids = np.arange(n, dtype=np.int64)
        gt_index = faiss.IndexFlatIP(args.dim)
        gt_index.add(x)
        _, gt = gt_index.search(q, k)
        print(f"n={n}: data + ground truth in {time.time() - t0:.1f}s", flush=True)

        def measure(name, ann, setting, build_s, mem_bytes, q=q, gt=gt, n=n):
            t0 = time.perf_counter()
            _, got = ann.search(q, k)
            batch_ms = 1000 * (time.perf_counter() - t0) / len(q)
            lat = []
            faiss.omp_set_num_threads(1)  # one request = one thread (OpenMP on a busy 2-core box adds ms of jitter)
            try:
                for i in range(args.latency_queries):
                    t1 = time.perf_counter()
                    ann.search(q[i : i + 1], k)
                    lat.append(time.perf_counter() - t1)
            finally:
                faiss.omp_set_num_threads(threads)
            r = recall_at_k(got, gt, k)
            lat_ms = 1000 * float(np.median(lat))
            rows.append([f"{n:,}", name, setting, f"{r:.3f}", f"{lat_ms:.2f}", f"{batch_ms:.3f}", f"{build_s:.1f}",
                         f"{mem_bytes / n:.0f}"])
            data.append({"n": n, "type": name, "setting": setting, "recall_at_10": r, "latency_ms": lat_ms,
                         "batch_ms_per_query": batch_ms, "build_s": build_s, "index_bytes_per_vector": mem_bytes / n})
            print(rows[-1], flush=True)

        def index_bytes(ann):
            return faiss.serialize_index(ann.cpu_index).size

        # flat: exact
        t0 = time.time()
        p = AnnParams("flat")
        ann = AnnIndex(build_index(x, ids, p, use_gpu=False), p)
        measure("flat", ann, "exact", time.time() - t0, index_bytes(ann))
        del ann
        gc.collect()

        # ivf
        nlist = args.nlist[min(si, len(args.nlist) - 1)]
        t0 = time.time()
        p = AnnParams("ivf", nlist=nlist)
        base = AnnIndex(build_index(x, ids, p, use_gpu=False), p)
        build_s = time.time() - t0
        nbytes = index_bytes(base)
        for nprobe in (8, 32, 128, 256):
            pp = AnnParams("ivf", nlist=nlist, nprobe=nprobe)
            measure("ivf", AnnIndex(base.cpu_index, pp), f"nlist={nlist} nprobe={nprobe}", build_s, nbytes)
        del base
        gc.collect()

        # ivfpq with exact re-scoring of the shortlist from the stored float vectors
        t0 = time.time()
        p = AnnParams("ivfpq", nlist=nlist)
        base = AnnIndex(build_index(x, ids, p, use_gpu=False), p, x)
        build_s = time.time() - t0
        nbytes = index_bytes(base)
        m = faiss.downcast_index(base.cpu_index).pq.M
        for nprobe, rescore in ((32, 1), (32, 4), (128, 4), (128, 16), (256, 16)):
            pp = AnnParams("ivfpq", nlist=nlist, nprobe=nprobe, rescore=rescore)
            measure("ivfpq", AnnIndex(base.cpu_index, pp, x), f"nlist={nlist} M={m} nprobe={nprobe} rescore x{rescore}",
                    build_s, nbytes)
        del base
        gc.collect()

        # hnsw
        if n <= args.hnsw_max:
            t0 = time.time()
            p = AnnParams("hnsw")
            base = AnnIndex(build_index(x, ids, p, use_gpu=False), p)
            build_s = time.time() - t0
            nbytes = index_bytes(base)
            for ef in (32, 128, 512):
                pp = AnnParams("hnsw", ef_search=ef)
                measure("hnsw", AnnIndex(base.cpu_index, pp), f"M=32 efC=200 efSearch={ef}", build_s, nbytes)
            rate = n / build_s
            data.append({"n": n, "type": "hnsw", "build_rate_per_s": rate})
            notes.append(f"HNSW build at n={n:,}: {build_s:.0f} s ({rate:,.0f} vectors/s, measured).")
            del base
            gc.collect()
        else:
            probe = min(args.hnsw_1m_probe, n)
            idx = faiss.IndexHNSWFlat(args.dim, 32, faiss.METRIC_INNER_PRODUCT)
            idx.hnsw.efConstruction = 200
            t0 = time.time()
            idx.add(x[:probe])
            t_probe = time.time() - t0
            rate = probe / t_probe
            # insertion cost grows ~log(n): scale the measured rate by log(probe)/log(n) for the rest
            est = t_probe + (n - probe) / rate * (np.log(n) / np.log(probe))
            data.append({"n": n, "type": "hnsw", "measured_insertions": probe, "measured_rate_per_s": rate,
                         "extrapolated_build_s": est, "extrapolated": True})
            notes.append(
                f"HNSW at n={n:,}: NOT built. Measured {probe:,} insertions of the {n:,}-vector set in {t_probe:.0f} s "
                f"({rate:,.0f} vectors/s, M=32, efC=200); EXTRAPOLATED full build ~ {est / 60:.0f} min on this CPU "
                f"(rate scaled by log n). Recall/latency at {n:,} not measured; expect them close to the 100k figures "
                "at a somewhat higher efSearch."
            )
            del idx
            gc.collect()
        del x, gt_index
        gc.collect()

    body = (
        f"d = {args.dim}, clusters of ~{args.cluster_size} vectors, spread {args.spread}, query noise {args.noise}, "
        f"{args.queries} queries, k = 10. *latency*: one query per call on one thread (median of "
        f"{args.latency_queries}); *batch*: all queries in one call, per query; *build*: training + adding; "
        "*bytes/vector*: the serialised FAISS index (ivfpq re-scores from the units.npy memmap, not counted).\n\n"
        + table(["n", "type", "setting", "recall@10", "latency ms", "batch ms/query", "build s", "bytes/vector"], rows)
        + "\nNotes:\n\n" + "".join(f"- {s}\n" for s in notes)
        + f"- IVF cells: nlist = {args.nlist} here. `default_nlist` would use ~4 sqrt(n) (1,265 at 100k, 4,000 at 1M); "
        "k-means training of 4,000 cells on the 256k-vector sample takes ~9 min on 2 CPU cores (seconds on a GPU), "
        "so pass `--nlist 1024` on small CPU hosts.\n"
    )
    write_results("index_ann", "ANN index types: recall@10 against latency at 100k and 1M vectors", body,
                  {"rows": data, "notes": notes}, started)


if __name__ == "__main__":
    main()
