"""The FAISS GPU path (issue 27): what goes to the GPU and how, decided by ``gare_index.ann.gpu_plan`` and applied
when the index is opened, tested here on CPU-only machines; the ``gpu``-marked tests at the end run the same
paths on a real GPU with faiss-gpu (skipped where faiss sees none).

The five points of the issue, each with its CI test:
1. an IVF index with an HNSW coarse quantiser is cloned with ``allowCpuCoarseQuantizer`` (faiss >= 1.9 throws
   without it); the types faiss has no GPU version of stay on the CPU, with the reason;
2. faiss's GPU selection limit (2,048 for nprobe and k): an nprobe above it is refused (``use_gpu=True``) or
   kept on the CPU (``None``), never clamped; k above it is answered by the CPU copy; the tuner never goes
   past it for a GPU build;
3. the clone happens when the index is opened (``AnnIndex``, ``open_index``), so a failure is an error at open
   time naming the index, its parameters and what to do, before any search;
4. errors setting nprobe on the GPU copy are raised, not swallowed, and nprobe is set explicitly;
5. the install advice (CUDA Dockerfile, pyproject comment, README) never uninstalls faiss-cpu after faiss-gpu.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import faiss
import numpy as np
import pytest

import gare_index.ann_gpu as ann_gpu
from gare_index.ann import AnnIndex, build_index
from gare_index.ann_eval import clustered_vectors, exact_search, perturbed_queries, recall_at_k
from gare_index.ann_gpu import GPU_MAX_K, GpuIndexError, gpu_plan
from gare_index.ann_params import COARSE_HNSW_MIN, AnnParams, coarse_kind, is_gpu

REPO = Path(__file__).resolve().parents[2]
HAS_GPU = faiss.get_num_gpus() > 0 and hasattr(faiss, "GpuMultipleClonerOptions")


def _units(n: int, d: int, seed: int = 0) -> np.ndarray:
    return clustered_vectors(n, d, max(2, n // 50), seed=seed, spread=0.5)


def _ivf_with_centroids(x: np.ndarray, nlist: int, coarse: str, seed: int = 0) -> faiss.IndexIVFFlat:
    """An IVF-Flat index whose cells are ``nlist`` rows of ``x`` (no k-means: cheap at any nlist), holding x."""
    d = x.shape[1]
    rows = np.random.default_rng(seed).choice(x.shape[0], size=nlist, replace=nlist > x.shape[0])
    if coarse == "hnsw":
        q = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        q.hnsw.efConstruction = 40
    else:
        q = faiss.IndexFlatIP(d)
    q.add(np.ascontiguousarray(x[rows], dtype=np.float32))
    ivf = faiss.IndexIVFFlat(q, d, nlist, faiss.METRIC_INNER_PRODUCT)  # (faiss's wrapper keeps q alive)
    assert ivf.is_trained
    ivf.add_with_ids(np.ascontiguousarray(x, dtype=np.float32), np.arange(x.shape[0], dtype=np.int64))
    return ivf


@pytest.fixture(scope="module")
def small():
    """(vectors, ids, {type: CPU faiss index}) for every index type, at a size the CPU builds in seconds."""
    x = _units(2000, 16)
    ids = np.arange(2000, dtype=np.int64) * 3 + 7
    out = {}
    for name, p in {
        "flat": AnnParams("flat"),
        "ivf": AnnParams("ivf", nlist=32, coarse="flat"),
        "ivf-hnsw": AnnParams("ivf", nlist=32, coarse="hnsw"),
        "hnsw": AnnParams("hnsw"),
        "ivfpq": AnnParams("ivfpq", nlist=16, pq_m=4),
        "ivfpq-fs": AnnParams("ivfpq", nlist=16, pq_m=4, fastscan=True),
    }.items():
        out[name] = (build_index(x, ids, p, use_gpu=False), p)
    return x, ids, out


# ------------------------------------------------------------------ 1. which types and options go to the GPU
def test_flat_and_ivf_go_to_the_gpu_with_exact_scores_and_classic_kernels(small):
    _, _, idx = small
    for name in ("flat", "ivf"):
        index, p = idx[name]
        plan = gpu_plan(index, p, use_gpu=None, n_gpus=1)
        assert plan.on_gpu and plan.error is None and not plan.warnings, plan
        assert plan.n_gpus == 1 and plan.max_k == GPU_MAX_K == 2048
        # float32 on the GPU (same ids as the CPU index), cuVS / RAFT off (one limit, faiss's coarse quantiser)
        assert plan.cloner_options["useFloat16"] is False and plan.cloner_options["useFloat16CoarseQuantizer"] is False
        assert plan.cloner_options["use_cuvs"] is False and plan.cloner_options["use_raft"] is False
        assert "allowCpuCoarseQuantizer" not in plan.cloner_options  # a flat quantiser goes to the GPU itself
    assert gpu_plan(*idx["flat"], use_gpu=None, n_gpus=1).nprobe is None
    assert gpu_plan(*idx["ivf"], use_gpu=None, n_gpus=1).nprobe == 16  # default_nprobe(32), set explicitly
    index, p = idx["ivf"]
    assert gpu_plan(index, AnnParams("ivf", nlist=32, nprobe=7, coarse="flat"), n_gpus=2).nprobe == 7


def test_ivf_with_an_hnsw_coarse_quantiser_is_cloned_with_allow_cpu_coarse_quantizer(small):
    _, _, idx = small
    plan = gpu_plan(*idx["ivf-hnsw"], use_gpu=True, n_gpus=1)
    assert plan.on_gpu and plan.cloner_options["allowCpuCoarseQuantizer"] is True
    assert "allowCpuCoarseQuantizer" in plan.reason and "IndexHNSWFlat" in plan.index
    # what coarse="auto" gives from COARSE_HNSW_MIN cells: the case that used to throw on large indexes
    assert coarse_kind(AnnParams("ivf"), COARSE_HNSW_MIN) == "hnsw" and COARSE_HNSW_MIN == 16_384
    x = _units(COARSE_HNSW_MIN, 8, seed=1)
    big = _ivf_with_centroids(x, COARSE_HNSW_MIN, "hnsw")
    p = AnnParams.from_index(big)
    assert p.coarse == "hnsw" and p.nlist == COARSE_HNSW_MIN
    plan = gpu_plan(big, AnnParams("ivf", nlist=COARSE_HNSW_MIN, nprobe=256, coarse="hnsw"), n_gpus=1)
    assert plan.on_gpu and plan.cloner_options["allowCpuCoarseQuantizer"] is True and plan.nprobe == 256


@pytest.mark.parametrize("name, why", [
    ("hnsw", "no GPU HNSW"),
    ("ivfpq", "re-scores its shortlist"),
    ("ivfpq-fs", "no GPU fast-scan IVF-PQ"),
])
def test_types_without_a_gpu_version_stay_on_the_cpu_with_the_reason(small, name, why):
    _, _, idx = small
    index, p = idx[name]
    auto = gpu_plan(index, p, use_gpu=None, n_gpus=1)
    assert not auto.on_gpu and why in auto.reason and auto.error is None and not auto.warnings
    required = gpu_plan(index, p, use_gpu=True, n_gpus=1)  # the documented contract: flat/ivf only; not an error
    assert not required.on_gpu and required.error is None
    assert len(required.warnings) == 1 and "stays on the CPU" in required.warnings[0] and why in required.warnings[0]
    # and without a GPU it is not an error either (it would not go to one anyway)
    assert gpu_plan(index, p, use_gpu=True, n_gpus=0).error is None


def test_no_gpu_and_use_gpu_false(small):
    _, _, idx = small
    for name in ("flat", "ivf"):
        index, p = idx[name]
        assert not gpu_plan(index, p, use_gpu=False, n_gpus=4).on_gpu
        none = gpu_plan(index, p, use_gpu=None, n_gpus=0)
        assert not none.on_gpu and none.error is None and none.reason == "faiss sees no GPU"
        required = gpu_plan(index, p, use_gpu=True, n_gpus=0)
        assert not required.on_gpu and "faiss sees no GPU" in required.error


# ------------------------------------------------------------------------- 2. the 2,048 limit: nprobe and k
def test_the_limit_is_faiss_gpu_max_selection_k():
    # faiss/gpu/utils/DeviceDefs.cuh: GPU_MAX_SELECTION_K 2048 for CUDA > 9.0, faiss 1.8 to 1.15. That faiss itself
    # refuses one more is checked on a GPU: test_gpu_flat_returns_the_cpu_ids (k) and test_gpu_nprobe_above_the_limit
    # (nprobe) below.
    assert GPU_MAX_K == 2048


def test_nprobe_above_the_limit_is_refused_or_kept_on_the_cpu_never_clamped():
    x = _units(6000, 8, seed=2)
    nlist = 4300  # the tuner's max_nprobe_frac (0.5) would allow 2150 > 2048: about 1M vectors at 4 sqrt(n)
    index = _ivf_with_centroids(x, nlist, "flat")
    p = AnnParams("ivf", nlist=nlist, nprobe=2150, coarse="flat")
    required = gpu_plan(index, p, use_gpu=True, n_gpus=1)
    assert not required.on_gpu and required.error
    for part in ("nprobe=2150", "limit of 2048", "IndexIVFFlat", f"nlist={nlist}", "use_gpu_ann: false",
                 "gare-index tune", "Clamping"):
        assert part in required.error, (part, required.error)
    auto = gpu_plan(index, p, use_gpu=None, n_gpus=1)
    assert not auto.on_gpu and auto.error is None and auto.nprobe is None  # searched on the CPU, as tuned
    assert len(auto.warnings) == 1 and "nprobe=2150" in auto.warnings[0] and "2048" in auto.warnings[0]
    assert "tuned recall" in auto.warnings[0]
    # at the limit it goes to the GPU unchanged
    at = gpu_plan(index, AnnParams("ivf", nlist=nlist, nprobe=2048, coarse="flat"), use_gpu=True, n_gpus=1)
    assert at.on_gpu and at.nprobe == 2048


def test_k_above_the_limit_is_answered_by_the_cpu_copy(small):
    _, _, idx = small
    plan = gpu_plan(*idx["flat"], use_gpu=None, n_gpus=1, k_max=4096)
    assert plan.on_gpu and plan.max_k == 2048
    assert len(plan.warnings) == 1 and "CPU copy" in plan.warnings[0] and "4096" in plan.warnings[0]
    assert not gpu_plan(*idx["flat"], use_gpu=None, n_gpus=1, k_max=2048).warnings


def test_service_max_candidates_default_fits_the_gpu_limit():
    from gare_serve.settings import Settings

    assert Settings.model_fields["max_candidates"].default <= GPU_MAX_K


# ------------------------------------------------- the plan applied: a stand-in for faiss's GPU entry points
class _FakeGpuFaiss:
    """Stands in for the faiss-gpu entry points ``_to_gpu`` uses (the only place faiss is patched): the clone
    is a CPU copy, and every call is recorded."""

    def __init__(self, *, nprobe_error: Exception | None = None, clone_error: Exception | None = None,
                 nprobe_ignored: bool = False, clone_nprobe: int | None = None):
        self.clones: list[dict] = []
        self.nprobe_sets: list[int] = []
        self.nprobe_error, self.clone_error, self.nprobe_ignored = nprobe_error, clone_error, nprobe_ignored
        self.clone_nprobe = clone_nprobe
        fake = self

        class Options:
            def __init__(self):
                self.useFloat16 = self.useFloat16CoarseQuantizer = self.use_cuvs = self.allowCpuCoarseQuantizer = None

        class ParameterSpace:
            def set_index_parameter(self, index, name, value):
                if fake.nprobe_error is not None:
                    raise fake.nprobe_error
                fake.nprobe_sets.append(int(value))
                if not fake.nprobe_ignored:
                    faiss.extract_index_ivf(index).nprobe = int(value)

        self.Options, self.ParameterSpace = Options, ParameterSpace

    def index_cpu_to_all_gpus(self, index, co=None, ngpu=-1):
        if self.clone_error is not None:
            raise self.clone_error
        self.clones.append({k: v for k, v in vars(co).items()} | {"ngpu": ngpu})
        out = faiss.clone_index(index)
        if self.clone_nprobe is not None:
            faiss.extract_index_ivf(out).nprobe = self.clone_nprobe
        return out

    def install(self, monkeypatch):
        monkeypatch.setattr(faiss, "GpuMultipleClonerOptions", self.Options, raising=False)
        monkeypatch.setattr(faiss, "GpuParameterSpace", self.ParameterSpace, raising=False)
        monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", self.index_cpu_to_all_gpus)
        return self


@pytest.mark.skipif(HAS_GPU, reason="replaces faiss's GPU entry points: CPU-only machines")
def test_the_plan_is_applied_at_open_time_before_any_search(small, monkeypatch, tmp_path):
    x, ids, idx = small
    fake = _FakeGpuFaiss().install(monkeypatch)
    index, p = idx["ivf-hnsw"]
    path = tmp_path / "ann.faiss"
    AnnIndex(index, p).save(path)
    ann = AnnIndex.load(path, AnnParams("ivf", nlist=32, nprobe=5, coarse="hnsw"), use_gpu=None, n_gpus=1)
    # cloned by load, with the plan's options (only those this "faiss" has), nprobe set explicitly
    assert len(fake.clones) == 1 and ann.on_gpu
    c = fake.clones[0]
    assert c["allowCpuCoarseQuantizer"] is True and c["useFloat16"] is False and c["use_cuvs"] is False
    assert "use_raft" not in c and c["ngpu"] == 1
    assert fake.nprobe_sets == [5]
    # searches within the limit use the GPU copy; above it the CPU master copy answers (same results)
    assert ann._searcher(GPU_MAX_K)[1] is True and ann._searcher(GPU_MAX_K + 1)[1] is False
    q = perturbed_queries(x, 5, seed=3)
    s_gpu, i_gpu = ann.search(q, 10)
    cpu = AnnIndex.load(path, AnnParams("ivf", nlist=32, nprobe=5, coarse="hnsw"), use_gpu=False)
    s_cpu, i_cpu = cpu.search(q, 10)
    np.testing.assert_array_equal(i_gpu, i_cpu)
    big = ann.search(q, GPU_MAX_K + 1)[1]  # more than the index holds: -1 padding, from the CPU copy
    assert big.shape == (5, GPU_MAX_K + 1) and (big[:, :10] == i_cpu).all() and len(fake.clones) == 1
    # a mutation re-clones at the next search, with the same plan
    ann.remove_ids(ids[:10])
    ann.search(q, 10)
    assert len(fake.clones) == 2 and fake.nprobe_sets == [5, 5]


@pytest.mark.skipif(HAS_GPU, reason="checks faiss-cpu's behaviour")
def test_a_cpu_only_faiss_fails_at_open_not_at_the_first_search(small, tmp_path):
    _, _, idx = small
    path = tmp_path / "ann.faiss"
    AnnIndex(*idx["flat"]).save(path)
    with pytest.raises(GpuIndexError, match="CPU-only build") as e:
        AnnIndex.load(path, use_gpu=True, n_gpus=1)  # "faiss has 1 GPU", but this faiss cannot clone
    assert "flat index (IndexFlatIP" in str(e.value) and "use_gpu_ann: false" in str(e.value)


# ------------------------------------------------------------------------------------ 3. eager, at open time
def test_refusal_is_raised_by_load_with_a_clear_message(tmp_path):
    x = _units(3000, 8, seed=4)
    nlist = 4200
    path = tmp_path / "ann.faiss"
    AnnIndex(_ivf_with_centroids(x, nlist, "hnsw"), AnnParams("ivf", nlist=nlist, nprobe=2100, coarse="hnsw")).save(path)
    with pytest.raises(GpuIndexError) as e:
        AnnIndex.load(path, use_gpu=True, n_gpus=1)  # the saved nprobe (2100) is above the limit
    msg = str(e.value)
    assert "ivf index (IndexIVFFlat" in msg and "nprobe=2100" in msg and "limit of 2048" in msg
    assert "coarse quantiser IndexHNSWFlat" in msg and "use_gpu_ann: false" in msg
    # under auto it opens (on the CPU, with the tuned nprobe) and says so
    ann = AnnIndex.load(path, use_gpu=None, n_gpus=1)
    assert not ann.on_gpu and ann.params.nprobe == 2100 and ann.gpu_plan.warnings


def _store(tmp_path: Path, index_type: str, ann_params: dict) -> Path:
    from gare_index.store import write_version
    from tests.indexer.test_index_store import extra, synth_arrays

    arrays, meta = synth_arrays(400)
    write_version(tmp_path, arrays, meta, {**extra(index_type), "ann_params": ann_params})
    return tmp_path


def test_open_index_fails_with_the_reason_so_the_service_fails_at_start(tmp_path, monkeypatch, caplog):
    """gare_serve.engine.state.ServiceState.load turns this IndexFormatError into its StartupError (start-up fails; a
    reload keeps the old version), so the first request never meets it."""
    from gare_index.store import IndexFormatError, open_index

    root = _store(tmp_path, "ivf", {"index_type": "ivf", "nlist": 8, "nprobe": 6, "coarse": "flat"})
    monkeypatch.setattr(ann_gpu, "num_gpus", lambda: 1)  # "faiss sees one GPU"
    monkeypatch.setattr(ann_gpu, "GPU_MAX_K", 4)  # a limit this small index exceeds (nprobe 6)
    with pytest.raises(IndexFormatError) as e:
        open_index(root, use_gpu=True, mmap_ann=True)
    msg = str(e.value)
    assert "ann.faiss" in msg and "nprobe=6" in msg and "limit of 4" in msg and "use_gpu_ann: false" in msg
    assert "unreadable" not in msg
    with caplog.at_level(logging.WARNING, logger="gare_index.ann"):
        v = open_index(root, use_gpu=None, mmap_ann=True)
    assert not v.ann.on_gpu and any("nprobe=6" in r.getMessage() for r in caplog.records)
    v.close()


@pytest.mark.skipif(HAS_GPU, reason="checks faiss-cpu's behaviour")
def test_open_index_clones_eagerly(tmp_path, monkeypatch):
    from gare_index.store import IndexFormatError, open_index

    root = _store(tmp_path, "flat", {"index_type": "flat"})
    monkeypatch.setattr(ann_gpu, "num_gpus", lambda: 1)
    with pytest.raises(IndexFormatError, match="CPU-only build"):  # the clone was tried by open_index itself
        open_index(root, use_gpu=None)


# ---------------------------------------------------------------------- 4. GPU parameter errors are raised
@pytest.mark.skipif(HAS_GPU, reason="replaces faiss's GPU entry points: CPU-only machines")
def test_gpu_nprobe_errors_are_raised_not_swallowed(small, monkeypatch):
    _, _, idx = small
    index, p = idx["ivf"]
    _FakeGpuFaiss(nprobe_error=RuntimeError("could not set parameter nprobe")).install(monkeypatch)
    with pytest.raises(GpuIndexError, match="setting nprobe=.* failed: could not set parameter nprobe"):
        AnnIndex(index, p, use_gpu=None, n_gpus=1)
    _FakeGpuFaiss(nprobe_ignored=True, clone_nprobe=3).install(monkeypatch)  # a copy that keeps nprobe=3
    with pytest.raises(GpuIndexError, match="has nprobe=3 after setting 9"):
        AnnIndex(faiss.clone_index(index), AnnParams("ivf", nlist=32, nprobe=9, coarse="flat"), use_gpu=None,
                 n_gpus=1)
    _FakeGpuFaiss(clone_error=RuntimeError("This index type is not implemented on GPU.")).install(monkeypatch)
    with pytest.raises(GpuIndexError, match="cloning the ivf index .* failed: This index type"):
        AnnIndex(index, p, use_gpu=None, n_gpus=1)
    # a flat index has no nprobe: nothing is set on it, nothing to swallow
    fake = _FakeGpuFaiss(nprobe_error=AssertionError("must not be called")).install(monkeypatch)
    a = AnnIndex(*idx["flat"], use_gpu=True, n_gpus=1)
    assert a.on_gpu and len(fake.clones) == 1 and a.gpu_plan.nprobe is None


# ----------------------------------------------------------------- 2b. the tuner keeps nprobe within the limit
def test_tuner_never_tries_an_nprobe_the_gpu_cannot_run(monkeypatch):
    """A GPU build (faiss "sees" a GPU; the clone is a CPU copy) with the limit scaled down to 8: every IVF
    setting tried stays <= 8 and the hard target moves on to flat, the next rung of the GPU ladder."""
    from gare_build.tuning import ladder
    from gare_build.tuning.ladder import TuneConfig, nprobe_cap
    from gare_build.tuning.recall import tune_ann

    monkeypatch.setattr(ann_gpu, "num_gpus", lambda: 1)
    monkeypatch.setattr(ann_gpu, "GPU_MAX_K", 8)
    monkeypatch.setattr(ladder, "GPU_MAX_K", 8, raising=False)  # the tuner's copy of the limit, if it keeps one
    clones = []

    def fake_to_gpu(cpu, plan):
        assert plan.on_gpu and (plan.nprobe is None or plan.nprobe <= 8), plan
        clones.append(plan.nprobe)
        return faiss.clone_index(cpu)

    monkeypatch.setattr(ann_gpu, "to_gpu", fake_to_gpu)
    monkeypatch.setattr(ann_gpu, "coarse_accelerator", lambda d, use_gpu: faiss.IndexFlatIP(d))  # its CPU stand-in
    x = clustered_vectors(8000, 16, 40, seed=5, spread=1.0)
    q = perturbed_queries(x, 200, seed=6, noise=1.0)
    cfg = TuneConfig(target=0.999, candidates=20, latency_budget_ms=1e4, n_queries=200, latency_queries=3, nlist=64)
    a, res = tune_ann(x, q, config=cfg)
    ivf = [t for t in res.trials if t.index_type == "ivf"]
    assert ivf and all(t.params["nprobe"] <= 8 for t in ivf), [t.params["nprobe"] for t in ivf]
    assert res.device == "cuda" and res.met and a.on_gpu
    assert res.index_type == "flat" or res.params["nprobe"] <= 8
    assert max(t.params["nprobe"] for t in ivf) == 8 and any("GPU nprobe limit 8" in t.note for t in ivf)
    assert clones  # everything the tuner searched went through the (stand-in) GPU clone
    # the cap itself: max_nprobe_frac of the cells, and the GPU limit for an IVF index searched on the GPU
    cpu_ivf = AnnIndex(build_index(x, np.arange(8000), AnnParams("ivf", nlist=64, coarse="flat"), use_gpu=False),
                       AnnParams("ivf", nlist=64, coarse="flat"))
    assert nprobe_cap(cpu_ivf, cfg, gpu=False) == 32 and nprobe_cap(cpu_ivf, cfg, gpu=True) == 8


# ------------------------------------------------------------------------------ 5. the install advice order
def _dockerfile_runs(path: Path) -> list[str]:
    text = path.read_text().replace("\\\n", " ")
    return [m.group(1) for m in re.finditer(r"^RUN (.+)$", text, re.M)]


def test_cuda_image_never_installs_faiss_cpu_nor_uninstalls_it_after_faiss_gpu():
    runs = _dockerfile_runs(REPO / "deploy" / "Dockerfile.cuda")
    pip = [(i, c) for i, run in enumerate(runs) for c in re.split(r"&&|;", run) if re.search(r"\bpip\b", c)]
    text = " ".join(c for _, c in pip)
    assert "uninstall" not in text  # nothing to uninstall: faiss-cpu is never installed
    req = next(i for i, (_, c) in enumerate(pip) if "install -r /tmp/requirements.txt" in c)
    proj = next(i for i, (_, c) in enumerate(pip) if re.search(r"pip install --no-deps \.", c))
    assert req < proj  # dependencies (with faiss-gpu) first, then the project without its faiss-cpu dependency
    assert any("pip show faiss-cpu" in c and "exit 1" in runs[i] for i, c in pip)  # the build fails if it crept in
    # the requirement list the image installs, computed by the image's own command
    gen = next(r for r in runs if "/tmp/requirements.txt" in r).split(" > /tmp/requirements.txt")[0]
    argv = shlex.split(gen)
    assert argv[:2] == ["python", "-c"]
    out = subprocess.run([sys.executable, "-c", argv[2]], cwd=REPO, capture_output=True, text=True, check=True).stdout
    reqs = out.split()
    assert not any(r.startswith("faiss-cpu") for r in reqs)
    gpu = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert gpu == ["faiss-gpu-cu12>=1.11"] and gpu[0] in reqs


def test_gpu_marker_is_registered():
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("gpu:") for m in markers)


# ------------------------------------------- building IVF with an accelerator (a GPU flat index; CPU here)
def test_ivf_built_with_an_assigner_equals_the_plain_build():
    """The GPU build path (k-means and cell assignment by a separate flat inner-product index) run with a CPU
    flat index: same centroids, same inverted lists, same search results as the quantiser doing it itself."""
    from gare_index.ann import add_assigned, train_ivf

    x = _units(6000, 32, seed=3)
    ids = np.arange(6000, dtype=np.int64) * 7 + 2
    q = perturbed_queries(x, 50, seed=4, noise=0.3)

    def fresh() -> faiss.IndexIVFFlat:
        return faiss.IndexIVFFlat(faiss.IndexFlatIP(32), 32, 64, faiss.METRIC_INNER_PRODUCT)

    plain, fast = fresh(), fresh()
    plain.train(x)
    plain.add_with_ids(x, ids)
    assigner = faiss.IndexFlatIP(32)
    train_ivf(fast, x, clustering_index=assigner)
    assert fast.clustering_index is None  # not left pointing at the caller's index
    np.testing.assert_array_equal(fast.quantizer.reconstruct_n(0, 64), plain.quantizer.reconstruct_n(0, 64))
    add_assigned(fast, x, ids, assigner)
    assert assigner.ntotal == 0 and fast.ntotal == 6000
    sizes = lambda ix: [ix.invlists.list_size(c) for c in range(64)]  # noqa: E731
    assert sizes(fast) == sizes(plain)
    for ix in (plain, fast):
        ix.nprobe = 8
    s_p, i_p = plain.search(q, 20)
    s_f, i_f = fast.search(q, 20)
    np.testing.assert_array_equal(i_f, i_p)
    np.testing.assert_allclose(s_f, s_p, rtol=0, atol=1e-6)


def test_build_index_uses_the_accelerator_only_with_a_gpu(monkeypatch):
    """No GPU (or use_gpu=False): no accelerator, the CPU build as before; use_gpu=True without one: refused."""
    assert ann_gpu.coarse_accelerator(16, False) is None
    if not HAS_GPU:
        assert ann_gpu.coarse_accelerator(16, None) is None
        with pytest.raises(GpuIndexError, match="faiss sees no GPU"):
            ann_gpu.coarse_accelerator(16, True)
    # the build path with an accelerator, driven through build_index by handing it a CPU flat index
    made = []

    def cpu_accel(d, use_gpu):
        made.append(faiss.IndexFlatIP(d))
        return made[-1]

    x = _units(3000, 16, seed=5)
    ids = np.arange(3000, dtype=np.int64)
    p = AnnParams("ivf", nlist=40, nprobe=40, coarse="flat")
    ref = build_index(x, ids, p, use_gpu=False)
    monkeypatch.setattr(ann_gpu, "coarse_accelerator", cpu_accel)
    got = build_index(x, ids, p, use_gpu=False)
    assert len(made) == 1 and got.ntotal == 3000
    q = x[:30]
    np.testing.assert_array_equal(got.search(q, 10)[1], ref.search(q, 10)[1])


# ------------------------------------------------------------------- on a real GPU (bench/gpu_check.sh's job)
@pytest.fixture(scope="module")
def gpu_data():
    x = clustered_vectors(100_000, 64, 1000, seed=7, spread=0.5)
    q = perturbed_queries(x, 200, seed=8, noise=0.3)
    return x, q, exact_search(x, q, 10)[1]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU and faiss-gpu")
def test_gpu_flat_returns_the_cpu_ids(gpu_data):
    x, q, _ = gpu_data
    ids = np.arange(x.shape[0], dtype=np.int64) * 5 + 1
    cpu = AnnIndex(build_index(x, ids, AnnParams("flat"), use_gpu=False), AnnParams("flat"))
    gpu = AnnIndex(faiss.clone_index(cpu.cpu_index), AnnParams("flat"), use_gpu=True)
    assert gpu.on_gpu and is_gpu(gpu._gpu)
    s_c, i_c = cpu.search(q, 100)
    s_g, i_g = gpu.search(q, 100)
    np.testing.assert_allclose(s_g, s_c, atol=1e-5)
    # identical ids, except that two results whose scores tie (to float32 rounding: cuBLAS and the CPU BLAS
    # sum in other orders) may trade places
    gap = np.abs(np.diff(s_c, axis=1)) < 1e-5
    tie = np.zeros_like(i_c, dtype=bool)
    tie[:, :-1] |= gap
    tie[:, 1:] |= gap
    assert ((i_g == i_c) | tie).all() and (i_g == i_c).mean() > 0.99
    # k above the GPU limit: the CPU copy answers, same results; faiss's own GPU index refuses it
    np.testing.assert_array_equal(gpu.search(q[:2], GPU_MAX_K + 1)[1], cpu.search(q[:2], GPU_MAX_K + 1)[1])
    with pytest.raises(RuntimeError):
        gpu._gpu.search(q[:1], GPU_MAX_K + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU and faiss-gpu")
def test_gpu_ivf_with_hnsw_coarse_quantiser_clones_and_matches_the_cpu(gpu_data):
    x, q, exact = gpu_data
    index = _ivf_with_centroids(x, COARSE_HNSW_MIN, "hnsw")  # what coarse="auto" builds from 16,384 cells
    p = AnnParams("ivf", nlist=COARSE_HNSW_MIN, nprobe=512, coarse="hnsw")
    cpu = AnnIndex(index, p, use_gpu=False)
    gpu = AnnIndex(faiss.clone_index(index), p, use_gpu=None)
    assert gpu.on_gpu and gpu.gpu_plan.cloner_options["allowCpuCoarseQuantizer"]
    r_cpu = recall_at_k(cpu.search(q, 256)[1], exact, 10)
    r_gpu = recall_at_k(gpu.search(q, 256)[1], exact, 10)
    assert abs(r_cpu - r_gpu) <= 0.001, (r_cpu, r_gpu)
    # without the option faiss >= 1.9 refuses the clone: the reason the plan sets it
    co = faiss.GpuMultipleClonerOptions()
    if hasattr(co, "allowCpuCoarseQuantizer"):
        co.allowCpuCoarseQuantizer = False
        with pytest.raises(RuntimeError, match="allowCpuCoarseQuantizer|not implemented on GPU"):
            faiss.index_cpu_to_all_gpus(index, co=co)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU and faiss-gpu")
def test_gpu_nprobe_above_the_limit(gpu_data):
    x, _, _ = gpu_data
    index = _ivf_with_centroids(x[:20_000], 4300, "flat")
    p = AnnParams("ivf", nlist=4300, nprobe=GPU_MAX_K + 1, coarse="flat")
    with pytest.raises(GpuIndexError, match="nprobe=2049"):
        AnnIndex(index, p, use_gpu=True)
    assert not AnnIndex(index, p, use_gpu=None).on_gpu
    # the limit is faiss's: cloning such an index directly throws
    faiss.extract_index_ivf(index).nprobe = GPU_MAX_K + 1
    with pytest.raises(RuntimeError, match="(?i)nprobe"):
        faiss.index_cpu_to_all_gpus(index)
    assert AnnIndex(index, dataclasses.replace(p, nprobe=GPU_MAX_K), use_gpu=True).on_gpu


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU and faiss-gpu")
def test_gpu_ivf_flat_add_remove_save_load_and_recall(gpu_data, tmp_path):
    x, q, exact = gpu_data
    p = AnnParams("ivf", nlist=1024, nprobe=64, coarse="flat")
    ids = np.arange(x.shape[0], dtype=np.int64)
    built = build_index(x, ids, p, use_gpu=True)  # build_index returns the GPU copy
    assert is_gpu(built)
    gpu = AnnIndex(built, p, use_gpu=True)
    cpu = AnnIndex(faiss.clone_index(gpu.cpu_index), p)
    assert gpu.on_gpu and not cpu.on_gpu
    r_cpu = recall_at_k(cpu.search(q, 256)[1], exact, 10)
    assert abs(recall_at_k(gpu.search(q, 256)[1], exact, 10) - r_cpu) <= 0.001
    assert gpu.remove_ids(ids[:1000]) == 1000 and not np.isin(gpu.search(q, 256)[1], ids[:1000]).any()
    gpu.add(x[:1000], ids[:1000])
    assert abs(recall_at_k(gpu.search(q, 256)[1], exact, 10) - r_cpu) <= 0.001
    gpu.save(tmp_path / "ann.faiss")
    back = AnnIndex.load(tmp_path / "ann.faiss", p, use_gpu=True)
    assert back.on_gpu and abs(recall_at_k(back.search(q, 256)[1], exact, 10) - r_cpu) <= 0.001


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU and faiss-gpu")
def test_gpu_tuner_choices_stay_within_the_limit(gpu_data):
    from gare_build.tuning.ladder import TuneConfig
    from gare_build.tuning.recall import tune_ann

    x, q, _ = gpu_data
    a, res = tune_ann(x, q, config=TuneConfig(n_queries=200, latency_queries=20))
    assert res.device == "cuda" and res.met and a.on_gpu
    assert res.index_type in ("ivf", "flat") and (res.params.get("nprobe") or 0) <= GPU_MAX_K


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU and faiss-gpu")
def test_gpu_assisted_ivf_build_matches_the_cpu_build(gpu_data):
    """k-means and cell assignment on the GPU (build_index's GPU path) give an index as good as the CPU build."""
    x, q, exact = gpu_data
    ids = np.arange(x.shape[0], dtype=np.int64)
    p = AnnParams("ivf", nlist=1024, nprobe=64, coarse="flat")
    on_gpu = AnnIndex(build_index(x, ids, p, use_gpu=False, assign_on_gpu=True), p)
    on_cpu = AnnIndex(build_index(x, ids, p, use_gpu=False), p)
    assert not is_gpu(on_gpu.cpu_index) and on_gpu.ntotal == on_cpu.ntotal == x.shape[0]
    r_gpu = recall_at_k(on_gpu.search(q, 256)[1], exact, 10)
    r_cpu = recall_at_k(on_cpu.search(q, 256)[1], exact, 10)
    assert r_gpu >= r_cpu - 0.005, (r_gpu, r_cpu)
