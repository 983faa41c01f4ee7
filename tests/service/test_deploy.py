"""The deployment files, validated without a Docker engine: the compose file against the compose
specification, the Dockerfiles with hadolint, and every command, flag and path they use against the project.
The same files run for real with podman in bench/compose_e2e.py (bench/results/compose_e2e.md); the checks
below that name a podman-compose or nginx behaviour keep what that run found fixed."""

from __future__ import annotations

import importlib
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
APP_DOCKERFILES = [REPO / "deploy" / "Dockerfile.cpu", REPO / "deploy" / "Dockerfile.cuda"]  # the gare-search images
NGINX_CONF = REPO / "deploy" / "nginx.conf"


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
            if svc["command"][0] in ("ray", "serve"):  # Ray's CLI (profile ray): test_deploy_ray.py checks its flags
                continue
            cmds.append(list(svc["command"]))
    for df in DOCKERFILES:
        for m in re.finditer(r'^CMD (\[.*\])', df.read_text(), re.M):
            cmds.append(yaml.safe_load(m.group(1)))
    return cmds


def test_every_command_and_flag_exists(capsys):
    """Each command the images and compose run names a console script of the project, and its --help (the
    script's own `main`, called here in process: tests/test_install.py runs the scripts themselves) lists every
    flag the command passes."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    cmds = _commands()
    assert {c[0] for c in cmds} == {"gare-serve", "gare-index", "gare-train"}
    for cmd in cmds:
        assert cmd[0] in scripts, cmd
        module, _, func = scripts[cmd[0]].partition(":")
        main = getattr(importlib.import_module(module), func)
        sub = [cmd[1]] if cmd[0] != "gare-serve" else []
        with pytest.raises(SystemExit) as exit_:
            main([*sub, "--help"])
        out, err = capsys.readouterr()
        assert exit_.value.code in (0, None), f"{shlex.join(cmd)}: {err[-500:]}"
        assert "usage:" in out, (cmd, out[:300])
        for flag in [a for a in cmd if a.startswith("--")]:
            assert re.search(rf"(^|\s){re.escape(flag)}[\s,=]", out), f"{cmd[0]} {' '.join(sub)} has no {flag}"


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
    assert "${GARE_ADMIN_KEYS:?" in text  # compose refuses to start without an admin key
    env = compose["x-api-env"]
    assert "GARE_SEARCH_KEYS" in env and env["GARE_SEARCH_KEYS"] is None  # passed through from the shell
    assert "GARE_API_KEYS" in env and env["GARE_API_KEYS"] is None  # the old name still reaches the service
    svcs = compose["services"]
    assert svcs["api"]["deploy"]["replicas"] >= 2 and all(v.endswith(":ro") for v in svcs["api"]["volumes"])
    assert svcs["api"]["healthcheck"] and svcs["api"]["restart"] == "unless-stopped"
    assert svcs["indexer"]["profiles"] == ["indexer"] and svcs["trainer"]["profiles"] == ["trainer"]
    gpu = svcs["api-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert svcs["api-gpu"]["profiles"] == ["gpu"] and gpu["capabilities"] == ["gpu"]
    assert "proxy_pass http://gare_api" in NGINX_CONF.read_text()
    for df in APP_DOCKERFILES:
        body = df.read_text()
        assert re.search(r"^USER 10001$", body, re.M) and "HEALTHCHECK" in body
        # dependency layers come before the code
        assert body.index("pip install -r") < body.index("COPY training ")


def test_dependency_extraction_used_by_the_images_runs():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("faiss-cpu") for d in data["dependencies"])
    assert data["optional-dependencies"]["gpu"]



def test_api_containers_run_several_workers(monkeypatch):
    """The CPU api uses gare-serve's workers (GARE_WORKERS, default: one per usable core); the GPU api one."""
    from gare_serve.settings import Settings

    svcs = yaml.safe_load(COMPOSE.read_text())["services"]
    assert "GARE_WORKERS" in svcs["api"]["environment"] and "--workers" not in svcs["api"]["command"]
    monkeypatch.delenv("GARE_WORKERS", raising=False)  # `GARE_WORKERS:` unset in the shell: unset in the container
    assert Settings().workers is None
    monkeypatch.setenv("GARE_WORKERS", "")  # set but empty: the same
    assert Settings().workers is None
    gpu_cmd = svcs["api-gpu"]["command"]
    assert gpu_cmd[gpu_cmd.index("--workers") + 1] == "1"


def _arg_default(dockerfile: Path, name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)$", dockerfile.read_text(), re.M)
    assert m, f"{dockerfile.name}: no ARG {name}=<default>"
    return m.group(1)


def test_base_images_and_torch_index_are_build_arguments_with_the_upstream_defaults():
    """Users build FROM the upstream images; only bench/compose_e2e.py overrides them (no registry there)."""
    cpu, proxy = REPO / "deploy" / "Dockerfile.cpu", REPO / "deploy" / "Dockerfile.proxy"
    assert _arg_default(cpu, "BASE_IMAGE") == "python:3.11-slim-bookworm"
    assert _arg_default(cpu, "TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    assert _arg_default(proxy, "NGINX_IMAGE") == "nginx:1.29-alpine"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", cpu.read_text(), re.M)
    assert re.search(r"^FROM \$\{NGINX_IMAGE\}$", proxy.read_text(), re.M)
    assert '--index-url "${TORCH_INDEX_URL}"' in cpu.read_text()
    svcs = yaml.safe_load(COMPOSE.read_text())["services"]
    assert svcs["api"]["build"]["args"] == {"BASE_IMAGE": "${GARE_BASE_IMAGE:-python:3.11-slim-bookworm}",
                                            "TORCH_INDEX_URL": "${GARE_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"}
    assert svcs["proxy"]["build"]["args"] == {"NGINX_IMAGE": "${GARE_NGINX_IMAGE:-nginx:1.29-alpine}"}
    assert svcs["proxy"]["build"]["dockerfile"] == "deploy/Dockerfile.proxy"
    # nothing of the machine that built them goes into an image (the CA bundle and pip.conf are build-only mounts)
    for df in DOCKERFILES:
        assert "ca-certificates.crt" not in df.read_text() and "pip.conf" not in df.read_text()


