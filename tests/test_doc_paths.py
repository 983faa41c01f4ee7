"""Every path the hand-written docs name exists: a moved or renamed module cannot leave a stale pointer behind.

The docs are README.md, docs/*.md and deploy/**/*.md (bench/results/ holds generated reports: their scripts own
them). In each doc this reads:

- every relative markdown link ``[text](target)`` (images too), resolved against the doc's folder, as a
  renderer resolves it;
- every path in inline code ending in .py, .md, .json, .yml, .yaml, .toml or .sh, and every folder path of the
  repository (``gare_serve/web/``, ``tests/serve_ray/``). A path with a folder in it resolves against the doc's
  folder, the repository root or one of the three source roots (``training/``, ``indexer/``, ``service/``:
  ``gare/psi_fold.py`` is ``training/gare/psi_fold.py``); a glob (``bench/index_*.py``) must match something. A
  bare name (``reader.py``, ``store/``) is read after the last path before it on the same line, as the docs write
  lists and table rows (``gare_index/ann.py`` / ``ann_gpu.py``, ``| `gare_serve/` | ... `web/` |``): it must be in
  that folder (or at the repository's top); a bare ``.py`` name with no path before it must be some file of the
  repository. Other bare names (``report.json``, ``result.md``) are files a command writes;
- in a fenced block that is not output (commands, diagrams, code), the same for the paths that start with a
  folder of the repository (``bench/x.py``, ``gare_serve/web/search_routes.py``); ``--out runs/x`` or
  ``versions/v000003/`` name what a command makes;
- every dotted module name of the product (``gare_serve.engine.prometheus``, ``gare_search.search.search_batch``,
  ``gare_serve.ray_serve.deployment:build_app``): the longest prefix must be a module, and a name after it must
  be defined or imported at that module's top level.

Not checked: absolute paths, ``~`` and ``$VAR`` paths, placeholders in capitals (``INDEX/report.json``), URLs,
and the few paths outside this repository listed in ``OUTSIDE``. The checker is itself tested on a made-up
repository, so a broken parser cannot make the docs pass.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("training", "indexer", "service")
PACKAGES = ("gare", "gare_index", "gare_search", "gare_build", "gare_serve", "gare_train", "gare_demo")
EXTENSIONS = ("py", "md", "json", "yml", "yaml", "toml", "sh")
# fenced blocks whose info string says they hold output, not commands or code
OUTPUT_FENCES = {"text", "console", "output", "log", "json"}
# paths the docs name on purpose that are not in this repository
OUTSIDE = {
    "../shared/SPEC.md": "the method spec beside the repository",
    "tvr/models/optimization.py": "a file of the authors' code",
    "runs/msrvtt/config.yaml": "what gare-train fit writes",
}

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"`([^`]+)`")
_EXT = "|".join(EXTENSIONS)
PATH = re.compile(rf"(?<![\w./*~$:-])([\w.*~$/-]*[\w*](?:\.(?:{_EXT})|/))(?![\w/-])")
DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.\w+)+)(?::(\w+))?")
KNOWN_TOPS = (*SOURCE_ROOTS, *PACKAGES, "bench", "docs", "deploy", "tests")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")


def doc_files(root: Path) -> list[Path]:
    """The hand-written docs: README.md, docs/*.md, deploy/**/*.md and bench's own READMEs (not its results)."""
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "deploy").rglob("*.md"))]
    docs += sorted((root / "bench").glob("README*.md"))
    return [d for d in docs if d.is_file()]


@dataclass
class Ref:
    line: int
    kind: str  # "link", "path" or "module"
    text: str
    context: str | None = None  # for a bare path: the path written before it in the same cell or line


def _rooted(tok: str) -> bool:
    """A path written from a root (``gare_serve/web/``, ``bench/x.py``), not a bare name read in its context."""
    return "/" in tok.rstrip("/") or tok.rstrip("/") in KNOWN_TOPS


def _paths_and_modules(code: str, lineno: int, context: list[str | None], out: list[Ref], *, fenced: bool) -> None:
    for m in PATH.finditer(code):
        tok = m.group(1)
        if _rooted(tok):
            # in a command or a diagram only the repository's own folders are paths of the repository
            # (``--out runs/x``, ``versions/v000003/`` are not); in running text every path with a file name is
            if (fenced or tok.endswith("/")) and tok.split("/")[0] not in KNOWN_TOPS:
                continue
            out.append(Ref(lineno, "path", tok))
            context[0] = tok
        else:
            out.append(Ref(lineno, "path", tok, context[0]))
    for m in DOTTED.finditer(code):
        out.append(Ref(lineno, "module", m.group(1) + (f":{m.group(2)}" if m.group(2) else "")))


