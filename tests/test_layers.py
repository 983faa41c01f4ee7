"""The house rules (docs/architecture.md), read from the source.

Packages and who may import whom:

    gare (core library)  <-  gare_index (the format)  <-  gare_search  <-  gare_serve
                         <-  gare_train (trainer)           ^
                                                            +---------  gare_build (builder)
    gare_demo may import everything; bench/ imports product code only; tests/ import product code and their own
    helpers, and only tests/test_evidence.py may import bench/.

Every import is read (module top AND inside functions, so a hidden import counts), resolved to a project module
(an edge to a package is an edge to its ``__init__``) and checked: no import outside the table, no cycle, the
service's whole import closure holds no builder or trainer module, a project import inside a function is rare
and says why on its line, no module imports another module's underscore name, no product file is over 500
lines, and every product module opens with a docstring saying what it owns. The checker itself is tested on
small made-up trees, so a broken parser cannot make the rules pass.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("gare", "gare_index", "gare_search", "gare_build", "gare_serve", "gare_train", "gare_demo")
TOPS = PRODUCT + ("bench", "tests")
# package -> the packages it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "gare": set(),
    "gare_index": {"gare"},
    "gare_search": {"gare", "gare_index"},
    "gare_serve": {"gare", "gare_index", "gare_search"},
    "gare_build": {"gare", "gare_index", "gare_search"},
    "gare_train": {"gare"},
    "gare_demo": {"gare", "gare_index", "gare_search", "gare_serve", "gare_build", "gare_train"},
    "bench": set(PRODUCT),
    "tests": set(PRODUCT),
}
EVIDENCE_TESTS = "tests.test_evidence"  # the one test module that may import bench/ (its renderers)
MAX_FUNCTION_IMPORTS = 10  # project imports inside functions, in all product code together
MAX_LINES = 500


@dataclass
class Edge:
    src: str  # importing module
    dst: str  # the project module imported (deepest known module named)
    line: int
    in_function: bool
    commented: bool  # the import's line(s) carry a comment
    names: list[str] = field(default_factory=list)  # the names taken by `from x import a, b`


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def source_files(root: Path, tops=TOPS) -> dict[str, Path]:
    return {_module_name(p, root): p for top in tops if (root / top).is_dir() for p in (root / top).rglob("*.py")}


def project_edges(root: Path, tops=TOPS) -> list[Edge]:
    files = source_files(root, tops)
    known = set(files)
    edges: list[Edge] = []
    for mod, path in files.items():
        text = path.read_text(encoding="utf-8")
        lines = text.split("\n")
        tree = ast.parse(text, filename=str(path))
        in_fn: set[int] = set()
        for f in ast.walk(tree):
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                in_fn |= {id(n) for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)}
        is_pkg = path.name == "__init__.py"
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [(a.name, []) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base[: len(base) - (node.level - 1)]
                    target = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # `from pkg import mod` names the module pkg.mod; `from mod import attr` names mod (attr kept)
                targets = []
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    targets.append((sub, []) if sub in known else (target, [a.name]))
            else:
                continue
            span = lines[node.lineno - 1: (node.end_lineno or node.lineno)]
            commented = any("#" in ln for ln in span)
            for name, names in targets:
                while name and name not in known:  # a.b.c -> a.b -> a (the deepest project module named)
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    edges.append(Edge(mod, name, node.lineno, id(node) in in_fn, commented, names))
    return edges


def graph_of(edges: list[Edge]) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for e in edges:
        g.setdefault(e.src, set()).add(e.dst)
    return g


def _top(mod: str) -> str:
    return mod.split(".")[0]


def violations(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        src, dst = _top(e.src), _top(e.dst)
        if src == dst:
            continue
        ok = dst in ALLOWED.get(src, set()) or (dst == "bench" and e.src == EVIDENCE_TESTS)
        if not ok:
            bad.append(f"{e.src}:{e.line} imports {e.dst} ({src} may import {sorted(ALLOWED.get(src, set()))})")
    return sorted(set(bad))


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


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += graph.get(m, ())
        # importing a.b.c runs a/__init__ and a/b/__init__ first, with their imports
        todo += [".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)]
    return seen


def function_imports(edges: list[Edge]) -> list[Edge]:
    """Project imports inside functions in product code (one per import statement)."""
    seen, out = set(), []
    for e in edges:
        if e.in_function and _top(e.src) in PRODUCT and (e.src, e.line) not in seen:
            seen.add((e.src, e.line))
            out.append(e)
    return out


def underscore_imports(edges: list[Edge]) -> list[str]:
    return sorted(f"{e.src}:{e.line} imports {e.dst}.{n}" for e in edges
                  if _top(e.src) in PRODUCT for n in e.names if n.startswith("_") and not n.startswith("__"))


# ------------------------------------------------------------------------------------------------ the rules
@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return project_edges(ROOT)


def test_every_import_follows_the_package_table(edges):
    bad = violations(edges)
    assert not bad, "dependency rule broken (docs/architecture.md):\n" + "\n".join(bad)


def test_no_import_cycles(edges):
    found = cycles(graph_of(edges))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_service_never_loads_the_builder_or_the_trainer(edges):
    graph = graph_of(edges)
    reach = closure(graph, "gare_serve.app") | closure(graph, "gare_serve.cli")
    assert "gare_search.search" in reach and "gare_index.store" in reach  # the request path is there
    leaked = sorted(m for m in reach if _top(m) in ("gare_build", "gare_train"))
    assert not leaked, f"the service's import closure holds {leaked}"


def test_function_level_project_imports_are_few_and_say_why(edges):
    found = function_imports(edges)
    silent = [f"{e.src}:{e.line} ({e.dst})" for e in found if not e.commented]
    assert not silent, "a project import inside a function must say why on its line:\n" + "\n".join(silent)
    assert len(found) <= MAX_FUNCTION_IMPORTS, (
        f"{len(found)} project imports inside functions (at most {MAX_FUNCTION_IMPORTS}):\n"
        + "\n".join(f"{e.src}:{e.line} ({e.dst})" for e in found))


def test_no_module_imports_another_module_s_underscore_names(edges):
    bad = underscore_imports(edges)
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_no_product_file_is_over_500_lines():
    files = source_files(ROOT, PRODUCT)
    long = {m: n for m, p in files.items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_every_product_module_says_what_it_owns():
    files = source_files(ROOT, PRODUCT)
    bare = sorted(m for m, p in files.items()
                  if not (ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or "").strip())
    assert not bare, f"modules without a docstring: {bare}"


# ------------------------------------------------------------------------------------------ the checker itself
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for pkg in TOPS:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize("text", [
    "from gare_serve.app import x\n",  # top-level, absolute
    "def f():\n    from gare_serve import app\n",  # hidden in a function, `from pkg import mod`
    "import gare_serve.app\n",
])
def test_checker_catches_an_import_outside_the_table(tmp_path, text):
    root = _tree(tmp_path, {"gare_index/store.py": text, "gare_serve/app.py": ""})
    bad = violations(project_edges(root))
    assert len(bad) == 1 and bad[0].startswith("gare_index.store:") and "imports gare_serve.app" in bad[0]


def test_checker_counts_an_edge_to_a_package_init(tmp_path):
    root = _tree(tmp_path, {"gare_serve/app.py": "import gare_build\n"})
    edges = project_edges(root)
    assert [(e.src, e.dst) for e in edges] == [("gare_serve.app", "gare_build")]
    assert len(violations(edges)) == 1


def test_checker_sees_the_builder_through_an_init(tmp_path):
    root = _tree(tmp_path, {"gare_serve/app.py": "from gare_search import search\nimport gare_serve.cli\n",
                            "gare_serve/cli.py": "", "gare_index/store.py": "",
                            "gare_search/search.py": "from gare_index import store\n",
                            "gare_index/__init__.py": "from gare_build import tune\n", "gare_build/tune.py": ""})
    graph = graph_of(project_edges(root))
    assert "gare_build.tune" in closure(graph, "gare_serve.app")


def test_checker_lets_only_the_evidence_tests_import_bench(tmp_path):
    root = _tree(tmp_path, {"tests/test_evidence.py": "import bench.render\n", "tests/test_x.py": "import bench.render\n",
                            "bench/render.py": "from tests import support\n", "tests/support.py": ""})
    bad = violations(project_edges(root))
    assert [b.split(":")[0] for b in bad] == ["bench.render", "tests.test_x"]


def test_checker_finds_a_relative_import_cycle(tmp_path):
    root = _tree(tmp_path, {"gare_index/store.py": "def f():\n    from .meta import y\n",
                            "gare_index/meta.py": "from .store import x\n"})
    graph = graph_of(project_edges(root))
    assert graph["gare_index.store"] == {"gare_index.meta"} and graph["gare_index.meta"] == {"gare_index.store"}
    assert cycles(graph) == [["gare_index.meta", "gare_index.store", "gare_index.meta"]]


def test_checker_counts_function_imports_and_their_comments(tmp_path):
    root = _tree(tmp_path, {"gare/a.py": "def f():\n    from gare import b  # heavy: numba compile\n",
                            "gare/c.py": "def g():\n    from gare.b import x\n", "gare/b.py": "x = 1\n"})
    found = function_imports(project_edges(root))
    assert sorted((e.src, e.commented) for e in found) == [("gare.a", True), ("gare.c", False)]


def test_checker_catches_an_underscore_import(tmp_path):
    root = _tree(tmp_path, {"gare/a.py": "from gare.b import _private, public, __version__\n", "gare/b.py": ""})
    assert underscore_imports(project_edges(root)) == ["gare.a:1 imports gare.b._private"]
