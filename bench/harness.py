"""The one place a benchmark records where its figures come from, writes its JSON and renders its markdown.

Every script in bench/ runs as a module of this package (``python -m bench.NAME``) and declares, in a module-level
``MEASURES`` tuple, the product paths (files, folders or git globs from the repository root) whose code its report
measures: ``python -m bench.stale`` lists a report as stale when one of those paths changed after the report's
commit. A run calls :func:`start` when it begins and :meth:`Run.record` when it ends; the record, kept under the
JSON's ``"run"`` key, holds

- ``commit``: HEAD's full hash when the run started (``GARE_COMMIT`` names it on a copy without .git, e.g. a lent
  GPU machine), and ``dirty`` / ``dirty_paths``: what ``git status --porcelain`` showed outside the generated
  evidence (bench/results/, docs/, README.md: a run or the table generator rewrites those; anything else is code
  the commit does not hold);
- ``command``: the command line, as ``python -m bench.NAME ARGS``;
- ``machine``: CPU model, the ``avx2`` / ``avx512_bf16`` flags, cores, and the load average before and after;
- ``started`` / ``finished`` (UTC, ISO 8601) and ``elapsed_s``;
- ``script`` and ``measures``: the script that wrote the report and the product paths it declares;
- ``inputs``: the sha256 of every input file the script named with :meth:`Run.add_inputs` (a checkpoint; a corpus
  folder is hashed as the sorted list of its files' paths and hashes), so a figure names the exact model and data
  it came from.

``--render`` (:func:`add_render_arg`, :func:`render_saved`) re-renders a report's markdown from its saved JSON
without running anything.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import hashlib
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
UNKNOWN_COMMIT = "unknown"  # what a report says when the code it ran cannot be named (never a guessed hash)
# generated evidence: a run (or `python -m bench.stale --readme`) rewrites these, so they do not make a tree dirty
GENERATED = ("bench/results", "docs", "README.md")
CPU_FLAGS = ("avx2", "avx512_bf16")


# ------------------------------------------------------------------------------------------------ git
def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """{"commit": HEAD's full hash, "dirty": bool, "dirty_paths": [the first 20 lines of git status]} for the tree
    at ``repo``; commit None where it cannot be read (no git, no .git) and ``GARE_COMMIT`` names none."""
    if os.environ.get("GARE_COMMIT"):
        return {"commit": os.environ["GARE_COMMIT"], "dirty": None, "dirty_paths": [], "source": "GARE_COMMIT"}
    try:
        head = _git("rev-parse", "HEAD", cwd=repo).strip()
        status = _git("status", "--porcelain", "--", ".", *(f":!{p}" for p in GENERATED), cwd=repo).splitlines()
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("cannot read the git commit (%s): the report records none", e)
        return {"commit": None, "dirty": None, "dirty_paths": [], "source": "none"}
    return {"commit": head, "dirty": bool(status), "dirty_paths": status[:20], "source": "git"}


# read once, when the first script imports this module: a long run records the code it started with, not HEAD at
# its end
STATE_AT_START = git_state()


def git_commit() -> str:
    """The commit this run started at as the older reports wrote it: 12 characters, "-dirty" when the tree was
    dirty, :data:`UNKNOWN_COMMIT` when unknown."""
    c = STATE_AT_START["commit"]
    if not c:
        return UNKNOWN_COMMIT
    return c[:12] + ("-dirty" if STATE_AT_START["dirty"] else "")


# ------------------------------------------------------------------------------------------------ machine
def cpu_name() -> str:
    """The processor's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> dict[str, bool]:
    """{flag: present} for :data:`CPU_FLAGS` (the instruction sets the int8/bf16 kernels pick between)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return {f: f in have for f in CPU_FLAGS}
    except OSError:
        pass
    return {f: False for f in CPU_FLAGS}


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded ([] where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine() -> dict[str, Any]:
    """CPU, cores and the library versions and thread counts a figure depends on (faiss / torch when installed)."""
    import numpy as np

    try:
        import faiss
    except ImportError:  # a benchmark that needs no ANN, on a host without faiss (the lent GPU machine)
        faiss = None
    try:
        import torch
    except ImportError:  # the ANN benchmark needs only numpy + faiss (e.g. on a bare benchmark host)
        torch = None
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads() if torch else None,
        "faiss_threads": faiss.omp_get_max_threads() if faiss else None,
        "gpu": torch.cuda.get_device_name(0) if torch and torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__ if torch else "not installed",
        "faiss": getattr(faiss, "__version__", "?") if faiss else "not installed",
        "numpy": np.__version__,
    }


def command_line(argv: Sequence[str] | None = None, module: str | None = None) -> str:
    """The command line a reader repeats from the repository root: ``python -m bench.NAME ARGS`` for a bench
    module (``module``: its ``__name__``; default the running ``__main__``), ``python PATH ARGS`` otherwise;
    ``argv`` defaults to this process's arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    name = _module_name(module or "__main__")
    if name:
        return "python -m " + shlex.join([name, *args])
    return "python " + shlex.join([os.path.relpath(sys.argv[0], REPO), *args])


def _module_name(module: str) -> str | None:
    """A module's import name: ``__main__`` resolves to what ``python -m`` ran (None for a plain script)."""
    if module != "__main__":
        return module
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None and spec.name else None


def _utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------------------ a run
class Run:
    """One benchmark run: what it measures, where it started (commit, machine, load) and, on :meth:`record`, how
    it ended."""

    def __init__(self, script: str, measures: Sequence[str], command: str) -> None:
        self.script = script
        self.command = command
        self.measures = list(measures)
        self.started = time.time()
        self.load_before = loadavg()
        self.state = STATE_AT_START
        self.inputs: dict[str, str] = {}

    def add_inputs(self, *paths: str | Path) -> None:
        """Record the sha256 of each input (a file, or a folder: :func:`sha256_of`) under its path as given."""
        for p in paths:
            self.inputs[str(p)] = sha256_of(Path(p))

    def record(self) -> dict[str, Any]:
        """The provenance block (see the module docstring), with the load and time at this call as the end."""
        finished = time.time()
        return {
            "commit": self.state["commit"], "dirty": self.state["dirty"], "dirty_paths": self.state["dirty_paths"],
            "commit_source": self.state["source"], "command": self.command, "script": self.script,
            "measures": self.measures,
            "machine": {"cpu": cpu_name(), "flags": cpu_flags(), "cores": os.cpu_count(),
                        "load_before": self.load_before, "load_after": loadavg()},
            "started": _utc(self.started), "finished": _utc(finished), "elapsed_s": round(finished - self.started, 1),
            **({"inputs": dict(self.inputs)} if self.inputs else {}),
        }


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_of(path: Path) -> str:
    """A file's sha256; for a folder, the sha256 of the lines ``RELPATH SHA256`` of every file under it, sorted by
    path (so a renamed, added, removed or changed file changes it). A missing path is an error that names it."""
    if path.is_file():
        return _file_sha256(path)
    if not path.is_dir():
        raise FileNotFoundError(f"benchmark input {path} does not exist")
    lines = [f"{f.relative_to(path).as_posix()} {_file_sha256(f)}\n"
             for f in sorted(path.rglob("*")) if f.is_file()]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def script_path(module: str) -> str:
    """``bench.NAME`` (a module's ``__name__``, or ``__main__`` run by ``python -m``) -> ``bench/NAME.py``."""
    name = _module_name(module)
    return name.replace(".", "/") + ".py" if name else os.path.relpath(sys.argv[0], REPO)


def start(module: str, measures: Sequence[str], argv: Sequence[str] | None = None) -> Run:
    """A run of the script whose ``__name__`` is ``module``, measuring ``measures`` (its ``MEASURES``), with the
    arguments ``argv`` (default: this process's)."""
    return Run(script_path(module), measures, command_line(argv, module))


# ------------------------------------------------------------------------------------------------ writing
def provenance_md(data: dict[str, Any]) -> str:
    """One markdown paragraph from a report's ``"run"`` block ("" for a report written before the harness)."""
    r = data.get("run")
    if not r:
        return ""
    m = r["machine"]
    commit = (r["commit"] or UNKNOWN_COMMIT)[:12]
    state = {True: " (dirty tree)", False: "", None: " (tree state unknown)"}[r["dirty"]]
    flags = ", ".join(f for f, on in m["flags"].items() if on) or "none of " + "/".join(m["flags"])
    return (f"Run: `{r['command']}` at commit {commit}{state}, {r['started']} to {r['finished']} "
            f"({r['elapsed_s']:.0f} s). Machine: {m['cpu']} ({flags}), {m['cores']} cores, load "
            f"{'/'.join(map(str, m['load_before']))} before and {'/'.join(map(str, m['load_after']))} after. "
            f"Measures: {', '.join(f'`{p}`' for p in r['measures'])}."
            + ("".join(f" Input `{p}`: sha256 {h[:16]}." for p, h in r.get("inputs", {}).items())) + "\n")


def with_provenance(render: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
    """A renderer that also shows the run's record: ``render``'s markdown with :func:`provenance_md` after its
    title (its first ``# `` line) when the JSON has a ``"run"`` block, unchanged for a report written before the
    harness. Used as a decorator on a script's ``markdown(data)``."""
    @functools.wraps(render)
    def rendered(data: dict[str, Any]) -> str:
        md = render(data)
        return _under_title(md, data) if data.get("run") else md
    return rendered


def _under_title(md: str, data: dict[str, Any]) -> str:
    """``md`` with :func:`provenance_md` of ``data`` after its title (its first ``# `` line)."""
    lines = md.split("\n")
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("# ")), 0)
    return "\n".join([*lines[:at], "", provenance_md(data).rstrip("\n"), *lines[at:]])


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    return path