def doc_refs(text: str) -> list[Ref]:
    """The links, paths and module names a markdown text names, with their line numbers."""
    out: list[Ref] = []
    fence: str | None = None  # the info string of the open fenced block, None outside one
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            continue
        if fence is not None:
            if fence not in OUTPUT_FENCES:
                _paths_and_modules(line, n, [None], out, fenced=True)
            continue
        out += [Ref(n, "link", m.group(1)) for m in LINK.finditer(re.sub(r"`[^`]*`", "", line))]
        context: list[str | None] = [None]  # a bare name is read after the last path of its line (table row)
        for code in CODE.findall(line):
            _paths_and_modules(code, n, context, out, fenced=False)
    return out


def _exists(base: Path, rel: str) -> bool:
    if any(c in rel for c in "*?["):
        return any(base.glob(rel))
    return (base / rel).exists()


def _bases(root: Path, doc: Path) -> list[Path]:
    return [doc.parent, root, *(root / r for r in SOURCE_ROOTS)]


def _resolve_dir(root: Path, doc: Path, path: str) -> Path | None:
    """The folder a context path names (itself for a folder, its parent for a file), or None."""
    for base in _bases(root, doc):
        p = base / path
        if p.is_dir():
            return p
        if p.is_file() or (any(c in path for c in "*?[") and any(base.glob(path))):
            return p.parent
    return None


def _skipped(path: str) -> bool:
    first = path.split("/")[0]
    return path.startswith(("/", "~", "$")) or "://" in path or path in OUTSIDE or bool(PLACEHOLDER.match(first))


def _module_file(root: Path, name: str) -> Path | None:
    rel = Path(*name.split("."))
    for r in SOURCE_ROOTS:
        for p in ((root / r / rel).with_suffix(".py"), root / r / rel / "__init__.py"):
            if p.is_file():
                return p
    return None


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def check_module(root: Path, text: str) -> str | None:
    """Why a dotted name names nothing of the product, or None."""
    name, _, attr = text.partition(":")
    parts = name.split(".")
    n = len(parts)
    while n and _module_file(root, ".".join(parts[:n])) is None:
        n -= 1
    if n == 0:
        return "no such module"
    rest = parts[n:] + ([attr] if attr else [])
    if rest and rest[0] not in _top_level_names(_module_file(root, ".".join(parts[:n]))):
        return f"{'.'.join(parts[:n])} has no {rest[0]}"
    return None


def check_doc(root: Path, doc: Path) -> list[str]:
    """``doc:line: what`` for every link, path or module name in ``doc`` that names nothing."""
    rel = doc.relative_to(root)
    bad: list[str] = []
    everything: set[str] | None = None
    for ref in doc_refs(doc.read_text(encoding="utf-8")):
        t = ref.text
        if ref.kind == "link":
            if re.match(r"^[a-z][a-z0-9+.-]*:", t) or t.startswith("#"):
                continue  # a URL, mailto: or an anchor on the same page
            target = t.split("#")[0].split("?")[0]
            if target not in OUTSIDE and not (doc.parent / target).exists():
                bad.append(f"{rel}:{ref.line}: link ({t}) leads nowhere")
        elif ref.kind == "module":
            why = check_module(root, t)
            if why:
                bad.append(f"{rel}:{ref.line}: `{t}`: {why}")
        elif _skipped(t):
            continue
        elif _rooted(t):
            if not any(_exists(b, t) for b in _bases(root, doc)):
                bad.append(f"{rel}:{ref.line}: `{t}` does not exist")
        elif ref.context is not None and (ctx := _resolve_dir(root, doc, ref.context)) is not None:
            if not (_exists(ctx, t) or _exists(root, t)):  # in its folder, or a top-level file (`run.sh`)
                bad.append(f"{rel}:{ref.line}: `{t}` is not in {ctx.relative_to(root)}/ (after `{ref.context}`)")
        elif t.endswith(".py"):
            if everything is None:
                everything = {p.name for p in root.rglob("*.py") if "bench/results" not in p.as_posix()}
            if not any(re.fullmatch(re.escape(t).replace(r"\*", ".*"), n) for n in everything):
                bad.append(f"{rel}:{ref.line}: `{t}` is no file of the repository")
    return bad


