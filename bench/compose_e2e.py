"""The docker compose deployment run for real with podman (issue 30): images built from deploy/Dockerfile.*,
a library and a model made by the one-shot services, the stack started with docker-compose.yml as shipped,
searched through the proxy, an index rebuilt under the running replicas, one api container killed under load.

    python -m bench.compose_e2e            # root, podman + podman-compose + debootstrap (see ../shared/containers.md)

Every step is a check with its observed result; the report (bench/results/compose_e2e.{json,md}) is written
from this run's observations only, a failed check shows as FAILED and the exit status is 1. Too slow for CI
(~20-40 min on 2 cores, most of it the first image build); tests/service/test_deploy.py checks the same files
offline.

What is specific to a machine without a container registry (the committed files keep the upstream defaults):
  * base images made from Debian packages by deploy/local-base.sh, passed as the BASE_IMAGE / NGINX_IMAGE build
    arguments; torch from PyPI (TORCH_INDEX_URL) since the PyTorch CPU index is unreachable;
  * pip inside the build reads a build-only /etc/pip.conf (bind mount, never copied into the image) with the
    host's CA bundle and the host's local wheel folders as find-links (PyPI stays the index);
  * podman runs with runc and no default rlimits (CONTAINERS_CONF below); there is no systemd here, so podman
    never runs the healthchecks by itself: this script runs each container's healthcheck (podman healthcheck
    run) and reports its result;
  * podman-compose 1.0.3 (Debian) knows no profiles: the stack is started as `up -d api proxy` (what `docker
    compose up -d` starts), the one-shot services with `run --no-deps -T --rm trainer|indexer` (its `run` of a
    service without dependencies otherwise starts every service of the file, api-gpu included).
Clients only ever talk to 127.0.0.1 (the proxy's published port) or to 127.0.0.1 inside a container (podman exec).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench import harness

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "docker-compose.yml",
    "deploy/",
    "pyproject.toml",
    "training/",
    "indexer/",
    "service/",
)


REPO = Path(__file__).resolve().parents[1]
PROJECT = "gare-search"
IMG_CPU, IMG_PROXY = "gare-search:cpu", "gare-search:proxy"
BASE_PY, BASE_NGINX = "localhost/gare-local/python:3.11-bookworm", "localhost/gare-local/nginx:sid"
TORCH_INDEX = "https://pypi.org/simple"
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
LOCAL_WHEELS = ["/opt/wheels", "/opt/pypi/files", "/opt/pypi-more/files"]  # host folders of wheels, if present
DEMO_MODEL = "gare-cpu-demo"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work).resolve()
        self.src = self.work / "src"
        self.data = self.work / "data"
        self.library = self.work / "library"
        self.conf = self.work / "containers.conf"
        self.pip_conf = self.work / "pip.conf"
        self.base = f"http://127.0.0.1:{args.port}"
        self.api_key = "e2e-" + secrets.token_hex(16)
        self.media_secret = secrets.token_hex(32)
        self.checks: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {}
        self.env = dict(os.environ, CONTAINERS_CONF=str(self.conf), GARE_ADMIN_KEYS=self.api_key,
                        GARE_REQUIRE_KEY_FOR_SEARCH="true", GARE_MEDIA_SECRET=self.media_secret,
                        GARE_INDEX_POLL_S=str(args.poll_s), GARE_WORKERS="1", GARE_API_MEMORY=args.api_memory,
                        GARE_DATA=str(self.data), GARE_LIBRARY=str(self.library), GARE_PORT=str(args.port),
                        GARE_BIND="127.0.0.1", GARE_LOG_LEVEL="warning")

    # ---------------------------------------------------------------- helpers
    def check(self, name: str, ok: bool, detail: str = "", **data: Any) -> bool:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail, **data})
        log(f"{'ok     ' if ok else 'FAILED '} {name}: {detail}")
        return bool(ok)

    def sh(self, cmd: list[str], *, cwd: Path | None = None, timeout: float = 3600, check: bool = False,
           logfile: Path | None = None, quiet: bool = False) -> subprocess.CompletedProcess[str]:
        if not quiet:
            log("$ " + " ".join(cmd))
        if logfile is not None:  # long steps: output streamed to a file, progress lines to the console
            with open(logfile, "w") as fh:
                proc = subprocess.Popen(cmd, cwd=cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1)
                assert proc.stdout is not None
                last = 0.0
                for line in proc.stdout:
                    fh.write(line)
                    if re.match(r"^(STEP|COMMIT|Successfully|epoch|\[|Collecting torch|Installing collected)", line) \
                            or time.monotonic() - last > 30:
                        print("    " + line.rstrip()[:160], flush=True)
                        last = time.monotonic()
                rc = proc.wait(timeout=timeout)
            out = logfile.read_text()
            res = subprocess.CompletedProcess(cmd, rc, out, "")
        else:
            res = subprocess.run(cmd, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: {(res.stdout + res.stderr)[-2000:]}")
        return res

    @staticmethod
    def compose_rc(res: subprocess.CompletedProcess[str]) -> int:
        """podman-compose 1.0.3 `run` exits 0 whatever the container did; it prints "exit code: N" per podman call."""
        codes = [int(c) for c in re.findall(r"^exit code: (-?\d+)$", res.stdout, re.M)]
        return res.returncode or (codes[-1] if codes else 0)

    def podman(self, *a: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.sh(["podman", *a], **kw)

    def compose(self, *a: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.sh(["podman-compose", "-p", PROJECT, "-f", "docker-compose.yml", *a], cwd=self.src, **kw)

    def containers(self, service: str, all_: bool = False) -> list[str]:
        res = self.podman("ps", *(["-a"] if all_ else []), "--filter", f"label=com.docker.compose.project={PROJECT}",
                          "--filter", f"label=com.docker.compose.service={service}", "--format", "{{.Names}}", quiet=True)
        return sorted(n for n in res.stdout.split() if n)

    def inspect(self, name: str, fmt: str) -> str:
        return self.podman("inspect", "-f", fmt, name, quiet=True).stdout.strip()

    def exec_get(self, container: str, path: str, timeout: float = 10) -> tuple[int, str]:
        """GET http://127.0.0.1:8000<path> inside an api container (its own loopback), with the API key."""
        code = ("import sys,urllib.request,urllib.error\n"
                "r=urllib.request.Request('http://127.0.0.1:8000'+sys.argv[1],headers={'X-API-Key':sys.argv[2]})\n"
                "try:\n s=urllib.request.urlopen(r,timeout=8); print(s.status); print(s.read().decode())\n"
                "except urllib.error.HTTPError as e:\n print(e.code); print(e.read().decode())\n")
        try:
            res = self.podman("exec", container, "python", "-c", code, path, self.api_key, quiet=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return -1, "timeout"
        if res.returncode != 0:
            return -1, (res.stderr or res.stdout)[-300:]
        first, _, rest = res.stdout.partition("\n")
        return int(first), rest

    def headers(self) -> dict[str, str]:
        return {"X-API-Key": self.api_key}

    # ---------------------------------------------------------------- steps
    def clean(self) -> None:
        log("clean state: removing this project's containers, network, the built images and the work folder")
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        self.conf.write_text('[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n')
        res = self.podman("ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}", "--format", "{{.Names}}",
                          quiet=True)
        names = res.stdout.split()
        if names:
            self.podman("rm", "-f", "-t", "0", *names)
        self.podman("network", "rm", "-f", f"{PROJECT}_default", quiet=True)
        if not self.args.keep_images:
            for img in (IMG_CPU, IMG_PROXY):
                self.podman("rmi", "-f", img, quiet=True)
            self.podman("image", "prune", "-f", quiet=True)  # dangling layers of earlier builds
        left = self.podman("ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}", "-q", quiet=True).stdout.split()
        imgs = [i for i in (IMG_CPU, IMG_PROXY) if self.podman("image", "exists", i, quiet=True).returncode == 0]
        self.check("clean start", not left and (self.args.keep_images or not imgs),
                   f"{len(left)} containers of the project left; built images present: {imgs or 'none'}"
                   + (" (kept: --keep-images)" if self.args.keep_images else ""))

    def setup(self) -> None:
        wheels = [d for d in LOCAL_WHEELS if Path(d).is_dir()]
        self.pip_conf.write_text("[global]\ncert = /host-ca.crt\n" + ("find-links =\n" + "".join(f"    {d}\n" for d in wheels)
                                                                     if wheels else ""))
        self.wheels = wheels
        head = harness.STATE_AT_START["commit"]
        if self.args.worktree:
            shutil.copytree(REPO, self.src, ignore=shutil.ignore_patterns(".git", "*.egg-info", "__pycache__", "data", "library"))
            self.facts["source"] = f"the working tree at {head}" + (
                " with uncommitted changes" if harness.STATE_AT_START["dirty"] else "")
        else:  # the committed tree only: other people's uncommitted edits stay out of the images
            self.src.mkdir()
            archive = subprocess.run(["git", "archive", head], cwd=REPO, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(self.src)], input=archive, check=True)
            self.facts["source"] = f"git archive {head}"
        self.facts["commit"] = head
        pv = self.podman("version", "--format", "{{.Client.Version}}", quiet=True).stdout.strip()
        pcv = self.sh(["podman-compose", "version"], quiet=True).stdout
        m = re.search(r"podman-compos\w* version\s+(\S+)", pcv)
        self.facts.update(podman=pv, podman_compose=m.group(1) if m else pcv.strip()[-40:],
                          runtime=self.inspect_runtime(), cores=os.cpu_count(),
                          mem_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                          kernel=os.uname().release)
        log(f"podman {pv}, podman-compose {self.facts['podman_compose']}, commit {head[:12]}")

    def inspect_runtime(self) -> str:
        res = self.podman("info", "--format", "{{.Host.OCIRuntime.Name}} {{.Host.OCIRuntime.Version}}", quiet=True)
        return res.stdout.strip().splitlines()[0] if res.stdout.strip() else "?"

    def base_images(self) -> None:
        t0 = time.perf_counter()
        existed = {b: self.podman("image", "exists", b, quiet=True).returncode == 0 for b in (BASE_PY, BASE_NGINX)}
        res = self.sh(["bash", str(self.src / "deploy" / "local-base.sh")], logfile=self.work / "local-base.log")
        info = {}
        for b in (BASE_PY, BASE_NGINX):
            info[b] = {"reused": existed[b], "created": self.inspect(b, "{{.Created}}")[:19],
                       "size_mb": round(int(self.inspect(b, "{{.Size}}") or 0) / 1e6)}
        self.facts["base_images"] = info
        self.check("base images (Debian packages, deploy/local-base.sh)", res.returncode == 0,
                   "; ".join(f"{b}: {'reused, made ' + v['created'] if v['reused'] else 'made now'} ({v['size_mb']} MB)"
                             for b, v in info.items()), seconds=round(time.perf_counter() - t0, 1))

    def build(self) -> None:
        mounts = ["-v", f"{HOST_CA}:/host-ca.crt:ro", "-v", f"{self.pip_conf}:/etc/pip.conf:ro"]
        for d in self.wheels:
            mounts += ["-v", f"{d}:{d}:ro"]
        self.facts["builds"] = {}
        for img, dockerfile, bargs in (
            (IMG_CPU, "deploy/Dockerfile.cpu", [f"BASE_IMAGE={BASE_PY}", f"TORCH_INDEX_URL={TORCH_INDEX}"]),
            (IMG_PROXY, "deploy/Dockerfile.proxy", [f"NGINX_IMAGE={BASE_NGINX}"]),
        ):
            log(f"building {img} from {dockerfile} ({' '.join(bargs)})")
            t0 = time.perf_counter()
            # docker format: podman's default (OCI) drops the Dockerfile's HEALTHCHECK
            cmd = ["podman", "build", "--format", "docker", "-f", dockerfile, "-t", img, *[x for a in bargs for x in ("--build-arg", a)],
                   *(mounts if img == IMG_CPU else []), "."]
            res = self.sh(cmd, cwd=self.src, logfile=self.work / f"build-{img.split(':')[1]}.log")
            secs = round(time.perf_counter() - t0, 1)
            ok = res.returncode == 0
            size = int(self.inspect(img, "{{.Size}}") or 0) if ok else 0
            cached = len(re.findall(r"--> Using cache", res.stdout))
            self.facts["builds"][img] = {"seconds": secs, "size_mb": round(size / 1e6), "build_args": bargs,
                                         "steps_from_cache": cached}
            self.check(f"build {img}", ok, f"{dockerfile} in {secs:.0f} s, image {size / 1e6:.0f} MB"
                       + (f" ({cached} steps from cache)" if cached else "") + ("" if ok else f": {res.stdout[-600:]}"),
                       seconds=secs)
            if not ok:
                raise SystemExit(self.finish())
        # nothing of the build-only mounts ended up in the image
        # (podman build -v leaves an empty mount point where each mount was: the files must be empty)
        res = self.podman("run", "--rm", IMG_CPU, "sh", "-c", "id -u; cat /host-ca.crt /etc/pip.conf 2>/dev/null | wc -c; "
                          "python -c 'import torch, faiss, gare, gare_search, gare_serve, gare_build, gare_train; print(torch.__version__)'", quiet=True)
        lines = res.stdout.split()
        self.facts["torch_in_image"] = lines[2] if len(lines) > 2 else None
        self.check("image: no build-only content inside, runs as 10001, imports", res.returncode == 0 and lines[:2] == ["10001", "0"],
                   f"uid {lines[0] if lines else '?'}; bytes of /host-ca.crt + /etc/pip.conf in the image: "
                   f"{lines[1] if len(lines) > 1 else '?'}; torch {self.facts['torch_in_image']}" + ("" if res.returncode == 0 else res.stderr[-300:]))

    def library_and_model(self) -> None:
        self.data.mkdir()
        self.library.mkdir()
        # the one-shot services write GARE_DATA as the image's user (README: chown it to 10001)
        os.chown(self.data, 10001, 10001)
        os.chown(self.library, 10001, 10001)
        t0 = time.perf_counter()
        n = self.args.videos
        res = self.podman("run", "--rm", "-v", f"{self.library}:/library", IMG_CPU, "gare-train", "synth", "--n-videos", str(n),
                          "--seed", "0", "--size", "96", "--duration", "4", "--hard-negative-rate", "0",
                          "--near-duplicate-rate", "0", "/library", logfile=self.work / "synth.log")
        vids = sorted(self.library.glob("videos/*.mp4"))
        self.check("library: gare-train synth in the image", res.returncode == 0 and len(vids) == n,
                   f"{len(vids)} mp4 files of {n}", seconds=round(time.perf_counter() - t0, 1))
        # the demo's recipe (gare_demo/demo.py DEMO_TRAIN), fewer epochs
        train = {"model": DEMO_MODEL, "data": {"kind": "synth", "root": "/library"}, "epochs": self.args.epochs,
                 "batch_size": 32, "lr": 1e-3, "coef_lr": 1.0, "augment": "none", "freeze_patch_embed": False,
                 "cache_frames": True, "early_stop_patience": 6, "num_workers": 2, "seed": 0}
        (self.data / "train.yaml").write_text(json.dumps(train, indent=1))  # JSON is YAML
        t0 = time.perf_counter()
        res = self.compose("run", "--no-deps", "-T", "--rm", "trainer", logfile=self.work / "trainer.log")
        rc = self.compose_rc(res)
        ckpt = self.data / "runs" / "train" / "best.safetensors"
        secs = round(time.perf_counter() - t0, 1)
        self.facts["train_seconds"] = secs
        m = re.search(r'"epochs_run": (\d+)', res.stdout)
        v = re.search(r'"best_val_r1": ([\d.]+)', res.stdout)
        self.facts["train"] = {"epochs_run": int(m.group(1)) if m else None, "best_val_r1": float(v.group(1)) if v else None}
        self.check("trainer one-shot service (podman-compose run --rm trainer)", rc == 0 and ckpt.exists(),
                   f"exit {rc}, {DEMO_MODEL}: {self.facts['train']['epochs_run']} epochs (at most {self.args.epochs}) in "
                   f"{secs:.0f} s, validation R@1 {self.facts['train']['best_val_r1']}; "
                   f"{ckpt.relative_to(self.work)} {'written' if ckpt.exists() else 'MISSING'}"
                   + ("" if rc == 0 else f": {res.stdout[-800:]}"), seconds=secs)

    def index(self, label: str) -> str | None:
        t0 = time.perf_counter()
        before = (self.data / "index" / "CURRENT").read_text().strip() if (self.data / "index" / "CURRENT").exists() else None
        res = self.compose("run", "--no-deps", "-T", "--rm", "indexer", logfile=self.work / f"indexer-{label}.log")
        rc = self.compose_rc(res)
        secs = round(time.perf_counter() - t0, 1)
        cur = self.data / "index" / "CURRENT"
        version = cur.read_text().strip() if cur.exists() else None
        # exit 3: built, some videos skipped (gare-index build)
        self.check(f"indexer one-shot service ({label})", rc in (0, 3) and version not in (None, before),
                   f"exit {rc}, CURRENT {before} -> {version} in {secs:.0f} s"
                   + ("" if rc in (0, 3) else f": {res.stdout[-800:]}"), seconds=secs)
        return version

    def healthcheck(self, name: str) -> bool:
        res = self.podman("healthcheck", "run", name, quiet=True, timeout=60)
        return res.returncode == 0 and "unhealthy" not in res.stdout

    def up(self) -> None:
        t0 = time.perf_counter()
        res = self.compose("up", "-d", "--no-build", "api", "proxy", logfile=self.work / "up.log")
        apis, proxies = self.containers("api"), self.containers("proxy")
        self.check("podman-compose up -d api proxy", res.returncode == 0 and len(apis) == 2 and len(proxies) == 1,
                   f"exit {res.returncode}; api containers {apis}, proxy {proxies}")
        self.apis, self.proxy = apis, proxies[0] if proxies else None
        if res.returncode != 0 or not proxies:
            raise RuntimeError("the stack did not start")
        ready: dict[str, float] = {}
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(ready) < len(apis):
            for c in apis:
                if c not in ready and self.exec_get(c, "/readyz")[0] == 200:
                    ready[c] = round(time.perf_counter() - t0, 1)
                    log(f"{c} ready after {ready[c]} s")
            time.sleep(1)
        proxy_ok_at = None
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.base + "/readyz", timeout=5)
                if r.status_code == 200:
                    proxy_ok_at = round(time.perf_counter() - t0, 1)
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.facts["start_seconds"] = {"replicas_ready": ready, "proxy_ready": proxy_ok_at}
        self.check("stack ready (each replica's /readyz inside it, then /readyz through the proxy)",
                   len(ready) == len(apis) == 2 and proxy_ok_at is not None,
                   f"replicas ready after {sorted(ready.values())} s, proxy answering after {proxy_ok_at} s")
        hc = {c: self.healthcheck(c) for c in [*apis, *([self.proxy] if self.proxy else [])]}
        self.check("compose healthchecks pass (podman healthcheck run; no systemd here to schedule them)", all(hc.values()),
                   ", ".join(f"{c}: {'healthy' if v else 'unhealthy'}" for c, v in hc.items()))
        if self.proxy:
            plog = self.podman("logs", self.proxy, quiet=True)
            m = re.search(r"proxy-entrypoint: resolver (\S+)", plog.stdout + plog.stderr)
            self.facts["proxy_resolver"] = m.group(1) if m else None
            self.check("proxy resolver taken from the container's resolv.conf", m is not None and m.group(1) != "127.0.0.11",
                       f"resolver {m.group(1) if m else 'not logged'} (Docker's would be 127.0.0.11)")
        # the api's user, read-only mounts and memory limit, as the containers run them
        c = apis[0] if apis else None
        if c:
            res = self.podman("exec", c, "sh", "-c", "id -u; touch /data/x 2>&1 || true; touch /library/x 2>&1 || true",
                              quiet=True)
            out = res.stdout
            mem = self.inspect(c, "{{.HostConfig.Memory}}")
            self.check("api container: uid 10001, /data and /library read-only, memory limit set",
                       out.startswith("10001") and out.count("Read-only file system") == 2 and int(mem or 0) > 0,
                       f"uid {out.split()[0] if out else '?'}; writes refused: {out.count('Read-only file system')} of 2; "
                       f"memory limit {int(mem or 0) / 2**30:.1f} GiB")

    def searches(self) -> None:
        h = self.headers()
        caps = [json.loads(x) for x in (self.library / "captions_test.jsonl").read_text().splitlines() if x.strip()]
        self.queries = [c["captions"][0] for c in caps] + [c for x in caps for c in x["captions"][1:]]
        with httpx.Client(base_url=self.base, timeout=30) as cl:
            r = cl.post("/v1/search", json={"query": self.queries[0], "k": 5})
            self.check("search without a key is refused (GARE_REQUIRE_KEY_FOR_SEARCH=true)", r.status_code == 401,
                       f"HTTP {r.status_code}")
            r = cl.post("/v1/search", json={"query": self.queries[0], "k": 5}, headers=h)
            body = r.json() if r.status_code == 200 else {}
            hits = body.get("results", [])
            self.check("text search through the proxy", r.status_code == 200 and len(hits) == 5,
                       f"HTTP {r.status_code}, {len(hits)} hits, index {body.get('index_version')}, "
                       f"top: {hits[0]['metadata'].get('name') if hits else None}")
            right = sum(1 for c in caps[:20] if self._rank_of(cl, c) is not None)
            self.facts["heldout_top10"] = f"{right} of {min(20, len(caps))}"
            self.check("held-out captions find their video (top 10, information only)", True,
                       f"{right} of {min(20, len(caps))} held-out test captions")
            vid = hits[0]["id"] if hits else 0
            r = cl.post("/v1/search", json={"video_id": vid, "k": 5}, headers=h)
            ex = r.json() if r.status_code == 200 else {}
            self.check("search by example {video_id} through the proxy", r.status_code == 200 and len(ex.get("results", [])) == 5,
                       f"HTTP {r.status_code}, example {ex.get('example')}, top id {ex.get('results', [{}])[0].get('id')}"
                       f" (the example itself: {vid})")
            png = self._frame_png()
            r = cl.post("/v1/search/image", files={"image": ("frame.png", png, "image/png")}, data={"k": "5"}, headers=h)
            im = r.json() if r.status_code == 200 else {}
            self.check("search by image upload (/v1/search/image) through the proxy",
                       r.status_code == 200 and len(im.get("results", [])) == 5,
                       f"HTTP {r.status_code}, {len(png)} byte PNG (a frame of a library video), example {im.get('example')}"
                       + ("" if r.status_code == 200 else f": {r.text[:200]}"))
            self.media(cl, hits)

    def _rank_of(self, cl: httpx.Client, cap: dict[str, Any]) -> int | None:
        r = cl.post("/v1/search", json={"query": cap["captions"][0], "k": 10}, headers=self.headers())
        if r.status_code != 200:
            return None
        name = Path(cap["video"]).name
        for h in r.json()["results"]:
            if h["metadata"].get("name") == name:
                return h["rank"]
        return None

    def _frame_png(self) -> bytes:
        import av

        video = sorted(self.library.glob("videos/*.mp4"))[0]
        with av.open(str(video)) as c:
            frame = next(c.decode(video=0)).to_image()
        buf = io.BytesIO()
        frame.save(buf, format="PNG")
        return buf.getvalue()

    def media(self, cl: httpx.Client, hits: list[dict[str, Any]]) -> None:
        """Signed media URLs from a search: each fetched several times through the proxy (both replicas answer)."""
        statuses: Counter[str] = Counter()
        n = 0
        mark = len(self.proxy_log())
        for hit in hits[:3]:
            for url, kind in ((hit["thumbnail_url"], "thumbnail"), (hit["video_url"], "file")):
                for _ in range(4):
                    hdr = {"Range": "bytes=0-1023"} if kind == "file" else {}
                    r = cl.get(url, headers=hdr)
                    statuses[f"{kind} {r.status_code}"] += 1
                    n += 1
        good = statuses["thumbnail 200"] + statuses["file 206"]
        answered = self.upstreams_since(mark)
        self.check("signed media URLs work through the proxy (thumbnail 200, file range 206), no key header",
                   n > 0 and good == n, f"{good} of {n} good ({dict(statuses)}); replicas that answered the proxy's media requests: "
                   f"{answered}")
        u = urllib.parse.urlsplit(hits[0]["thumbnail_url"]) if hits else None
        if u:
            q = urllib.parse.parse_qs(u.query)
            tampered = {k: (v[0][:-2] + ("AA" if not v[0].endswith("AA") else "BB")) for k, v in q.items()}
            r1 = cl.get(u.path)
            r2 = cl.get(u.path + "?" + urllib.parse.urlencode(tampered))
            self.check("media URL without or with a tampered token is refused", r1.status_code in (401, 403)
                       and r2.status_code in (401, 403), f"no token: HTTP {r1.status_code}, tampered: HTTP {r2.status_code}")

    # ---- which replica answered: the proxy's access log (upstream addresses) mapped to container names
    def replica_addrs(self) -> dict[str, str]:
        out = {}
        for c in self.containers("api"):
            ip = self.inspect(c, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
            if ip:
                out[f"{ip}:8000"] = c
        self.addr_names = {**getattr(self, "addr_names", {}), **out}
        return out

    def proxy_log(self) -> list[str]:
        res = self.podman("logs", self.proxy, quiet=True)
        return [ln for ln in (res.stdout + res.stderr).splitlines() if "upstream=[" in ln]

    def upstreams_since(self, mark: int) -> dict[str, int]:
        cnt: Counter[str] = Counter()
        for ln in self.proxy_log()[mark:]:
            m = re.search(r"upstream=\[([^\]]*)\]", ln)
            if m:
                last = m.group(1).split(",")[-1].strip()
                cnt[self.addr_names.get(last, last)] += 1
        return dict(cnt)

    def new_version(self, old: str | None) -> None:
        """More videos in the library, the indexer service again; every replica must switch by itself."""
        log("adding 20 videos to the library and building a new index version with the indexer service")
        res = self.podman("run", "--rm", "-v", f"{self.library}:/library", IMG_CPU, "gare-train", "synth", "--n-videos", "20",
                          "--seed", "1", "--size", "96", "--duration", "4", "/library/more", logfile=self.work / "synth-more.log")
        t_index = time.perf_counter()
        new = self.index("new version, 20 more videos")
        t_done = time.perf_counter()
        switched: dict[str, float | None] = dict.fromkeys(self.apis)
        deadline = time.monotonic() + 120
        n_seen: dict[str, Any] = {}
        while time.monotonic() < deadline and any(v is None for v in switched.values()):
            for c in self.apis:
                if switched[c] is None:
                    code, body = self.exec_get(c, "/v1/index")
                    if code == 200 and json.loads(body).get("version") == new:
                        switched[c] = round(time.perf_counter() - t_done, 1)
                        n_seen[c] = json.loads(body).get("n")
                        log(f"{c} serves {new} ({n_seen[c]} entries) {switched[c]} s after the indexer exited")
            time.sleep(0.5)
        self.facts["reindex"] = {"old": old, "new": new, "index_seconds": round(t_done - t_index, 1),
                                 "switch_after_s": switched, "entries": n_seen, "poll_s": self.args.poll_s}
        self.check("every replica serves the new version by itself (GET /v1/index inside each container)",
                   res.returncode == 0 and new not in (None, old) and all(v is not None for v in switched.values()),
                   f"{old} -> {new}; " + ", ".join(f"{c}: {v} s" for c, v in switched.items())
                   + f" after the indexer exited (GARE_INDEX_POLL_S={self.args.poll_s}); entries {sorted(set(n_seen.values()))}")
        mark = len(self.proxy_log())
        self.replica_addrs()
        vers = Counter()
        with httpx.Client(base_url=self.base, timeout=30) as cl:
            for i in range(20):
                r = cl.post("/v1/search", json={"query": self.queries[i % len(self.queries)], "k": 5}, headers=self.headers())
                vers[r.json().get("index_version") if r.status_code == 200 else f"HTTP {r.status_code}"] += 1
        by = self.upstreams_since(mark)
        self.check("through the proxy: 20 searches all answered from the new version, by both replicas",
                   vers == Counter({new: 20}) and len(by) == 2, f"versions {dict(vers)}; answered by {by}")
        self.version = new

    def load_and_kill(self) -> None:
        """8 clients for 60 s through the proxy; one api container SIGKILLed midway (its main process, as a crash)."""
        dur, nc = self.args.duration, self.args.clients
        self.replica_addrs()
        mark = len(self.proxy_log())
        results: list[tuple[float, float, int, str | None, str]] = []  # start, end, status, version, error
        lock = threading.Lock()
        stop_at = time.monotonic() + dur
        t0 = time.monotonic()
        wall0 = time.time()

        def client(i: int) -> None:
            j = i
            with httpx.Client(base_url=self.base, timeout=30, headers=self.headers()) as cl:
                while time.monotonic() < stop_at:
                    # a unique text per request: each one is encoded and searched (no result-cache answer)
                    q = f"{self.queries[j % len(self.queries)]} {j}"
                    j += nc
                    s = time.monotonic() - t0
                    try:
                        r = cl.post("/v1/search", json={"query": q, "k": 10})
                        ver = r.json().get("index_version") if r.status_code == 200 else None
                        rec = (s, time.monotonic() - t0, r.status_code, ver, "" if r.status_code == 200 else r.text[:120])
                    except httpx.HTTPError as e:
                        rec = (s, time.monotonic() - t0, 0, None, type(e).__name__)
                    with lock:
                        results.append(rec)

        victim = self.apis[-1]
        pid = int(self.inspect(victim, "{{.State.Pid}}"))
        restarts0 = self.inspect(victim, "{{.RestartCount}}")
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(nc)]
        log(f"load: {nc} clients for {dur} s through {self.base}; SIGKILL to {victim} (host pid {pid}) at {dur / 2:.0f} s")
        for t in threads:
            t.start()
        time.sleep(dur / 2)
        t_kill = time.monotonic() - t0
        os.kill(pid, signal.SIGKILL)
        log(f"killed {victim}'s main process at {t_kill:.1f} s")
        running_at = ready_at = None
        while time.monotonic() < stop_at + 90:
            now = time.monotonic() - t0
            if running_at is None:
                st = self.inspect(victim, "{{.State.Running}} {{.State.Pid}}").split()
                if st and st[0] == "true" and len(st) > 1 and int(st[1]) != pid:
                    running_at = now
                    log(f"{victim} running again at {now:.1f} s (restart policy)")
            elif ready_at is None and self.exec_get(victim, "/readyz")[0] == 200:
                ready_at = now
                log(f"{victim} ready again at {now:.1f} s")
                self.replica_addrs()  # its address after the restart
            if ready_at is not None and time.monotonic() >= stop_at:
                break
            time.sleep(0.5)
        for t in threads:
            t.join(timeout=60)
        restarts1 = self.inspect(victim, "{{.RestartCount}}")
        lines = self.proxy_log()[mark:]
        retried = [ln for ln in lines if re.search(r"upstream=\[[^\]]*,", ln)]
        after_ready = 0
        if ready_at is not None:
            new_addr = [a for a, n in self.addr_names.items() if n == victim][-1:]
            since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall0 + ready_at))
            after_ready = sum(1 for ln in lines if ln[:19] >= since and any(f"upstream=[{a}]" in ln for a in new_addr))
        ok = [r for r in results if r[2] == 200]
        failed = [r for r in results if r[2] != 200]
        inflight = [r for r in results if r[0] <= t_kill <= r[1]]
        versions = Counter(r[3] for r in ok)
        gaps = sorted(r[1] for r in ok)
        max_gap = max((b - a for a, b in zip(gaps, gaps[1:], strict=False)), default=0.0)
        rate = len(ok) / dur
        lat = sorted((r[1] - r[0]) * 1000 for r in ok)
        p = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 1)) if lat else (lambda q: None)
        self.facts["load"] = {"clients": nc, "seconds": dur, "requests": len(results), "ok": len(ok), "failed": len(failed),
                              "failures": Counter(f"{r[2]} {r[4]}" for r in failed).most_common(5),
                              "in_flight_at_kill": len(inflight), "retried_by_proxy": len(retried),
                              "versions": dict(versions), "qps": round(rate, 1), "p50_ms": p(0.5), "p99_ms": p(0.99),
                              "max_gap_between_answers_s": round(max_gap, 2), "kill_at_s": round(t_kill, 1),
                              "victim": victim, "running_again_s": None if running_at is None else round(running_at - t_kill, 1),
                              "ready_again_s": None if ready_at is None else round(ready_at - t_kill, 1),
                              "restart_count": f"{restarts0} -> {restarts1}", "victim_answers_after_restart": after_ready}
        L = self.facts["load"]
        self.check("restart policy brings the killed api container back (unless-stopped)",
                   running_at is not None and ready_at is not None,
                   f"{victim} SIGKILLed at {t_kill:.1f} s: running again after {L['running_again_s']} s, ready after "
                   f"{L['ready_again_s']} s, RestartCount {L['restart_count']}; the proxy sent it {after_ready} requests "
                   f"after it came back")
        self.check(f"no request lost under load ({nc} clients, {dur} s, kill midway)", len(failed) <= len(inflight),
                   f"{len(results)} requests, {len(ok)} answered 200, {len(failed)} failed {L['failures']}; "
                   f"{len(inflight)} were in flight at the kill (on either replica); the proxy retried {len(retried)} on the "
                   f"other replica; longest gap between answers {max_gap:.2f} s; {rate:.1f} q/s, p50 {L['p50_ms']} ms, "
                   f"p99 {L['p99_ms']} ms")
        self.check("every answer under load from a single index version", len(versions) == 1 and self.version in versions,
                   f"{dict(versions)}")

    def memory(self) -> None:
        res = self.podman("stats", "--no-stream", "--format", "{{.Name}} {{.MemUsage}}", *self.containers("api"),
                          *([self.proxy] if self.proxy else []), quiet=True)
        self.facts["memory"] = res.stdout.strip().splitlines() if res.returncode == 0 else [f"podman stats failed: {res.stderr[-200:]}"]
        self.check("memory use within the limits (podman stats)", res.returncode == 0,
                   "; ".join(self.facts["memory"]))

    def down(self) -> None:
        t0 = time.perf_counter()
        res = self.compose("down", logfile=self.work / "down.log")
        left = self.podman("ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}", "-q", quiet=True).stdout.split()
        secs = round(time.perf_counter() - t0, 1)
        self.facts["down_seconds"] = secs
        self.check("podman-compose down: the stack stops, no container left", res.returncode == 0 and not left,
                   f"exit {res.returncode} in {secs:.0f} s, {len(left)} containers left", seconds=secs)

    # ---------------------------------------------------------------- report
    def finish(self) -> int:
        failed = [c for c in self.checks if not c["ok"]]
        out = {"verdict": "passed" if not failed else "FAILED", "checks": self.checks, "facts": self.facts,
               "args": {k: v for k, v in vars(self.args).items() if k not in ("out", "render")},
               "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "wheels": getattr(self, "wheels", None),
               "run": self.record.record()}
        dest = Path(self.args.out)
        harness.write_report(dest.with_suffix(".json"), out, markdown)
        log(f"report: {dest.with_suffix('.md')} ({len(self.checks) - len(failed)} of {len(self.checks)} checks passed)")
        return 0 if not failed else 1