def write_report(json_path: Path, data: dict[str, Any], render: Callable[[dict[str, Any]], str],
                 md_path: Path | None = None) -> Path:
    """Write ``data`` to ``json_path`` and ``render(data)`` to ``md_path`` (default: the JSON's name with .md);
    returns the markdown's path."""
    write_json(json_path, data)
    md = md_path or json_path.with_suffix(".md")
    md.write_text(render(data), encoding="utf-8")
    return md


def add_render_arg(ap: argparse.ArgumentParser, default: Path) -> None:
    """``--render [JSON]``: re-render the markdown from a saved JSON (default ``default``) and run nothing."""
    ap.add_argument("--render", nargs="?", type=Path, const=default, default=None, metavar="JSON",
                    help=f"re-render the markdown from a saved JSON (default {os.path.relpath(default, REPO)}) "
                         "without running the benchmark")


def render_requested(default: Path, render: Callable[[dict[str, Any]], str] | None = None,
                     argv: Sequence[str] | None = None) -> bool:
    """Whether the command line asks for ``--render [JSON]``; if so the markdown is re-rendered (by ``render``,
    default :func:`body_markdown`) from the saved JSON here, before the script's own parser could ask for the
    arguments of a run."""
    pre = argparse.ArgumentParser(add_help=False)
    add_render_arg(pre, default)
    ns, _ = pre.parse_known_args(argv)
    if ns.render is None:
        return False
    try:
        print(render_saved(ns.render, render or body_markdown))
    except ValueError as e:  # a report written before its body was kept: nothing to render it from
        raise SystemExit(f"{ns.render}: {e}") from e
    return True


