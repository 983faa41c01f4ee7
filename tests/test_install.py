"""Both ways users install the project work from the card's source roots (training/, indexer/, service/):

- the wheel (`pip install .`, the images) holds every package and module and every data file, and the three console
  scripts run from it alone, with nothing of the checkout on the path;
- the editable install (`pip install -e .`, `run.sh`) imports each package from its source root and its console
  scripts run;
- the images copy only folders that exist and install from them, so a renamed folder fails here, not in a build.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import require

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SOURCE_ROOTS = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]
SCRIPTS = sorted(PYPROJECT["project"]["scripts"])  # gare-index, gare-serve, gare-train


def _checkout_files() -> tuple[set[str], set[str]]:
    """The modules (paths inside a wheel) and data files the checkout's packages hold."""
    modules, data = set(), set()
    for root in SOURCE_ROOTS:
        for p in (REPO / root).rglob("*"):
            if not p.is_file() or "__pycache__" in p.parts or p.suffix == ".pyc":
                continue
            rel = p.relative_to(REPO / root).as_posix()
            if not (REPO / root / rel.split("/")[0] / "__init__.py").is_file():
                continue  # not inside a package (none today)
            (modules if p.suffix == ".py" else data).add(rel)
    return modules, data


@pytest.fixture(scope="module")
def wheel_install(tmp_path_factory) -> tuple[Path, Path]:
    """The project built as a wheel and installed (no dependencies: they are this venv's) into its own folder."""
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy of what the wheel is made of: setuptools leaves build/ in the tree it builds, and a stale
    # build/lib (a module since moved) would end up in a later wheel
    src = out / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for root in SOURCE_ROOTS:
        shutil.copytree(REPO / root, src / root, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=600)
    (whl,) = out.glob("gare_search-*.whl")
    target = out / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(target),
                    str(whl)], check=True, capture_output=True, timeout=600)
    return whl, target


def test_the_wheel_holds_every_module_and_data_file(wheel_install):
    whl, _ = wheel_install
    names = set(zipfile.ZipFile(whl).namelist())
    modules, data = _checkout_files()
    assert {"gare/__init__.py", "gare_serve/web/static/index.html", "gare/model_configs/gare-cpu-demo.json"} <= (
        modules | data)  # the walk above found the packages
    assert not modules - names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert not data - names, f"data files missing from the wheel: {sorted(data - names)}"
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"gare", "gare_train", "gare_index", "gare_search", "gare_build", "gare_serve", "gare_demo"}, tops


