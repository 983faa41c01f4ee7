"""Shared helpers for the indexer benchmarks (bench/index_*.py): machine info and result files."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from support import git_commit  # noqa: E402 - bench/ is on sys.path when a bench script runs


def cpu_name() -> str:
    """The processor's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    import numpy as np

    try:
        import faiss
    except ImportError:  # a benchmark that needs no ANN, on a host without faiss (the lent GPU machine)
        faiss = None

    try:
        import torch
    except ImportError:  # the ANN benchmark needs only numpy + faiss (e.g. on a bare benchmark host)
        torch = None

    cpu = cpu_name()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads() if torch else None,
        "faiss_threads": faiss.omp_get_max_threads() if faiss else None,
        "gpu": torch.cuda.get_device_name(0) if torch and torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__ if torch else "not installed",
        "faiss": getattr(faiss, "__version__", "?") if faiss else "not installed",
        "numpy": np.__version__,
    }


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def write_results(name: str, title: str, markdown_body: str, data: dict[str, Any], started: float) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    info = machine()
    elapsed = time.time() - started
    commit = git_commit()
    header = (
        f"# {title}\n\n"
        f"Command (from the repository root): `{command_line()}`; commit {commit}\n\n"
        f"Machine: {info['cpu']}, {info['cores']} cores, GPU: {info['gpu'] or 'none'}; torch {info['torch']}, "
        f"faiss {info['faiss']}, numpy {info['numpy']}. Benchmark wall time: {elapsed:.0f} s. "
        f"Date: {time.strftime('%Y-%m-%d', time.gmtime())}.\n\n"
    )
    md = RESULTS / f"{name}.md"
    md.write_text(header + markdown_body.rstrip() + "\n")
    payload = {"command": command_line(), "commit": commit, "machine": info, "elapsed_s": round(elapsed, 1), **data}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(md.read_text())
    return md


def table(headers: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out) + "\n"
