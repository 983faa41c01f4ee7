"""The folded psi's numba kernels (gare/psi_fold_cpu_kernel.py) load from numba's on-disk cache in a process
after the first, and the loaded code scores bit for bit as a fresh compile; with no writable cache directory
they still compile (in memory) and score the same.

Each run is a fresh interpreter (a process loads or compiles a kernel once) on one layout per kernel: float16
frames and constants with v̄ rows (the float16 reader in the frame loop and in the constants), the widening of
every float16 bit pattern and the query fold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from gare import psi_fold_cpu as pc

ROOT = Path(__file__).resolve().parents[2]

# run in a fresh interpreter: score the fixed problem, save the outputs, print each kernel's cache hits/misses
_SCRIPT = r"""
import json, sys
from types import SimpleNamespace
import numpy as np
from gare import psi_fold_cpu as pc, psi_fold_cpu_queries as pq
from gare import psi_fold_cpu_kernel as K

rng = np.random.default_rng(0)
n, f, d, a, k = 30, 5, 24, 3, 11
w = pc._N_VEC * f + pc._N_MAT * f * f + 2
t = rng.standard_normal((a, d)).astype(np.float32)
qm = (rng.standard_normal((d, 2 * d + 3)) * 0.2).astype(np.float32)
u, sc = pq.fold_query_rows(t, qm)
q = SimpleNamespace(u=u, sc=sc, wsc=rng.random(4).astype(np.float32), eps=(1e-5, 1e-5, 1e-5), inv_temp=7.0)
pk = (rng.random((n, w)) * 0.5).astype(np.float32)
pk[:, 4 * f:5 * f] = rng.standard_normal((n, f))  # omega: some frames masked
frames = rng.standard_normal((n, f, d)).astype(np.float16)
vr, vs = rng.standard_normal((n, d)).astype(np.float32), rng.random(n).astype(np.float32)
s = pc.pair_scores(q, frames, pk.astype(np.float16), rng.integers(0, n, (a, k)), vrows=vr, vscale=vs)
wide = pc.widen_half(np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(256, 256))
np.savez(sys.argv[1], u=u, sc=sc, scores=s, wide=wide)
stats = {name: [sum(fn.stats.cache_hits.values()), sum(fn.stats.cache_misses.values())]
         for name, fn in (("kernel", K.kernel), ("widen_rows", K.widen_rows), ("fold_rows", K.fold_rows))}
print("STATS " + json.dumps(stats))
"""


def _run(out: Path, cache_dir: Path, **env: str) -> tuple[dict[str, list[int]], subprocess.CompletedProcess]:
    """Run _SCRIPT in a fresh interpreter with NUMBA_CACHE_DIR = cache_dir: ({kernel: [hits, misses]}, process)."""
    paths = [str(ROOT / p) for p in ("training", "indexer", "service")] + [str(ROOT)]
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "NUMBA_CACHE_DIR": str(cache_dir), **env}
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(out)], cwd=ROOT, env=full, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("STATS "))
    return json.loads(line[len("STATS "):]), p


def _assert_bitwise_equal(a: Path, b: Path) -> None:
    x, y = np.load(a), np.load(b)
    assert sorted(x.files) == sorted(y.files)
    for k in x.files:
        assert x[k].dtype == y[k].dtype == np.float32 and x[k].shape == y[k].shape, k
        # bit patterns, so NaNs (the widening of NaN halves) and signed zeros count too
        assert np.array_equal(x[k].view(np.uint32), y[k].view(np.uint32)), k


def test_second_process_loads_the_kernels_from_the_cache_bit_for_bit(tmp_path):
    cache = tmp_path / "numba-cache"
    first, _ = _run(tmp_path / "first.npz", cache)
    assert all(h == 0 and m >= 1 for h, m in first.values()), first  # an empty cache: every kernel compiled
    assert list(cache.rglob("psi_fold_cpu_kernel.kernel-*.nbi")), sorted(p.name for p in cache.rglob("*"))
    second, _ = _run(tmp_path / "second.npz", cache)
    assert all(h >= 1 and m == 0 for h, m in second.values()), second  # every kernel loaded, none compiled
    _assert_bitwise_equal(tmp_path / "first.npz", tmp_path / "second.npz")

    # no writable cache directory (numba is left only its zip-file locator, which fits no plain file): the
    # kernels compile in memory, with a WARNING each, and score the same bits
    uncached, p = _run(tmp_path / "uncached.npz", tmp_path / "unused", NUMBA_CACHE_LOCATOR_CLASSES="ZipCacheLocator")
    assert all(h == 0 and m >= 1 for h, m in uncached.values()), uncached
    assert "numba cannot cache kernel" in p.stderr, p.stderr[-4000:]
    assert not (tmp_path / "unused").exists()
    _assert_bitwise_equal(tmp_path / "first.npz", tmp_path / "uncached.npz")


def test_kernel_constants_are_the_callers():
    """psi_fold_cpu keeps its own copy of the layout counts and the eps (it imports the kernel module, and so
    numba, only on first use): they must be the kernel's."""
    from gare import psi_fold_cpu_kernel as kernel_module

    assert (pc._N_VEC, pc._N_MAT, pc._COS_EPS) == (kernel_module.N_VEC, kernel_module.N_MAT, kernel_module.COS_EPS)


def test_importing_the_cpu_rerank_does_not_import_numba():
    code = ("import sys; import gare.psi_fold_cpu, gare.psi_fold_cpu_queries, gare.psi_fold_queries; "
            "assert 'numba' not in sys.modules and 'gare.psi_fold_cpu_kernel' not in sys.modules")
    paths = os.pathsep.join([str(ROOT / "training"), str(ROOT)])
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": paths},
                   timeout=300)