# ------------------------------------------------------------------------------------------------ the docs
@pytest.mark.parametrize("doc", doc_files(ROOT), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_a_doc_names_exists(doc):
    bad = check_doc(ROOT, doc)
    assert not bad, "stale paths (a module moved or was renamed?):\n" + "\n".join(bad)


def test_the_docs_are_all_read():
    names = {d.relative_to(ROOT).as_posix() for d in doc_files(ROOT)}
    assert {"README.md", "docs/architecture.md", "deploy/kuberay/README.md"} <= names, names
    assert not any(n.startswith("bench/results/") for n in names)


# ------------------------------------------------------------------------------------------ the checker itself
def _repo(tmp_path: Path, doc: str) -> tuple[Path, Path]:
    for rel, text in {
        "training/gare/__init__.py": "", "training/gare/psi_fold.py": "CONST = 1\ndef pair_scores(): ...\n",
        "indexer/gare_index/__init__.py": "", "indexer/gare_index/store/__init__.py": "from .reader import IndexVersion\n",
        "indexer/gare_index/store/reader.py": "class IndexVersion: ...\n", "indexer/gare_index/ann.py": "",
        "service/gare_serve/__init__.py": "", "service/gare_serve/web/__init__.py": "",
        "service/gare_serve/web/search_routes.py": "def make_router(): ...\n", "bench/index_kv.py": "", "docs/other.md": "",
        "deploy/kuberay/README.md": "", "pyproject.toml": "",
    }.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    d = tmp_path / "docs" / "made_up.md"
    d.write_text(doc)
    return tmp_path, d


GOOD = """# A doc whose every path exists

See [the other page](other.md#a-section), [the README](../README.md) and [the web](https://example.org/x.py).
| `gare_index/` | the format: `store/`, `ann.py` (`gare_index/store/`: `reader.py`) | `gare/psi_fold.py` / `psi_fold.py` |
| `deploy/`, `pyproject.toml` | the recipes, the package |
Code: `training/gare/psi_fold.py`, `gare_serve/web/search_routes.py`, `bench/index_*.py`, `python bench/index_kv.py`.
Modules: `gare.psi_fold.pair_scores`, `gare_index.store.IndexVersion`, `gare_serve.web.search_routes`.
Not ours: `INDEX/report.json`, `result.md`, `/data/train.yaml`, `~/.cache/x.py`, `$GARE_VENV/bin/x.py`.

```bash
python bench/index_kv.py --out runs/x     # writes runs/x/result.md
serve run gare_serve.web.search_routes:make_router
```

```text
Traceback: gare_serve/routes/search.py line 3   (output: not read)
```
"""


def test_checker_passes_a_doc_whose_paths_exist(tmp_path):
    (tmp_path / "README.md").write_text("")
    root, doc = _repo(tmp_path, GOOD)
    assert check_doc(root, doc) == []
    kinds = [r.kind for r in doc_refs(GOOD)]
    assert kinds.count("link") == 3 and kinds.count("module") == 4, doc_refs(GOOD)


@pytest.mark.parametrize("line, stale", [
    ("[the reader](gare_index/store/reader.py)", "link (gare_index/store/reader.py)"),  # links resolve from the doc
    ("![shot](img/none.png)", "link (img/none.png)"),
    ("`gare_serve/routes/search.py`", "`gare_serve/routes/search.py` does not exist"),
    ("`service/gare_serve/metrics.py`", "does not exist"),
    ("`gare_serve/routes/` (the routes)", "`gare_serve/routes/` does not exist"),
    ("`bench/nothing_*.py`", "does not exist"),
    ("| `gare_index/store/reader.py` / `writer.py` |", "`writer.py` is not in indexer/gare_index/store/"),
    ("| `gare_serve/` | routes (`routes/`) |", "`routes/` is not in service/gare_serve/"),
    ("```\ngare_serve   gare_serve/routes/search.py ─► ann.py\n```", "does not exist"),  # a diagram is read
    ("the service's metrics live in `metrics.py`", "`metrics.py` is no file of the repository"),
    ("`gare_serve.metrics`", "`gare_serve.metrics`: gare_serve has no metrics"),
    ("`gare.psi_fold.CONST_FIELDS`", "gare.psi_fold has no CONST_FIELDS"),
    ("`gare_serve.ray_app:build_app`", "gare_serve has no ray_app"),
    ("```bash\npython bench/gone.py\n```", "`bench/gone.py` does not exist"),  # a command block is read
    ("```\nserve run gare_serve.ray_app:build_app\n```", "gare_serve has no ray_app"),
])
def test_checker_catches_a_stale_path(tmp_path, line, stale):
    root, doc = _repo(tmp_path, f"# A made-up doc\n\nSome text.\n{line}\n")
    bad = check_doc(root, doc)
    assert len(bad) == 1 and stale in bad[0] and bad[0].startswith("docs/made_up.md:"), bad


def test_checker_reads_a_bare_name_after_the_last_path_of_its_line(tmp_path):
    # a table row names its folder in the first cell and the files in the next; a line without a path before
    # a bare .py name only asks that some file of the repository has that name
    root, doc = _repo(tmp_path, "| `gare_index/` | `ann.py`, `store/` |\n| `gare_serve/web/` | `ann.py` |\n"
                                "`psi_fold.py` and `nowhere.py`\n")
    assert check_doc(root, doc) == ["docs/made_up.md:2: `ann.py` is not in service/gare_serve/web/ (after `gare_serve/web/`)",
                                    "docs/made_up.md:3: `nowhere.py` is no file of the repository"]
