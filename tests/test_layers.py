"""The house rules (docs/architecture.md), read from the source.

The design card's source roots and the packages each holds; a folder imports only itself and the folders below:

    service/   gare_serve, gare_demo
    indexer/   gare_index, gare_search, gare_build
    training/  gare (the core library), gare_train (the trainer)

Packages and who may import whom:

    gare (core library)  <-  gare_index (the format)  <-  gare_search  <-  gare_serve
                         <-  gare_train (trainer)           ^
                                                            +---------  gare_build (builder)
    gare_demo may import everything; bench/ imports product code only; tests/ import product code and their own
    helpers, and only tests/test_evidence.py may import bench/.

Every import is read (module top AND inside functions, so a hidden import counts), resolved to a project module
(an edge to a package is an edge to its ``__init__``) and checked: no import outside the table, no upward import
between the source roots, no cycle between modules and none between the folders and modules of any one package
(a subpackage counts as one node beside its siblings), the service's whole import closure holds no builder or
trainer module, a project import inside a function is rare and says why on its line, no module imports another
module's underscore name, no two modules share a name for different concepts, no product file is over 500
lines, and every product module opens with a docstring saying what it owns. The checker itself is tested on
small made-up trees, so a broken parser cannot make the rules pass.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the design card's source roots, lowest first: a package imports only packages of its own root or a lower one
SOURCE_ROOTS: dict[str, tuple[str, ...]] = {
    "training": ("gare", "gare_train"),
    "indexer": ("gare_index", "gare_search", "gare_build"),
    "service": ("gare_serve", "gare_demo"),
}
ROOT_OF = {pkg: folder for folder, pkgs in SOURCE_ROOTS.items() for pkg in pkgs}
FOLDER_RANK = {folder: i for i, folder in enumerate(SOURCE_ROOTS)}
PRODUCT = tuple(ROOT_OF)
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
    """module name -> file, for the packages in `tops` (a product package under its source root)."""
    out = {}
    for top in tops:
        base = root / ROOT_OF[top] if top in ROOT_OF else root
        if (base / top).is_dir():
            out.update({_module_name(p, base): p for p in (base / top).rglob("*.py")})
    return out


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


def folder_violations(edges: list[Edge]) -> list[str]:
    """Imports from a lower source root to a higher one (training < indexer < service)."""
    bad = []
    for e in edges:
        src, dst = ROOT_OF.get(_top(e.src)), ROOT_OF.get(_top(e.dst))
        if src and dst and FOLDER_RANK[dst] > FOLDER_RANK[src]:
            bad.append(f"{e.src}:{e.line} ({src}/) imports {e.dst} ({dst}/)")
    return sorted(set(bad))


def level_graphs(edges: list[Edge], packages: set[str]) -> dict[str, dict[str, set[str]]]:
    """For every package P: the graph between P's direct children (its modules and subpackages, a subpackage
    standing for everything under it) drawn from the imports between them. A cycle here is an upward import:
    a subpackage that imports a sibling (or a module of its parent) which imports the subpackage back.
    Imports of P's own ``__init__`` are left out: it is the package's face, not one of its rooms."""
    out: dict[str, dict[str, set[str]]] = {}
    for e in edges:
        if _top(e.src) != _top(e.dst) or _top(e.src) not in PRODUCT:
            continue
        # the package that holds a module: itself for a package (its __init__), its parent otherwise
        s_parts = e.src.split(".") + ([""] if e.src in packages else [])
        d_parts = e.dst.split(".") + ([""] if e.dst in packages else [])
        n = 0
        while n < min(len(s_parts), len(d_parts)) - 1 and s_parts[n] == d_parts[n]:
            n += 1
        parent = ".".join(s_parts[:n])
        a, b = s_parts[n], d_parts[n]
        if a and b and a != b:
            out.setdefault(parent, {}).setdefault(a, set()).add(b)
    return out


def level_cycles(edges: list[Edge], packages: set[str]) -> list[str]:
    return sorted(f"{pkg}: {' -> '.join(c)}" for pkg, g in level_graphs(edges, packages).items() for c in cycles(g))


def shared_module_names(files: dict[str, Path]) -> dict[str, list[str]]:
    """Module names (the file's own name) used by more than one product module, besides those that name the
    same role in every package (its ``__init__``, ``__main__`` and command line)."""
    by_name: dict[str, list[str]] = {}
    for mod, path in files.items():
        if path.stem not in ("__init__", "__main__", "cli"):
            by_name.setdefault(path.stem, []).append(mod)
    return {n: sorted(m) for n, m in by_name.items() if len(m) > 1}


def foreign_global_writes(root: Path, tops=PRODUCT + ("bench",)) -> list[str]:
    """Assignments to a name of another project module (``rerank.DEVICE = ...``, ``setattr(rerank, ...)``): a
    setting travels as an argument or an options object, never as another module's global."""
    files = source_files(root, tops)
    bad = []
    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in files}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                aliases |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in files}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                  and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases):
                bad.append(f"{mod}:{node.lineno} setattr({node.args[0].id}, ...)")
            for tgt in targets:
                base = tgt
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(tgt, ast.Attribute) and isinstance(base, ast.Name) and base.id in aliases:
                    bad.append(f"{mod}:{node.lineno} assigns {ast.unparse(tgt)}")
    return sorted(bad)


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


