"""The Ray Serve deployment recipes, validated without a cluster: the KubeRay RayService manifest
(deploy/kuberay/rayservice.yaml) against the RayService CRD fetched from KubeRay (deploy/schemas/), the shared
Serve application config against Ray Serve's own schema, and docker-compose.yml's `ray` profile (the compose file
as a whole is checked against the compose specification by test_deploy.py) against Ray's CLI, the image
(deploy/Dockerfile.cpu) and the service's settings. Nothing here starts Ray."""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.conftest import require

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "deploy" / "Dockerfile.cpu"
KUBERAY = REPO / "deploy" / "kuberay"
RAYSERVICE = KUBERAY / "rayservice.yaml"
SERVE_CONFIG = KUBERAY / "serve-config.yaml"
NETWORK_POLICY = KUBERAY / "networkpolicy.yaml"
CRD = REPO / "deploy" / "schemas" / "ray.io_rayservices.yaml"
# the git blob id of ray-operator/config/crd/bases/ray.io_rayservices.yaml at KubeRay v1.7.0 (deploy/schemas/README.md)
KUBERAY_CRD_BLOB = "7ee63d6ddd11237a5649e04b3a8db3c52074c867"
IMPORT_PATH = "gare_serve.ray_serve.deployment:build_app"
APP_ARGS = {"index": "/data/index", "shard_replicas": 2, "ingress_replicas": 1}
SERVE_PORT = 8000
RAY_PROFILE = ["ray-head", "ray-worker", "ray-serve"]


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    require(path, f"{name} is not installed (check-jsonschema: the test extra; ray, serve: the ray extra)")
    return str(path)


def _manifest() -> dict:
    return yaml.safe_load(RAYSERVICE.read_text())


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@functools.cache
def _crd_yaml() -> dict:
    # parsed once per run (a ~1 MB schema: seconds with the pure-Python loader); callers copy before changing it
    return yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _crd_schema() -> dict:
    crd = copy.deepcopy(_crd_yaml())
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == "ray.io"
    assert crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    return v1["schema"]["openAPIV3Schema"]


def _strict(schema: dict) -> dict:
    """The CRD's schema as the API server applies it with strict field validation (kubectl's default since 1.27):
    an object with declared properties takes no other field unless it preserves unknown fields, so a misspelt
    field fails here instead of being pruned silently."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def _containers(manifest: dict) -> dict[str, dict]:
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
    out = {}
    for name, group in groups:
        (container,) = group["template"]["spec"]["containers"]
        out[name] = container
    return out


def _quantity(value: str | int) -> float:
    """A Kubernetes quantity ("500m", "2", "4Gi", "8G") as a number."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti|k|M|G|T)?", str(value))
    assert m, f"not a Kubernetes quantity: {value!r}"
    scale = {None: 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
             "T": 1e12}[m.group(2)]
    return float(m.group(1)) * scale


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# --- the CRD schema and the manifest against it -----------------------------------------------------------------

def test_crd_schema_is_the_file_fetched_from_kuberay():
    """Fetched, not written: the same bytes as KubeRay v1.7.0's file, and the README says where it came from."""
    assert _git_blob_id(CRD.read_bytes()) == KUBERAY_CRD_BLOB
    readme = (REPO / "deploy" / "schemas" / "README.md").read_text()
    assert KUBERAY_CRD_BLOB in readme and "ray-project/kuberay" in readme and "v1.7.0" in readme
    assert "ray-operator/config/crd/bases/ray.io_rayservices.yaml" in readme