def test_compose_interpolation_works_with_podman_compose():
    """podman-compose 1.0.3 leaves `${NAME:-}` (an empty default) as literal text, and joins a CMD healthcheck list
    into one word (`podman-compose up --dry-run` showed `-e GARE_TRUSTED_HOSTS=${GARE_TRUSTED_HOSTS:-}` and
    `--healthcheck-command /bin/sh -c python' '-c' ...`); it also pops a list's first item in place, so the second
    replica sharing the healthcheck failed to start (`unknown healthcheck test type`). A string test works in both."""
    text = COMPOSE.read_text()
    code = re.sub(r"#.*", "", text)
    assert not re.search(r"\$\{\w+:?-\}", code), "an empty default: write `NAME:` (unset unless the shell sets it)"
    env = yaml.safe_load(text)["x-api-env"]
    for name in ("GARE_WORKERS", "GARE_CORS_ORIGINS", "GARE_MEDIA_SECRET", "GARE_MEDIA_SECRET_PREVIOUS", "GARE_TRUSTED_HOSTS"):
        assert name in env and env[name] is None, name
    for name, svc in yaml.safe_load(text)["services"].items():
        if "healthcheck" in svc:
            assert isinstance(svc["healthcheck"]["test"], str), name


def test_one_shot_services_hand_over_the_checkpoint():
    """The indexer's default checkpoint is the file the trainer service writes."""
    svcs = yaml.safe_load(COMPOSE.read_text())["services"]
    train, index = svcs["trainer"]["command"], svcs["indexer"]["command"]
    out = train[train.index("--out") + 1]
    ckpt = index[index.index("--checkpoint") + 1]
    assert ckpt == f"${{GARE_CHECKPOINT:-{out}/best.safetensors}}"


def test_proxy_is_loopback_by_default_unprivileged_and_bounded():
    svcs = yaml.safe_load(COMPOSE.read_text())["services"]
    proxy = svcs["proxy"]
    assert proxy["ports"] == ["${GARE_BIND:-127.0.0.1}:${GARE_PORT:-8080}:8080"]
    assert proxy["read_only"] is True and proxy["tmpfs"] == ["/tmp"]
    assert proxy["deploy"]["resources"]["limits"]["memory"]
    body = (REPO / "deploy" / "Dockerfile.proxy").read_text()
    assert re.search(r"^USER 101$", body, re.M) and "HEALTHCHECK" in body
    assert "COPY deploy/nginx.conf /etc/nginx/nginx.conf" in body
    assert svcs["api"]["stop_grace_period"]


def test_nginx_conf_resolves_through_the_engines_dns_and_fails_over():
    conf = NGINX_CONF.read_text()
    assert "127.0.0.11" not in re.sub(r"#.*", "", conf), "Docker's DNS address is not podman's: the entrypoint writes it"
    assert "include /tmp/gare-resolver.conf;" in conf
    assert re.search(r"server api:8000 resolve\b", conf)
    # idle upstream connections closed before uvicorn's 5 s keep-alive timeout closes them
    m = re.search(r"keepalive_timeout (\d+)s;", conf)
    assert m and int(m.group(1)) < 5
    assert "proxy_next_upstream error timeout http_502 http_503 non_idempotent;" in conf
    assert re.search(r"proxy_connect_timeout \d+s;", conf)
    # an unprivileged nginx writes only under /tmp
    for directive in ("pid", "client_body_temp_path", "proxy_temp_path"):
        assert re.search(rf"^\s*{directive} /tmp/", conf, re.M), directive
    assert "$request_method $uri" in conf and '"$request"' not in conf  # no signed-URL tokens in the access log


@pytest.mark.parametrize("resolv, expected", [
    ("nameserver 127.0.0.11\noptions ndots:0\n", "127.0.0.11"),                  # Docker
    ("search dns.podman\nnameserver 10.89.0.1\nnameserver 1.1.1.1\n", "10.89.0.1"),  # podman (aardvark-dns)
    ("nameserver fd00::1\n", "[fd00::1]"),
])
def test_proxy_entrypoint_writes_the_resolver_from_resolv_conf(tmp_path, resolv, expected):
    (tmp_path / "resolv.conf").write_text(resolv)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nginx").write_text('#!/bin/sh\necho "nginx $*"\n')
    (fake / "nginx").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "GARE_RESOLV_CONF": str(tmp_path / "resolv.conf"),
           "GARE_RESOLVER_OUT": str(tmp_path / "resolver.conf")}
    proc = subprocess.run(["sh", str(REPO / "deploy" / "proxy-entrypoint.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "resolver.conf").read_text() == f"resolver {expected} valid=5s ipv6=off;\n"
    assert proc.stdout.strip() == "nginx -e stderr -g daemon off;"