def test_the_top_level_is_the_design_card_s(tmp_path):
    """The packages live in the card's source roots; no Python package at the top besides tests and bench."""
    tops = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert set(tops) <= {"bench", "tests"}, tops
    for folder, pkgs in SOURCE_ROOTS.items():
        held = sorted(p.name for p in (ROOT / folder).iterdir() if (p / "__init__.py").is_file())
        assert held == sorted(pkgs), (folder, held)
        assert not (ROOT / folder / "__init__.py").exists(), f"{folder}/ is a source root, not a package"
    where = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"]
    assert sorted(where) == sorted(SOURCE_ROOTS)


def test_no_folder_imports_a_higher_one(edges):
    bad = folder_violations(edges)
    assert not bad, "service/ -> indexer/ -> training/, nothing upward:\n" + "\n".join(bad)


def test_no_upward_import_inside_any_package(edges):
    packages = {m for m, p in source_files(ROOT, PRODUCT).items() if p.name == "__init__.py"}
    found = level_cycles(edges, packages)
    assert not found, "folders or modules of one package that import each other:\n" + "\n".join(found)


def test_no_two_modules_share_a_name():
    shared = shared_module_names(source_files(ROOT, PRODUCT))
    assert not shared, f"one name, several modules: {shared}"


def test_no_module_sets_another_module_s_globals():
    bad = foreign_global_writes(ROOT)
    assert not bad, "module globals set from outside (pass the value as an option):\n" + "\n".join(bad)


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
    def place(rel: str) -> Path:  # a product package goes under its source root, as in the repository
        top = rel.split("/")[0]
        return tmp_path / ROOT_OF[top] / rel if top in ROOT_OF else tmp_path / rel

    for rel, text in files.items():
        p = place(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for pkg in TOPS:
        place(pkg).mkdir(parents=True, exist_ok=True)
        (place(pkg) / "__init__.py").touch()
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


def test_checker_catches_an_import_from_a_lower_root_to_a_higher_one(tmp_path):
    root = _tree(tmp_path, {"gare/a.py": "import gare_search.x\n", "gare_search/x.py": "import gare.a\n"})
    bad = folder_violations(project_edges(root))
    assert len(bad) == 1 and bad[0].startswith("gare.a:1 (training/) imports gare_search.x (indexer/)"), bad


def test_checker_finds_a_cycle_between_a_subpackage_and_its_parent_s_module(tmp_path):
    root = _tree(tmp_path, {"gare_build/build.py": "from gare_build.pipeline import plan\n",
                            "gare_build/pipeline/__init__.py": "", "gare_build/pipeline/plan.py": "x = 1\n",
                            "gare_build/tuning/__init__.py": "", "gare_build/tuning/retune.py": "import gare_build.build\n",
                            "gare_build/pipeline/finish.py": "from gare_build.tuning import retune\n"})
    edges = project_edges(root)
    packages = {"gare_build", "gare_build.pipeline", "gare_build.tuning"}
    graphs = level_graphs(edges, packages)
    assert graphs["gare_build"] == {"build": {"pipeline"}, "tuning": {"build"}, "pipeline": {"tuning"}}
    assert level_cycles(edges, packages) == ["gare_build: build -> pipeline -> tuning -> build"]
    # the same modules with the back edge gone: no cycle at any level
    (tmp_path / "indexer/gare_build/tuning/retune.py").write_text("")
    assert level_cycles(project_edges(root), packages) == []


def test_checker_sees_shared_module_names(tmp_path):
    root = _tree(tmp_path, {"gare/metrics.py": "", "gare_serve/metrics.py": "", "gare_serve/cli.py": "",
                            "gare_build/cli.py": ""})
    assert shared_module_names(source_files(root, PRODUCT)) == {"metrics": ["gare.metrics", "gare_serve.metrics"]}


def test_checker_catches_a_write_to_another_module_s_global(tmp_path):
    root = _tree(tmp_path, {"gare_search/rerank.py": "DEVICE = 'model'\n",
                            "gare_serve/state.py": "from gare_search import rerank\nimport gare_search.rerank as R\n"
                                                   "def load(s):\n    rerank.DEVICE = s\n    R.DEVICE = s\n"
                                                   "    setattr(rerank, 'DEVICE', s)\n    local = s\n",
                            "gare_serve/ok.py": "class A:\n    pass\ndef f(a: A):\n    a.DEVICE = 1\n"})
    assert foreign_global_writes(root) == ["gare_serve.state:4 assigns rerank.DEVICE",
                                           "gare_serve.state:5 assigns R.DEVICE", "gare_serve.state:6 setattr(rerank, ...)"]


def test_the_architecture_page_names_every_product_module():
    """docs/architecture.md is the map a new engineer reads: every product module is named in it (a module added
    without a line there fails here)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = sorted(str(p.relative_to(ROOT)) for folder in SOURCE_ROOTS for p in (ROOT / folder).rglob("*.py")
                     if p.name not in ("__init__.py", "__main__.py") and f"`{p.name}`" not in doc
                     and f"/{p.name}`" not in doc and f"/{p.name})" not in doc)
    assert not unnamed, "modules docs/architecture.md does not name: " + ", ".join(unnamed)