@harness.with_provenance
def markdown(out: dict[str, Any]) -> str:
    """The report, rendered from its JSON alone."""
    f = out["facts"]
    a = argparse.Namespace(**out["args"])
    checks = out["checks"]
    lines = [
        "# docker compose deployment, run for real with podman (issue 30)",
        "",
        f"Generated by `python -m bench.compose_e2e{' --keep-images' if a.keep_images else ''}` (as root) at "
        f"{out['finished']}: **{out['verdict']}**, {sum(c['ok'] for c in checks)} of {len(checks)} checks passed.",
        "",
        f"- source: {f.get('source')} (commit `{f.get('commit', '?')}`)",
        f"- podman {f.get('podman')} (runtime {f.get('runtime')}), podman-compose {f.get('podman_compose')}; "
        f"{f.get('cores')} cores, {f.get('mem_gib')} GiB, kernel {f.get('kernel')}",
        "- no container registry here: base images made from Debian packages by `deploy/local-base.sh` and passed "
        "as build arguments (the Dockerfiles' defaults stay `python:3.11-slim-bookworm`, the PyTorch CPU index and "
        "`nginx:1.29-alpine`); torch from PyPI, i.e. torch 2.14.1 with its CUDA libraries, which is why the CPU "
        "image is this large (the PyTorch CPU index's wheel has none of them)",
        "- pip in the build read a build-only `/etc/pip.conf` (bind mount: the host CA bundle, the host's local wheel "
        f"folders {', '.join(out['wheels']) if out.get('wheels') else '(none)'} as find-links); nothing of it "
        "is in the image (checked below)",
        f"- the stack as shipped in `docker-compose.yml`, with GARE_WORKERS=1, GARE_REQUIRE_KEY_FOR_SEARCH=true, a "
        f"GARE_MEDIA_SECRET, GARE_INDEX_POLL_S={a.poll_s}, GARE_API_MEMORY={a.api_memory}; every client request went "
        f"to 127.0.0.1:{a.port} (the proxy) or to 127.0.0.1 inside a container (podman exec)",
        "",
        "## Images and times",
        "",
        "| what | value |",
        "| --- | --- |",
    ]
    for b, v in (f.get("base_images") or {}).items():
        lines.append(f"| base `{b}` | {v['size_mb']} MB, {'reused (made ' + v['created'] + ')' if v['reused'] else 'made in this run'} |")
    for img, v in (f.get("builds") or {}).items():
        lines.append(f"| build `{img}` | {v['seconds']:.0f} s{' (' + str(v['steps_from_cache']) + ' steps from cache)' if v['steps_from_cache'] else ''}, image {v['size_mb']} MB |")
    if "train_seconds" in f:
        lines.append(f"| trainer ({DEMO_MODEL}, {a.videos} videos, up to {a.epochs} epochs) | {f['train_seconds']:.0f} s |")
    st = f.get("start_seconds") or {}
    if st:
        lines.append(f"| `up -d` to every replica ready / proxy answering | {sorted(st.get('replicas_ready', {}).values())} s / {st.get('proxy_ready')} s |")
    ri = f.get("reindex") or {}
    if ri:
        lines.append(f"| new index version ({ri['old']} -> {ri['new']}): indexer run / replicas switched after | "
                     f"{ri['index_seconds']:.0f} s / {list(ri['switch_after_s'].values())} s |")
    ld = f.get("load") or {}
    if ld:
        lines.append(f"| load {ld['clients']} clients x {ld['seconds']} s | {ld['requests']} requests, {ld['ok']} ok, "
                     f"{ld['failed']} failed, {ld['qps']} q/s, p50 {ld['p50_ms']} ms, p99 {ld['p99_ms']} ms |")
        lines.append(f"| killed api container back: running / ready | {ld['running_again_s']} s / {ld['ready_again_s']} s |")
    if "down_seconds" in f:
        lines.append(f"| `down` | {f['down_seconds']:.0f} s |")
    for m in f.get("memory") or []:
        lines.append(f"| memory (after the load) | {m} |")
    lines += ["", "## Checks", "", "| # | check | result | observed |", "| --- | --- | --- | --- |"]
    for i, c in enumerate(checks, 1):
        lines.append(f"| {i} | {c['check']} | {'passed' if c['ok'] else '**FAILED**'} | {c['detail'].replace('|', '/')} |")
    lines += ["", "The raw observations are in `compose_e2e.json` next to this file.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/var/tmp/gare-compose-e2e", help="library, data, logs and the exported source")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "compose_e2e"), help="report path without suffix")
    p.add_argument("--keep-images", action="store_true", help="keep the built images (iterating; the layers stay cached)")
    p.add_argument("--worktree", action="store_true", help="build the working tree instead of the committed HEAD")
    p.add_argument("--videos", type=int, default=120)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--poll-s", type=float, default=2)
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-memory", default="4g")
    p.add_argument("--keep-running", action="store_true", help="leave the stack up at the end (no down check)")
    harness.add_render_arg(p, REPO / "bench" / "results" / "compose_e2e.json")
    args = p.parse_args(argv)
    if args.render:
        print(f"wrote {harness.render_saved(args.render, markdown)}")
        return 0
    if os.geteuid() != 0:
        print("run as root (podman's storage in /var/lib/containers, chown of the data folder)", file=sys.stderr)
        return 2
    run = Run(args)
    run.record = harness.start(__name__, MEASURES, argv)
    run.clean()
    run.setup()
    try:
        run.base_images()
        run.build()
        run.library_and_model()
        v1 = run.index("first version")
        run.up()
        run.replica_addrs()
        run.searches()
        run.new_version(v1)
        run.load_and_kill()
        run.memory()
    except Exception as e:  # a step that could not even run is a failed check, and the report is still written
        import traceback

        traceback.print_exc()
        run.check("campaign ran to the end", False, f"{type(e).__name__}: {str(e)[:400]}")
    finally:
        if not args.keep_running and getattr(run, "apis", None) is not None:
            run.down()
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