def render_saved(json_path: Path, render: Callable[[dict[str, Any]], str], md_path: Path | None = None) -> Path:
    """Rewrite a report's markdown from its saved JSON; returns the markdown's path."""
    data = json.loads(json_path.read_text(encoding="utf-8"))
    md = md_path or json_path.with_suffix(".md")
    md.write_text(render(data), encoding="utf-8")
    log.info("rendered %s from %s", md, json_path)
    return md


def stamp_product_report(json_path: Path, run: Run, extra: dict[str, Any] | None = None) -> Path:
    """Give a report that a product command wrote (``gare-train eval``, ``gare-index compare``: their own JSON and
    markdown, which know nothing of bench/) this run's record: the JSON gains ``"run"`` (and ``extra``), and the
    markdown beside it (same name, .md) gains :func:`provenance_md` under its title. Returns the markdown's path."""
    data = json.loads(json_path.read_text(encoding="utf-8"))
    data.update(extra or {})
    data["run"] = run.record()
    write_json(json_path, data)
    md = json_path.with_suffix(".md")
    md.write_text(_under_title(md.read_text(encoding="utf-8"), data), encoding="utf-8")
    return md


# ------------------------------------------------------------------------------------------------ body reports
def body_markdown(data: dict[str, Any]) -> str:
    """The report of a script whose tables are built during the run (:func:`write_results`): a header rendered
    from the JSON's provenance, then the body the run stored under ``"report_body"``."""
    if "report_body" not in data:
        raise ValueError(f"{data.get('command')!r} wrote this report before the harness kept its body: rerun it")
    m = data.get("machine", {})
    head = f"# {data['title']}\n\n" + (provenance_md(data) + "\n" if data.get("run") else
                                       f"Command (from the repository root): `{data.get('command')}`; commit "
                                       f"{data.get('commit')}\n\n")
    head += (f"Machine: {m.get('cpu')}, {m.get('cores')} cores, GPU: {m.get('gpu') or 'none'}; torch "
             f"{m.get('torch')}, faiss {m.get('faiss')}, numpy {m.get('numpy')}. Benchmark wall time: "
             f"{data.get('elapsed_s', 0):.0f} s. Date: {data.get('date', '?')}.\n\n")
    return head + data["report_body"].rstrip() + "\n"


def write_results(name: str, title: str, markdown_body: str, data: dict[str, Any], run: Run) -> Path:
    """bench/results/NAME.{json,md} for a script whose markdown body is built during the run: the JSON holds the
    run's record, the machine, the data and the body, and :func:`body_markdown` renders the markdown from it (so
    ``--render`` can redo the header)."""
    rec = run.record()
    payload = {"command": rec["command"], "commit": git_commit(), "machine": machine(),
               "elapsed_s": rec["elapsed_s"], "date": rec["started"][:10], "title": title, **data,
               "report_body": markdown_body, "run": rec}
    md = write_report(RESULTS / f"{name}.json", payload, body_markdown)
    print(md.read_text(encoding="utf-8"))
    return md