def test_rayservice_matches_the_crd_schema(tmp_path):
    manifest = _manifest()
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    schema = _strict(_crd_schema())
    jsonschema.validate(manifest, schema)  # in process: the error names the path that fails
    # and with the same tool test_deploy.py checks the compose file with
    (tmp_path / "rayservice.schema.json").write_text(json.dumps(schema))
    proc = subprocess.run([_tool("check-jsonschema"), "--schemafile", str(tmp_path / "rayservice.schema.json"),
                           str(RAYSERVICE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("break_it", [
    lambda m: m["spec"].update(serveConfig=m["spec"].pop("serveConfigV2")),                    # a misspelt field
    lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(replicas="two"),      # a wrong type
    lambda m: m["spec"]["rayClusterConfig"]["headGroupSpec"].pop("template"),                  # a required field
    lambda m: m["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    .update(imagePullPolicy=["IfNotPresent"]),
], ids=["unknown-field", "wrong-type", "missing-required", "wrong-type-in-pod-template"])
def test_the_crd_check_refuses_a_broken_manifest(break_it):
    """The validation is not vacuous: the CRD schema (made strict as the API server is) rejects each of these."""
    manifest = _manifest()
    break_it(manifest)
    with pytest.raises(jsonschema.ValidationError):
        _strict_validator().validate(manifest)


@functools.cache
def _strict_validator() -> jsonschema.protocols.Validator:
    """The strict CRD schema's validator, its schema checked once (jsonschema.validate checks it on every call)."""
    schema = _strict(_crd_schema())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


# --- the application: one config, the import path, the arguments -------------------------------------------------

def test_both_recipes_deploy_the_same_application():
    serve_config = yaml.safe_load(SERVE_CONFIG.read_text())
    assert yaml.safe_load(_manifest()["spec"]["serveConfigV2"]) == serve_config
    (app,) = serve_config["applications"]
    assert app["import_path"] == IMPORT_PATH
    assert app["args"] == APP_ARGS
    assert app["route_prefix"] == "/"
    assert serve_config["http_options"] == {"host": "0.0.0.0", "port": SERVE_PORT}
    ray_serve = _compose()["services"]["ray-serve"]
    mount = next(v for v in ray_serve["volumes"] if v.startswith("./deploy/kuberay/serve-config.yaml:"))
    host, target, mode = mount.split(":")
    assert (REPO / host).resolve() == SERVE_CONFIG and mode == "ro"
    assert ray_serve["command"][-1] == target


def test_serve_config_matches_ray_serves_schema():
    """What `serve deploy` and the operator send to Serve's REST API: Serve's own pydantic schema accepts it, and
    every key is one Serve knows (its schema takes unknown keys silently, for forward compatibility)."""
    require(importlib.util.find_spec("ray") is not None, "ray is not installed (pip install -e '.[ray]')")
    from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

    config = yaml.safe_load(SERVE_CONFIG.read_text())
    parsed = ServeDeploySchema.model_validate(config)
    assert parsed.applications[0].import_path == IMPORT_PATH and parsed.http_options.port == SERVE_PORT

    def fields(model):
        return set(getattr(model, "model_fields", None) or model.__fields__)

    assert set(config) <= fields(ServeDeploySchema)
    assert set(config["http_options"]) <= fields(HTTPOptionsSchema)
    assert set(config["applications"][0]) <= fields(ServeApplicationSchema)


def test_the_import_path_resolves_to_the_application_builder():
    module_name, attr = IMPORT_PATH.split(":")
    require(importlib.util.find_spec("ray") is not None, "ray is not installed (pip install -e '.[ray]')")
    require(importlib.util.find_spec(module_name) is not None, f"{module_name} does not exist yet")
    builder = getattr(importlib.import_module(module_name), attr)
    assert callable(builder)
    params = list(inspect.signature(builder).parameters.values())
    assert len(params) == 1, f"{IMPORT_PATH} takes the args dict alone (Serve calls it with the config's args)"


def test_the_index_is_on_a_read_only_volume_in_both_recipes():
    index = Path(APP_ARGS["index"])
    manifest = _manifest()
    cluster = manifest["spec"]["rayClusterConfig"]
    for name, container in _containers(manifest).items():
        (mount,) = [m for m in container["volumeMounts"] if index.is_relative_to(m["mountPath"])]
        assert mount.get("readOnly") is True, name
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        claim = volumes["gare-data"]["persistentVolumeClaim"]
        assert claim["readOnly"] is True and claim["claimName"]
    for name in ("ray-head", "ray-worker"):
        svc = _compose()["services"][name]
        # HOST:TARGET:MODE, where HOST may be "${GARE_DATA:-./data}" (a colon of its own)
        (vol,) = [v for v in svc["volumes"] if index.is_relative_to(v.rsplit(":", 2)[1])]
        assert vol.endswith(":ro"), name


# --- the image, ports, environment and resources ------------------------------------------------------------------

def test_images_and_ports_are_the_projects_cpu_image():
    dockerfile = DOCKERFILE.read_text()
    assert re.search(r'^ARG EXTRAS=""$', dockerfile, re.M), "deploy/Dockerfile.cpu installs extras (EXTRAS=ray)"
    assert "os.environ['EXTRAS']" in dockerfile and "optional-dependencies" in dockerfile
    assert re.search(rf"^EXPOSE {SERVE_PORT}$", dockerfile, re.M)
    uid = int(re.search(r"^USER (\d+)$", dockerfile, re.M).group(1))
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    require("ray" in extras, "pyproject.toml has no `ray` extra yet (the image's EXTRAS=ray installs it)")
    assert any(re.match(r"ray\[serve\]", d) for d in extras["ray"])

    compose = _compose()
    image = compose["x-image-ray"]
    assert image["build"]["dockerfile"] == "deploy/Dockerfile.cpu" and image["build"]["args"]["EXTRAS"] == "ray"
    # the same base images as the api's CPU image
    assert {k: v for k, v in image["build"]["args"].items() if k != "EXTRAS"} == compose["x-image-cpu"]["build"]["args"]
    for name in RAY_PROFILE:
        assert compose["services"][name]["image"] == image["image"], name
        assert compose["services"][name]["profiles"] == ["ray"], name
    manifest = _manifest()
    cluster = manifest["spec"]["rayClusterConfig"]
    for name, container in _containers(manifest).items():
        assert container["image"] == image["image"], name
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["serve"] == SERVE_PORT, name  # the operator's Serve Service and probes use the port named serve
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod = group["template"]["spec"]["securityContext"]
        assert pod["runAsUser"] == uid and pod["runAsNonRoot"] is True
    head_ports = {p["name"]: p["containerPort"] for p in _containers(manifest)["head"]["ports"]}
    assert head_ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": SERVE_PORT}


def test_ray_version_suits_the_image_and_the_operators_probes():
    """KubeRay probes a node with an HTTP GET of /api/healthz from Ray 2.53 on, and with `wget` in the container
    before that: the python:slim based image has no wget, so the manifest's Ray must be >= 2.53 (and the worker's
    readiness, a wget check in every version, is given as HTTP in the manifest)."""
    version = _manifest()["spec"]["rayClusterConfig"]["rayVersion"]
    assert tuple(int(x) for x in version.split(".")[:2]) >= (2, 53), version
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    require("ray" in extras, "pyproject.toml has no `ray` extra yet")
    from packaging.requirements import Requirement

    (req,) = [Requirement(d) for d in extras["ray"] if d.startswith("ray")]
    assert req.specifier.contains(version), f"rayVersion {version} is outside the ray extra's {req.specifier}"
    worker = _containers(_manifest())["shards"]
    assert worker["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": SERVE_PORT}
    assert "exec" not in worker["readinessProbe"]


def test_environment_is_the_services_settings_and_keys_come_from_a_secret():
    from gare_serve.ray_serve.proxy_limits import CALLBACK_ENV, CALLBACK_PATH
    from gare_serve.settings import ENV_PREFIX, Settings

    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    for name, container in _containers(_manifest()).items():
        env = {e["name"]: e for e in container["env"]}
        gare = {k for k in env if k.startswith(ENV_PREFIX)}
        assert gare <= known, f"{name}: not gare-serve settings: {sorted(gare - known)}"
        for secret in ("GARE_ADMIN_KEYS", "GARE_SEARCH_KEYS", "GARE_MEDIA_SECRET"):
            assert "value" not in env[secret], f"{name}: {secret} must come from a Secret, never literal"
            ref = env[secret]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "gare-search-secrets" and ref["key"], name
        # the admin key is required, search keys are optional; the deprecated name is not used
        assert not env["GARE_ADMIN_KEYS"]["valueFrom"]["secretKeyRef"].get("optional")
        assert env["GARE_SEARCH_KEYS"]["valueFrom"]["secretKeyRef"]["optional"] is True
        assert "GARE_API_KEYS" not in env, name
        # gare-serve's HTTP limits in Serve's proxy (tests/serve_ray/test_ray_limits.py runs them on a cluster)
        assert env[CALLBACK_ENV]["value"] == CALLBACK_PATH, name
    assert not re.search(r"kind:\s*Secret", "".join(p.read_text() for p in KUBERAY.glob("*.yaml")))
    compose = _compose()
    for name in ("ray-head", "ray-worker"):
        env = compose["services"][name]["environment"]
        assert {k for k in env if k.startswith(ENV_PREFIX)} <= known, name
        # the api's environment, bound where Serve's proxy listens
        assert env == {**compose["x-api-env"], "GARE_HOST": "0.0.0.0", "RAY_USAGE_STATS_ENABLED": "0",
                       CALLBACK_ENV: CALLBACK_PATH}, name
    assert "${GARE_ADMIN_KEYS:?" in COMPOSE.read_text()


def test_the_ingress_accepts_the_host_names_clients_use():
    """Under Ray the ingress builds gare-serve's settings from GARE_*, and an empty GARE_TRUSTED_HOSTS accepts only
    the loopback names when the bind address (GARE_HOST, default 127.0.0.1) is loopback: requests through the
    Kubernetes Service or from another container would get 400. GARE_HOST says where Serve's proxy listens."""
    from gare_serve.settings import Settings

    http_host = yaml.safe_load(SERVE_CONFIG.read_text())["http_options"]["host"]
    for name, container in _containers(_manifest()).items():
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["GARE_HOST"] == http_host, name
        assert Settings(host=env["GARE_HOST"]).trusted_host_list() == ["*"]
    for name in ("ray-head", "ray-worker"):
        assert _compose()["services"][name]["environment"]["GARE_HOST"] == http_host, name


def test_every_pod_has_resource_requests_and_limits():
    for name, container in _containers(_manifest()).items():
        res = container["resources"]
        for kind in ("cpu", "memory"):
            assert _quantity(res["requests"][kind]) <= _quantity(res["limits"][kind]), f"{name} {kind}"
            assert _quantity(res["requests"][kind]) > 0, f"{name} {kind}"
    for name in ("ray-head", "ray-worker"):
        assert _compose()["services"][name]["deploy"]["resources"]["limits"]["memory"], name


# --- docker compose: the ray profile ------------------------------------------------------------------------------

def _flags(cmd: list[str]) -> dict[str, str | None]:
    out = {}
    args = iter(cmd)
    for arg in args:
        if arg.startswith("--"):
            flag, _, value = arg.partition("=")
            out[flag] = value or None
    return out


def test_the_ray_profile_binds_what_the_container_network_requires():
    svcs = _compose()["services"]
    head, worker, serve = (svcs[n] for n in RAY_PROFILE)
    head_flags = _flags(head["command"])
    assert head["command"][:2] == ["ray", "start"] and "--head" in head_flags and "--block" in head_flags
    # the dashboard on the head's loopback only; ray-serve reaches it from inside the head's network namespace
    assert head_flags["--dashboard-host"] == "127.0.0.1" and "--dashboard-port" not in head_flags
    assert serve["network_mode"] == "service:ray-head"
    assert serve["command"][:2] == ["serve", "deploy"]
    assert serve["command"][serve["command"].index("--address") + 1] == "http://127.0.0.1:8265"
    assert serve["restart"] == "no" and serve["depends_on"]["ray-head"]["condition"] == "service_healthy"
    # workers join the head's GCS port by its service name
    assert worker["command"][:2] == ["ray", "start"] and "--block" in _flags(worker["command"])
    assert _flags(worker["command"])["--address"] == f"ray-head:{head_flags['--port']}"
    assert worker["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert worker["deploy"]["replicas"] >= 2
    # only the Serve proxy is published, on loopback unless GARE_BIND says otherwise; Ray's ports stay inside
    assert head["ports"] == [f"${{GARE_BIND:-127.0.0.1}}:${{GARE_RAY_PORT:-8002}}:{SERVE_PORT}"]
    assert "ports" not in worker and "ports" not in serve
    for name in ("ray-head", "ray-worker"):
        svc = svcs[name]
        assert isinstance(svc["healthcheck"]["test"], str), name  # podman-compose (test_deploy.py)
        assert svc["restart"] == "unless-stopped" and svc["shm_size"], name
    # the profile leaves the other services as they were: none of them is in it, none depends on it
    for name, svc in svcs.items():
        if name not in RAY_PROFILE:
            assert "ray" not in svc.get("profiles", []), name
            assert not set(svc.get("depends_on", {})) & set(RAY_PROFILE), name


def test_every_ray_command_and_flag_exists():
    """As test_deploy.py does for gare-*: every flag the profile passes to Ray's CLI, and every rayStartParams key
    of the manifest (the operator turns each into `ray start --KEY[=VALUE]`), is one the installed Ray knows."""
    svcs = _compose()["services"]
    helps: dict[tuple[str, ...], str] = {}

    def help_of(*cmd: str) -> str:
        if cmd not in helps:
            proc = subprocess.run([_tool(cmd[0]), *cmd[1:], "--help"], capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stderr[-500:]}"
            helps[cmd] = proc.stdout
        return helps[cmd]

    for name in RAY_PROFILE:
        cmd = svcs[name]["command"]
        text = help_of(*cmd[:2])
        for flag in _flags(cmd):
            assert re.search(rf"(^|\s){re.escape(flag)}[\s,=]", text), f"{name}: {' '.join(cmd[:2])} has no {flag}"
    cluster = _manifest()["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        for key in group["rayStartParams"]:
            assert re.search(rf"(^|\s)--{re.escape(key)}[\s,=]", help_of("ray", "start")), f"ray start has no --{key}"


def test_the_network_policy_guards_rays_ports():
    """No Kubernetes API schema is vendored here: the policy's shape is checked by hand. It selects the pods the
    manifest labels, lets the operator reach the dashboard and clients reach Serve only."""
    policy = yaml.safe_load(NETWORK_POLICY.read_text())
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    selector = policy["spec"]["podSelector"]["matchLabels"]
    cluster = _manifest()["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        labels = group["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = policy["spec"]["ingress"]
    open_to_all = [r for r in rules if "from" not in r]
    assert [[p["port"] for p in r["ports"]] for r in open_to_all] == [[SERVE_PORT]]
    peers = [r for r in rules if "from" in r]
    assert any(r["from"][0].get("podSelector", {}).get("matchLabels") == selector and "ports" not in r for r in peers)
    operator = [r for r in peers if r["from"][0]["podSelector"]["matchLabels"].get("app.kubernetes.io/name")
                == "kuberay-operator"]
    assert operator and {p["port"] for p in operator[0]["ports"]} == {8265, SERVE_PORT}


def test_the_readmes_commands_work_on_the_recipes():
    """deploy/kuberay/README.md's commands, checked against what they act on (instead of looking for words in it):
    the files it applies exist, its `kubectl create secret` makes the Secret and keys the manifest reads, its
    compose commands name the `ray` profile's services, its image build passes the extra the recipes install,
    and the RayService it gets is the manifest's."""
    block = "\n".join(ln.strip() for ln in (KUBERAY / "README.md").read_text().splitlines() if ln.startswith("    "))
    # one command per line: continued lines joined, comments dropped
    commands = [c.split(" #")[0].strip() for c in re.sub(r"\s*\\\n", " ", block).splitlines()]
    text = "\n".join(commands)
    for path in re.findall(r"(?<![\w/])(deploy/[\w./-]+\.(?:ya?ml|cpu))", text):
        assert (REPO / path).is_file(), path
    applied = re.findall(r"kubectl apply -f (\S+)", text)
    assert {Path(p).name for p in applied} == {RAYSERVICE.name, NETWORK_POLICY.name}, applied

    (secret,) = re.findall(r"kubectl create secret generic (\S+)((?: --from-file=\S+)+)", text)
    made = (secret[0], set(re.findall(r"--from-file=([\w-]+)=", secret[1])))
    refs = {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for c in _containers(_manifest()).values() for e in c["env"] if "valueFrom" in e}
    assert refs and {name for name, _ in refs} == {made[0]} and {key for _, key in refs} <= made[1], (made, refs)
    (got,) = re.findall(r"kubectl get rayservice (\S+)", text)
    assert got == _manifest()["metadata"]["name"]

    services = _compose()["services"]
    compose_cmds = re.findall(r"docker compose (?:--profile (\S+) )?(up -d ([\w -]+)|run --rm (\S+)|exec (\S+))", text)
    assert len(compose_cmds) == 3, compose_cmds
    for profile, _, up, run, exec_ in compose_cmds:
        for name in (up or run or exec_).split():
            assert name in services, name
            assert services[name].get("profiles") == ["ray"], name
            if profile:
                assert profile in services[name]["profiles"], (profile, name)
    (extras,) = re.findall(r"docker build -f (\S+) --build-arg EXTRAS=(\S+)", text)
    assert REPO / extras[0] == DOCKERFILE
    assert extras[1] == _compose()["x-image-ray"]["build"]["args"]["EXTRAS"]
    assert extras[1] in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
