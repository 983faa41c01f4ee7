"""The dependency rule (docs/architecture.md): ``training`` core <- ``indexer`` <- ``service``.

Every import of the three packages is read from the source (module top AND inside functions, so a hidden
import counts), resolved to a project module and checked: nothing imports a layer above it, the heavy
training modules are imported only from the CLI-side modules, and the project's import graph has no cycle.
The checker itself is tested on small made-up trees, so a broken parser cannot make the rule pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("training", "indexer", "service")
LAYER = {"training": 0, "indexer": 1, "service": 2}

# Heavy training modules (datasets, the training loop, evaluation, the authors' import, the synthetic corpus):
# only the CLIs and the modules listed in CLI_SIDE may import them.
HEAVY = {"training.data", "training.fit", "training.evaluate", "training.official", "training.synth", "training.cli"}
CLI_SIDE = HEAVY | {
    "training.synth",  # the corpus generator is itself CLI-side (gare-train synth, tests, demo)
    "indexer.cli",
    "indexer.compare",  # gare-index compare reads a captioned test set
    "indexer.invgc_select",  # gare-index build --invgc reads and encodes a validation split
    "service.cli",
    "service.demo",
}


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_imports(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports (absolute names; `from pkg import mod` resolves to pkg.mod)."""
    files = {_module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    known = set(files)
    out: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base[: len(base) - (node.level - 1)]
                    target = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # `from pkg import mod` names the module pkg.mod; `from mod import attr` names mod
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in known:  # a.b.c -> a.b -> a (the deepest project module named)
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    deps.add(name)
        out[mod] = deps
    return out


def _within(mod: str, names: set[str]) -> bool:
    """mod is one of names or a module inside one of them (a heavy package's modules are heavy too)."""
    return any(mod == n or mod.startswith(n + ".") for n in names)


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            top, dtop = mod.split(".")[0], dep.split(".")[0]
            if dtop in LAYER and top in LAYER and LAYER[dtop] > LAYER[top]:
                bad.append(f"{mod} imports {dep}: an upward import ({top} is below {dtop})")
            if _within(dep, HEAVY) and not _within(mod, CLI_SIDE):
                bad.append(f"{mod} imports the heavy {dep} (only CLI-side modules may: {sorted(CLI_SIDE - HEAVY)})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (one per back edge)."""
    found, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_no_upward_or_heavy_imports():
    bad = violations(project_imports(ROOT))
    assert not bad, "dependency rule broken (docs/architecture.md):\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycles(project_imports(ROOT))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_query_time_search_lives_in_the_indexer():
    graph = project_imports(ROOT)
    assert "indexer.search" in graph and "indexer.ncl_ann" in graph
    assert not (ROOT / "service" / "search.py").exists()
    assert "indexer.search" in graph["service.app"] or any("indexer.search" in graph[m] for m in graph if m.startswith("service."))


# ------------------------------------------------------------------------------------------ the checker itself
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize("text", [
    "from service.app import x\n",  # top-level, absolute
    "def f():\n    from service import app\n",  # hidden in a function, `from pkg import mod`
    "import service.app\n",
])
def test_checker_catches_an_upward_import(tmp_path, text):
    root = _tree(tmp_path, {"indexer/store.py": text, "service/app.py": ""})
    bad = violations(project_imports(root))
    assert bad == ["indexer.store imports service.app: an upward import (indexer is below service)"]


def test_checker_catches_a_heavy_import_and_allows_a_cli(tmp_path):
    root = _tree(tmp_path, {"training/data.py": "", "indexer/build.py": "def f():\n    from training.data import x\n",
                            "indexer/cli.py": "from training import data\n"})
    assert violations(project_imports(root)) == [
        "indexer.build imports the heavy training.data (only CLI-side modules may: "
        f"{sorted(CLI_SIDE - HEAVY)})"]


def test_checker_treats_a_heavy_package_s_modules_as_heavy(tmp_path):
    root = _tree(tmp_path, {"training/synth/__init__.py": "from .mp4 import w\n", "training/synth/mp4.py": "",
                            "training/model.py": "from training.synth.mp4 import w\n"})
    assert violations(project_imports(root)) == [
        "training.model imports the heavy training.synth.mp4 (only CLI-side modules may: "
        f"{sorted(CLI_SIDE - HEAVY)})"]


def test_checker_finds_a_relative_import_cycle(tmp_path):
    root = _tree(tmp_path, {"indexer/store.py": "def f():\n    from .postprocess import y\n",
                            "indexer/postprocess.py": "from .store import x\n"})
    graph = project_imports(root)
    assert graph["indexer.store"] == {"indexer.postprocess"} and graph["indexer.postprocess"] == {"indexer.store"}
    assert cycles(graph) == [["indexer.postprocess", "indexer.store", "indexer.postprocess"]]
