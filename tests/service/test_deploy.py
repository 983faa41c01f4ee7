"""The deployment files, validated without a Docker engine: the compose file against the compose
specification, the Dockerfiles with hadolint, and every command, flag and path they use against the project."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import require

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILES = sorted((REPO / "deploy").glob("Dockerfile.*"))


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    require(path, f"{name} is not installed (it is in the project's test extra: pip install -e '.[test]')")
    return str(path)


def test_compose_file_matches_the_compose_specification():
    proc = subprocess.run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile):
    proc = subprocess.run([_tool("hadolint"), "--no-color", "-c", str(REPO / "deploy" / ".hadolint.yaml"), str(dockerfile)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _commands() -> list[list[str]]:
    cmds = []
    compose = yaml.safe_load(COMPOSE.read_text())
    for svc in compose["services"].values():
        if "command" in svc and str(svc.get("image", "")).startswith("gare-search"):
            cmds.append(list(svc["command"]))
    for df in DOCKERFILES:
        for m in re.finditer(r'^CMD (\[.*\])', df.read_text(), re.M):
            cmds.append(yaml.safe_load(m.group(1)))
    return cmds


def test_every_command_and_flag_exists():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    cmds = _commands()
    assert {c[0] for c in cmds} == {"gare-serve", "gare-index", "gare-train"}
    for cmd in cmds:
        assert cmd[0] in scripts, cmd
        sub = [cmd[1]] if cmd[0] != "gare-serve" else []
        proc = subprocess.run([_tool(cmd[0]), *sub, "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{shlex.join(cmd)}: {proc.stderr[-500:]}"
        for flag in [a for a in cmd if a.startswith("--")]:
            assert re.search(rf"(^|\s){re.escape(flag)}[\s,=]", proc.stdout), f"{cmd[0]} {' '.join(sub)} has no {flag}"


def test_every_copied_or_mounted_path_exists():
    for df in DOCKERFILES:
        for m in re.finditer(r"^COPY (.+) \S+$", df.read_text(), re.M):
            for src in m.group(1).split():
                assert (REPO / src).exists(), f"{df.name}: COPY {src}"
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            host = vol.split(":")[0]
            if host.startswith("./"):
                assert (REPO / host).exists(), f"{name}: {host}"
        build = svc.get("build")
        if build:
            assert (REPO / build["dockerfile"]).exists()


def test_secrets_are_required_and_services_are_complete():
    text = COMPOSE.read_text()
    compose = yaml.safe_load(text)
    assert "${GARE_API_KEYS:?" in text  # compose refuses to start without it
    svcs = compose["services"]
    assert svcs["api"]["deploy"]["replicas"] >= 2 and all(v.endswith(":ro") for v in svcs["api"]["volumes"])
    assert svcs["api"]["healthcheck"] and svcs["api"]["restart"] == "unless-stopped"
    assert svcs["indexer"]["profiles"] == ["indexer"] and svcs["trainer"]["profiles"] == ["trainer"]
    gpu = svcs["api-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert svcs["api-gpu"]["profiles"] == ["gpu"] and gpu["capabilities"] == ["gpu"]
    assert "proxy_pass http://gare_api" in (REPO / "deploy" / "nginx.conf").read_text()
    for df in DOCKERFILES:
        body = df.read_text()
        assert re.search(r"^USER 10001$", body, re.M) and "HEALTHCHECK" in body
        # dependency layers come before the code
        assert body.index("pip install -r") < body.index("COPY training")


def test_dependency_extraction_used_by_the_images_runs():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("faiss-cpu") for d in data["dependencies"])
    assert data["optional-dependencies"]["gpu"]



def test_api_containers_run_several_workers(monkeypatch):
    """The CPU api uses gare-serve's workers (GARE_WORKERS, default: one per usable core); the GPU api one."""
    from service.settings import Settings

    svcs = yaml.safe_load(COMPOSE.read_text())["services"]
    assert "GARE_WORKERS" in svcs["api"]["environment"] and "--workers" not in svcs["api"]["command"]
    monkeypatch.setenv("GARE_WORKERS", "")  # what ${GARE_WORKERS:-} gives when unset: the usable cores
    assert Settings().workers is None
    gpu_cmd = svcs["api-gpu"]["command"]
    assert gpu_cmd[gpu_cmd.index("--workers") + 1] == "1"