def test_the_console_scripts_run_from_the_wheel_alone(wheel_install, tmp_path):
    _, target = wheel_install
    # only the wheel's folder on the path: the checkout's editable finder is appended after it, and the command
    # runs outside the checkout, so a module found from the checkout shows in where `gare` came from
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}
    # one interpreter for what the package must hold besides its modules: where gare came from, the page's files,
    # and the registered open_clip configs (data files the backbone registers from the installed package)
    where = subprocess.run([sys.executable, "-c", "import json, gare, gare_serve.web.ops_routes as o; from gare.backbone import open_clip_module; "
                            "print(json.dumps([gare.__file__, str(o.STATIC_DIR), "
                            "sorted(m for m in open_clip_module().list_models() if m.startswith('gare-')) ]))"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr
    gare_file, static, registered = json.loads(where.stdout)
    assert Path(gare_file).is_relative_to(target) and (Path(static) / "index.html").is_file()
    assert registered == sorted(p.stem for p in (REPO / "training" / "gare" / "model_configs").glob("*.json"))
    # the three scripts at once (each imports torch)
    procs = {s: subprocess.Popen([str(target / "bin" / s), "--help"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for s in SCRIPTS}
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{script} --help: {err[-800:]}"
        assert "usage:" in out, (script, out[:300])

def test_the_editable_install_imports_from_the_source_roots(tmp_path):
    """run.sh installs the checkout in editable mode: each package resolves to its source root."""
    code = ("import importlib, json; print(json.dumps({p: importlib.import_module(p).__file__ for p in "
            "['gare', 'gare_train', 'gare_index', 'gare_search', 'gare_build', 'gare_serve', 'gare_demo']}))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    require(proc.returncode == 0, f"the project is not installed in this environment (pip install -e .): {proc.stderr[-300:]}")
    found = {p: Path(f) for p, f in json.loads(proc.stdout).items()}
    want = {"gare": "training", "gare_train": "training", "gare_index": "indexer", "gare_search": "indexer",
            "gare_build": "indexer", "gare_serve": "service", "gare_demo": "service"}
    editable = all(f.is_relative_to(REPO) for f in found.values())
    require(editable, f"the project is installed, but not from this checkout in editable mode: {found}")
    for pkg, root in want.items():
        assert found[pkg] == REPO / root / pkg / "__init__.py", (pkg, found[pkg])
    # the console scripts are installed beside this Python and name the CLIs' `main` (tests/service/test_deploy.py
    # runs each with --help for every command the docs use)
    bindir = Path(sys.executable).parent
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="console_scripts") if ep.name in SCRIPTS}
    assert sorted(eps) == SCRIPTS
    for script in SCRIPTS:
        require((bindir / script).is_file(), f"no {script} beside {sys.executable}")
        assert eps[script].value == PYPROJECT["project"]["scripts"][script] and callable(eps[script].load())


def _dockerfile_paths(text: str) -> tuple[list[str], list[str], str]:
    copies = [src for m in re.finditer(r"^COPY (.+) \S+$", text, re.M) for src in m.group(1).split()]
    workdir = re.search(r"^WORKDIR (\S+)$", text, re.M).group(1)
    used = re.findall(rf"(?<![\w/]){re.escape(workdir)}/([\w./-]+)", text)
    return copies, used, workdir


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_images_copy_and_install_what_exists(name):
    """Every COPY source exists, the three source roots are copied, and every path under the image's WORKDIR that
    a RUN names (an install, a compile, a removal) is one the COPYs put there."""
    text = (REPO / "deploy" / name).read_text()
    copies, used, workdir = _dockerfile_paths(text)
    for src in copies:
        assert (REPO / src).exists(), f"{name}: COPY {src}"
    assert set(SOURCE_ROOTS) <= set(copies), f"{name} copies {copies}"
    for rel in used:
        top = rel.split("/")[0]
        assert top in copies and (REPO / rel).exists(), f"{name}: {workdir}/{rel} is not copied from the checkout"
    assert re.search(r"pip install --no-deps (\.|/app)(\s|$)", text, re.M), f"{name} installs the project from the copied tree"


def test_the_dockerfile_check_catches_a_stale_path():
    """The check above on a made-up Dockerfile that compiles a folder it never copied (the old CPU image did)."""
    text = ("FROM python:3.11\nWORKDIR /app\nCOPY gare ./gare\n"
            "RUN pip install --no-deps -e . && python -m compileall -q /app/training\n")
    copies, used, _ = _dockerfile_paths(text)
    assert copies == ["gare"] and used == ["training"] and "training" not in copies


def test_run_sh_lets_python_cache_bytecode(tmp_path):
    """`run.sh test` under PYTHONDONTWRITEBYTECODE=1 (as some sandboxes and CI images set it) still lets Python
    write __pycache__: otherwise every process of the suite compiles torch again. A stand-in venv records the
    environment and arguments run.sh gives its python; nothing is installed."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    seen = tmp_path / "seen.txt"
    # a stand-in chromium on PATH too: run.sh must not apt-get a browser for this test
    for name, body in {"pip": "exit 0", "ruff": "exit 0", "chromium": "exit 0",
                       "python": f'echo "${{PYTHONDONTWRITEBYTECODE-unset}} ${{HF_HUB_OFFLINE-}} $*" >> {seen}'}.items():
        (venv / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    env = {**os.environ, "GARE_VENV": str(venv), "PYTHONDONTWRITEBYTECODE": "1",
           "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(REPO / "run.sh"), "test", "-k", "nothing"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first = seen.read_text().splitlines()[0].split()
    assert first[:2] == ["unset", "1"], first  # bytecode cache allowed; hub offline
    assert first[2:5] == ["-m", "pytest", "-q"] and first[-2:] == ["-k", "nothing"], first
