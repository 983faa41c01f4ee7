"""The Ray Serve fault campaign of issues 26 and 41: one shard replica killed every 10 s for 60 s under 16
closed-loop HTTP clients, two replicas per shard and the product's shard timeout, every answer judged against a
single flat index over the same videos; the verdict is issue 41's target: 0 wrong and 0 partial answers (and no
error) while one replica of each shard lives.

    python -m bench.ray_faults [--shards 2] [--replicas 2] [--clients 16] [--duration 60] [--kill-every 10]
                               [--kill one|all] [--shard-timeout S]
    python -m bench.ray_faults --render     # rewrite the .md from the committed .json

What runs: a tiny checkpoint and corpus (`gare-test-tiny`, real mp4 files), a flat single index (the reference) and
a sharded one (`gare-index build --shards N`: NCL biases fitted over the whole gallery). A child process, inside a
private network namespace with only loopback when run as root (``unshare -n`` + ``ip link set lo up``), starts a
local Ray cluster of 2 nodes bound to 127.0.0.1 (no dashboard), Serve's HTTP proxy on 127.0.0.1 and
``gare_serve.ray_serve.deployment:build_app`` with ``allow_partial``, ``--replicas`` replicas per shard and
``shard_timeout_s`` = ``--shard-timeout`` (default: the product's, ``deployment.SHARD_TIMEOUT_S``); 16 clients
query it over loopback while a kill falls due every ``--kill-every`` seconds, on the shards in turn (round robin).
``--kill one`` (the default) kills one replica of that shard with ``ray.kill``, and only once the shard runs all
its replicas (each alive in Ray's view and RUNNING in Serve's; a kill due earlier waits), so with two replicas or
more one replica of every shard always runs; ``--kill all`` kills every live replica of the shard (issue 26's
campaign). Ray Serve's controller starts a new replica for each one killed. Each answer is judged here:

- complete (200, not partial): must equal the single index's answer to that request (files, order, scores);
- partial: must be flagged, name its missing shards, hold only videos of the shards that answered, each with the
  single index's score for it, in score order; requests with k = K = every video must equal the single index's
  answer without the missing shards' videos;
- an error: counted by status (a 503 must name the shards that did not answer).

Verdict (issue 41): PASS only when the run is the target's campaign (>= 2 replicas per shard, ``--kill one``, kills
at most 10 s apart, the product's shard timeout, at least one kill and none still waiting at the end, never fewer
than one replica of a shard alive and RUNNING in the 0.5 s samples) and it saw 0 wrong answers, 0 partial answers,
0 errors and every answer after recovery complete and right; FAILED otherwise, and the exit status is then 1.

Results: bench/results/ray_faults.{json,md} (commit, command, date, CPU from lscpu); the .md is ``markdown(json)``
(a report written before issue 41, with no verdict, renders as it did).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from bench.harness import (  # noqa: E402
    add_render_arg,
    cpu_name,
    git_commit,
    render_saved,
    start,
    with_provenance,
    write_report,
)
from bench.support import CHECKOUT_PATH, free_port, tiny_checkpoint, tiny_corpus  # noqa: E402

# the product code this script's reports measure (bench/harness.py; `python -m bench.stale` reads it)
MEASURES: tuple[str, ...] = (
    "service/gare_serve/ray_serve/",
    "service/gare_serve/app.py",
    "service/gare_serve/settings.py",
    "indexer/gare_search/shard_search.py",
    "indexer/gare_index/shards.py",
    "indexer/gare_build/shard_build.py",
)


OUT = BENCH / "results" / "ray_faults"
LOOPBACK = "127.0.0.1"
TOL = 1e-5
KILL_POLICIES = ("one", "all")
# issue 41's target (with the product's shard timeout: gare_serve.ray_serve.deployment.SHARD_TIMEOUT_S, read when
# the run starts, since importing it needs ray)
TARGET = "0 wrong and 0 partial answers with two replicas per shard while one replica is killed every 10 s"
TARGET_REPLICAS = 2
TARGET_KILL_EVERY_S = 10.0


# ------------------------------------------------------------------------------------------ the child (Ray)
def replica_names(deployment: str) -> list[str]:
    import ray  # noqa: PLC0415 - the child process only

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::") and f"#{deployment}#" in a["name"])


def replica_states(deps: list[str]) -> dict[str, dict[str, int]]:
    """Serve's count of each deployment's replicas by state ({"RUNNING": 2, "STARTING": 1, ...})."""
    from ray import serve  # noqa: PLC0415 - the child process only

    app = serve.status().applications.get("gare")
    got = app.deployments if app else {}
    return {d: {str(getattr(st, "value", st)): n for st, n in got[d].replica_states.items()} if d in got else {}
            for d in deps}


def full_strength(names: list[str], states: dict[str, int], replicas: int) -> bool:
    """Whether a shard runs all its replicas: ``replicas`` named replica actors alive (Ray's view, which drops a
    killed one at once) and as many RUNNING in Serve's view (which counts a started replica only once it is ready,
    and drops a killed one after its health check), no other state. Killing one replica of a shard at full strength
    leaves ``replicas - 1`` running."""
    return len(names) == replicas and states.get("RUNNING", 0) == replicas and sum(states.values()) == replicas


def ask(client: httpx.Client, body: dict[str, Any], qi: int, t0: float) -> dict[str, Any]:
    t = time.perf_counter()
    try:
        r = client.post("/v1/search", json=body)
        b = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"detail": r.text}
        status = r.status_code
    except httpx.HTTPError as e:  # a transport error is an answer too: counted as status 0
        b, status = {"detail": f"{type(e).__name__}: {e}"}, 0
    return {"t": round(t - t0, 3), "ms": round((time.perf_counter() - t) * 1000, 2), "qi": qi, "status": status,
            "partial": b.get("partial"), "missing": b.get("missing_shards"), "version": b.get("index_version"),
            "hits": [[h["metadata"]["name"], h["id"], h["score"]] for h in b.get("results", [])],
            "detail": b.get("detail")}


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """The campaign on a loopback Ray cluster; the raw record of every answer, kill and replica set."""
    import ray  # noqa: PLC0415 - the child process only
    from ray import serve  # noqa: PLC0415
    from ray.cluster_utils import Cluster  # noqa: PLC0415

    from gare_serve.ray_serve.deployment import build_app, shard_deployment_name  # noqa: PLC0415

    node = {"node_ip_address": LOOPBACK, "include_dashboard": False, "num_cpus": cfg["num_cpus"],
            "object_store_memory": 100 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args=dict(node))
    for _ in range(cfg["nodes"] - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    out: dict[str, Any] = {"nodes": len([n for n in ray.nodes() if n["Alive"]]),
                           "node_ips": sorted({n["NodeManagerAddress"] for n in ray.nodes()})}
    base = f"http://{LOOPBACK}:{cfg['port']}"
    deps = [shard_deployment_name(s) for s in range(cfg["shards"])]
    try:
        serve.start(http_options={"host": LOOPBACK, "port": cfg["port"]})
        t_start = time.time()
        serve.run(build_app(cfg["app"]), name="gare", route_prefix="/", blocking=False)
        while time.time() - t_start < 300:
            try:
                if httpx.get(base + "/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("the Ray Serve app did not become ready in 300 s")
        out["ready_s"] = round(time.time() - t_start, 1)
        reqs, answers, kills, samples = cfg["requests"], [], [], []
        stop, lock = threading.Event(), threading.Lock()
        t0 = time.perf_counter()

        def client_loop(c: int) -> None:
            with httpx.Client(base_url=base, timeout=60) as cl:
                i = c * 7
                while not stop.is_set():
                    a = ask(cl, reqs[i % len(reqs)], i % len(reqs), t0)
                    with lock:
                        answers.append(a)
                    i += 1

        threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(cfg["clients"])]
        for th in threads:
            th.start()
        seen: dict[str, set[str]] = {d: set(replica_names(d)) for d in deps}
        # the kill schedule: one kill due every kill_every s (the first at kill_every / 2), each on the next shard in
        # turn; a due kill of policy "one" waits until its shard runs all its replicas (full_strength)
        next_due, dues, k = cfg["kill_every"] / 2, [], 0
        while time.perf_counter() - t0 < cfg["duration"]:
            now = time.perf_counter() - t0
            names = {d: replica_names(d) for d in deps}
            states = replica_states(deps)
            samples.append({"t": round(now, 2), "live": {d: len(v) for d, v in names.items()},
                             "running": {d: states[d].get("RUNNING", 0) for d in deps}})
            for d, v in names.items():
                seen[d] |= set(v)
            while now >= next_due:
                dues.append(next_due)
                next_due += cfg["kill_every"]
            if dues:
                s = k % cfg["shards"]
                v = names[deps[s]]
                if cfg["kill"] == "all":
                    victims = v
                elif full_strength(v, states[deps[s]], cfg["replicas"]):
                    victims = [v[(k // cfg["shards"]) % len(v)]]
                else:
                    victims = None  # the shard still runs fewer than all its replicas: this kill waits
                if victims is not None:
                    for name in victims:
                        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
                    kills.append({"t": round(now, 2), "due": round(dues.pop(0), 2), "shard": s, "killed": victims,
                                  "running_before": states[deps[s]].get("RUNNING", 0)})
                    k += 1
            time.sleep(0.5)
        out["kills_pending"] = [round(x, 2) for x in dues]  # kills due that still waited when the clients stopped
        stop.set()
        for th in threads:
            th.join(timeout=90)
        # recovery: every shard back to its replicas, then one complete round of every request
        t_rec = time.time()
        while time.time() - t_rec < 120 and not all(
                full_strength(replica_names(d), st, cfg["replicas"]) for d, st in replica_states(deps).items()):
            time.sleep(0.5)
        with httpx.Client(base_url=base, timeout=60) as cl:  # the new replicas' first calls (warm-up), not judged
            t_warm = time.time()
            while time.time() - t_warm < 60:
                a = ask(cl, reqs[0], 0, t0)
                if a["status"] == 200 and not a["partial"]:
                    break
        for d in deps:
            seen[d] |= set(replica_names(d))
        with httpx.Client(base_url=base, timeout=60) as cl:
            out["after"] = [ask(cl, body, i, t0) for i, body in enumerate(reqs)]
        out.update(answers=answers, kills=kills, samples=samples, recovered_s=round(time.time() - t_rec, 1),
                   replicas_seen={d: sorted(v) for d, v in seen.items()})
    finally:
        ray.shutdown()  # the cluster's processes go with it (no graceful Serve drain needed here)
        cluster.shutdown()
    return out


# ------------------------------------------------------------------------------------------ the parent
def reference(index: Path, requests: list[dict[str, Any]]) -> list[list[list[Any]]]:
    """The single index's answers [[name, id, score], ...] per request, through gare-serve's app in process."""
    from gare_serve.app import create_app  # noqa: PLC0415 - the parent only (the child never needs the reference)
    from gare_serve.settings import Settings  # noqa: PLC0415

    app = create_app(Settings(index=index, text_encoder="fp32", result_cache_entries=0, batch_max_wait_ms=1.0,
                              trusted_hosts="testserver"))

    async def go() -> list[list[list[Any]]]:
        async with app.router.lifespan_context(app):
            tr = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=tr, base_url="http://testserver", timeout=60) as c:
                out = []
                for body in requests:
                    r = await c.post("/v1/search", json=body)
                    r.raise_for_status()
                    out.append([[h["metadata"]["name"], h["id"], h["score"]] for h in r.json()["results"]])
                return out
    return asyncio.run(go())


def judge(a: dict[str, Any], want: list[list[Any]], table: dict[str, float], shard_of_name: dict[str, int],
          n_shards: int, every: bool) -> str:
    """'complete', 'partial', 'error' or why the answer is wrong. ``want``: the single index's answer to this
    request; ``table``: every video's score for this query (the single index's answer with k = K = all);
    ``every``: the request asked for every video (k = K = n), so a partial answer is fully determined."""
    if a["status"] != 200:
        if a["status"] == 503 and "did not answer" not in str(a["detail"]):
            return f"wrong: a 503 that names no shard: {a['detail']}"
        return "error"
    names = [h[0] for h in a["hits"]]
    if not a["partial"]:
        if a["missing"]:
            return f"wrong: missing shards {a['missing']} but not flagged partial"
        if names != [w[0] for w in want] or any(abs(h[2] - w[2]) > TOL for h, w in zip(a["hits"], want, strict=True)):
            return "wrong: a complete answer that differs from the single index's"
        return "complete"
    missing = a["missing"] or []
    if not missing:
        return "wrong: flagged partial but names no missing shard"
    if any(shard_of_name[h[0]] in missing or h[1] % n_shards != shard_of_name[h[0]] for h in a["hits"]):
        return f"wrong: a partial answer holds a video of a missing shard {missing} (or a wrong global id)"
    if any(abs(table[h[0]] - h[2]) > TOL for h in a["hits"]) or names != sorted(names, key=lambda n: -table[n]):
        return "wrong: a partial answer's scores or order differ from the single index's"
    if every and names != [w[0] for w in want if shard_of_name[w[0]] not in missing]:
        return "wrong: a partial answer is not the full answer less the missing shards' videos"
    return "partial"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))], 1)


def summarize(raw: dict[str, Any], refs: list[list[list[Any]]], tables: list[dict[str, float]],
              shard_of_name: dict[str, int], requests: list[dict[str, Any]], n_shards: int, n_videos: int
              ) -> dict[str, Any]:
    verdicts: dict[str, int] = {}
    errors: dict[str, int] = {}
    wrong: list[dict[str, Any]] = []
    partial_missing: dict[str, int] = {}
    lat_all, lat_ok = [], []
    for a in raw["answers"]:
        body = requests[a["qi"]]
        every = body["k"] >= n_videos and body["candidates"] >= n_videos
        v = judge(a, refs[a["qi"]], tables[a["qi"]], shard_of_name, n_shards, every)
        key = v if not v.startswith("wrong") else "wrong"
        verdicts[key] = verdicts.get(key, 0) + 1
        lat_all.append(a["ms"])
        if v == "error":
            errors[str(a["status"])] = errors.get(str(a["status"]), 0) + 1
        elif v == "partial":
            m = ",".join(map(str, a["missing"]))
            partial_missing[m] = partial_missing.get(m, 0) + 1
        elif v == "complete":
            lat_ok.append(a["ms"])
        if key == "wrong" and len(wrong) < 10:
            wrong.append({"why": v, "answer": a})
    after = [judge(a, refs[a["qi"]], tables[a["qi"]], shard_of_name, n_shards, False) for a in raw["after"]]
    killed = {n for k in raw["kills"] for n in k["killed"]}
    # every replica name seen beyond the ones the app started with is one Ray started after a kill
    started = sum(len(v) for v in raw["replicas_seen"].values()) - n_shards * raw["replicas"]
    n = len(raw["answers"])
    duration = raw["duration"]
    return {
        "requests": n, "qps": round(n / duration, 1), "complete": verdicts.get("complete", 0),
        "partial": verdicts.get("partial", 0), "partial_by_missing_shards": dict(sorted(partial_missing.items())),
        "errors": sum(errors.values()), "errors_by_status": dict(sorted(errors.items())),
        "error_rate": round(sum(errors.values()) / n, 4) if n else None, "wrong": verdicts.get("wrong", 0),
        "wrong_examples": wrong, "kills": len(raw["kills"]),
        "replicas_killed": len(killed), "kills_with_no_live_replica": sum(not k["killed"] for k in raw["kills"]),
        "replicas_restarted_seen": max(0, started), "recovered_s": raw["recovered_s"],
        "kills_waited": sum(k["t"] - k["due"] > 1.0 for k in raw["kills"]),
        "kill_wait_max_s": round(max((k["t"] - k["due"] for k in raw["kills"]), default=0.0), 2),
        "kills_pending": len(raw["kills_pending"]),
        # the fewest replicas of one shard alive in Ray's view and RUNNING in Serve's, over the 0.5 s samples
        "min_serving_replicas": min((min(r["live"][d], r["running"][d]) for r in raw["samples"] for d in r["live"]),
                                    default=None),
        "after_recovery": {"requests": len(after), "complete": after.count("complete"),
                           "other": [v for v in after if v != "complete"]},
        "p50_ms": pct(lat_all, 0.5), "p99_ms": pct(lat_all, 0.99), "complete_p50_ms": pct(lat_ok, 0.5),
        "complete_p99_ms": pct(lat_ok, 0.99),
    }


def verdict(c: dict[str, Any], s: dict[str, Any], product_timeout_s: float) -> dict[str, Any]:
    """Issue 41's verdict on one run: its conditions (the campaign is the target's) and its observations, each
    checked; PASS only when every check holds, FAILED otherwise."""
    other = len(s["after_recovery"]["other"])
    checks = [
        ("replicas per shard", c["replicas"], f">= {TARGET_REPLICAS}", c["replicas"] >= TARGET_REPLICAS),
        ("kill policy", c["kill"], "one (one replica at a time)", c["kill"] == "one"),
        ("seconds between kills", c["kill_every"], f"<= {TARGET_KILL_EVERY_S}", c["kill_every"] <= TARGET_KILL_EVERY_S),
        ("shard timeout (s)", c["shard_timeout_s"], f"the product's default, {product_timeout_s}",
         c["shard_timeout_s"] == product_timeout_s),
        ("kills made; kills due still waiting at the end", f"{s['kills']}; {s['kills_pending']}", ">= 1; 0",
         s["kills"] >= 1 and s["kills_pending"] == 0),
        ("fewest replicas of a shard alive and RUNNING (0.5 s samples)", s["min_serving_replicas"], ">= 1",
         s["min_serving_replicas"] is not None and s["min_serving_replicas"] >= 1),
        ("wrong answers", s["wrong"], "0", s["wrong"] == 0),
        ("partial answers", s["partial"], "0", s["partial"] == 0),
        ("errors (non-200 answers and transport errors)", s["errors"], "0", s["errors"] == 0),
        ("answers after recovery not complete and right", other, "0", other == 0),
    ]
    return {"target": TARGET, "verdict": "PASS" if all(ok for *_, ok in checks) else "FAILED",
            "checks": [{"what": w, "observed": o, "target": t, "ok": ok} for w, o, t, ok in checks]}


def kill_sentence(c: dict[str, Any]) -> str:
    if c.get("kill", "all") == "all":  # a report written before --kill existed killed every live replica
        return f"every {c['kill_every']} s every live replica of one shard (round robin) killed with `ray.kill`."
    return (f"every {c['kill_every']} s one replica of one shard (round robin over the shards) killed with "
            "`ray.kill`, each kill made only once that shard runs all its replicas again (a kill due earlier waits), "
            f"so at least {c['replicas'] - 1} replica(s) of each shard stay running.")


@with_provenance
def markdown(d: dict[str, Any]) -> str:
    s, c, v = d["summary"], d["config"], d.get("verdict")
    lines = [
        "# Ray Serve fault campaign (issue 26)" if v is None else "# Ray Serve fault campaign (issues 26 and 41)",
        "",
        f"Generated by `bench/ray_faults.py` from [ray_faults.json](ray_faults.json): commit `{d['commit']}`, "
        f"{d['date']}, {d['cpu']} ({d['cores']} cores), Ray {d['ray']}, Python {d['python']}.",
        "",
        f"Command: `{d['command']}`",
        "",
        f"Setup: {c['videos']} videos (`gare-test-tiny`, real mp4 files), `gare-index build --shards {c['shards']}` "
        f"(flat stage 1, NCL biases over the whole gallery), a local Ray cluster of {d['nodes']} nodes on "
        f"{', '.join(d['node_ips'])} ({d['network']}), {c['replicas']} replica(s) per shard, `allow_partial` on, "
        f"`shard_timeout_s` {c['shard_timeout_s']}. {c['clients']} closed-loop HTTP clients for {c['duration']} s; "
        f"{kill_sentence(c)} "
        f"{c['n_requests']} distinct requests (text, NCL on and off, k=5/K=8 and k=K=every video), each answer "
        "judged against a single flat index over the same videos. App ready after "
        f"{d['ready_s']} s.",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| requests (q/s) | {s['requests']} ({s['qps']}) |",
        f"| complete answers, equal to the single index's | {s['complete']} |",
        f"| partial answers, flagged and naming their missing shards (by missing shards) | {s['partial']} "
        f"({', '.join(f'[{k}]: {v}' for k, v in s['partial_by_missing_shards'].items()) or 'none'}) |",
        f"| **wrong answers** | **{s['wrong']}** |",
        f"| errors by status (rate) | {json.dumps(s['errors_by_status'])} ({s['error_rate']}) |",
        f"| kills (replicas killed; kills that found no live replica) | {s['kills']} ({s['replicas_killed']}; "
        f"{s['kills_with_no_live_replica']}) |",
        *([f"| kills that waited for their shard's replicas (longest wait, s); kills due still waiting at the end | "
           f"{s['kills_waited']} ({s['kill_wait_max_s']}); {s['kills_pending']} |",
           f"| fewest replicas of a shard alive and RUNNING, sampled every 0.5 s | {s['min_serving_replicas']} |"]
          if "kills_pending" in s else []),
        f"| replicas started by Ray, seen | {s['replicas_restarted_seen']} |",
        f"| after the campaign: every shard back and answering (s); complete right answers | {s['recovered_s']}; "
        f"{s['after_recovery']['complete']} of {s['after_recovery']['requests']} |",
        f"| latency p50 / p99, all answers (ms) | {s['p50_ms']} / {s['p99_ms']} |",
        f"| latency p50 / p99, complete answers (ms) | {s['complete_p50_ms']} / {s['complete_p99_ms']} |",
        "",
        f"Target (issue 26): no wrong answer, every partial answer flagged, error rate reported: "
        f"{'met' if s['wrong'] == 0 else 'NOT met'} ({s['wrong']} wrong, {s['partial']} partial all flagged, "
        f"error rate {s['error_rate']}).",
        "",
        *([] if v is None else [
            f"Target (issue 41): {v['target']}, with the product's shard timeout. Verdict: **{v['verdict']}**.",
            "",
            "| check | observed | target | holds |",
            "| --- | --- | --- | --- |",
            *[f"| {x['what']} | {x['observed']} | {x['target']} | {'yes' if x['ok'] else '**no**'} |"
              for x in v["checks"]],
            ""]),
        "Kills (s since the clients started: shard, replicas killed):",
        "",
        *[f"- {k['t']}: shard {k['shard']}, {len(k['killed'])}"
          + (f" (due at {k['due']}: waited for the shard's replicas)" if k.get("due") is not None
             and k["t"] - k["due"] > 1.0 else "") for k in d["kills"]],
        "",
        "Notes: a partial answer is checked for its flag, its missing shards, the absence of their videos, and each "
        "hit's score and order against the single index (and, for requests asking for every video, equality with the "
        "single index's answer less the missing shards' videos). A 2-core machine runs the cluster, the replicas and "
        "the 16 clients together: the latencies are this machine's, not a capacity figure (bench/sharded.py).",
        "",
    ]
    return "\n".join(lines)


def run_child(cfg: dict[str, Any], work: Path) -> tuple[dict[str, Any], str]:
    cfg_path, out_path = work / "cfg.json", work / "raw.json"
    cfg_path.write_text(json.dumps(cfg))
    cmd = [sys.executable, str(BENCH / "ray_faults.py"), "--child", str(cfg_path), str(out_path)]
    network = "127.0.0.1 bound explicitly"
    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip"):
        cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]
        network = "inside a private network namespace with only loopback, and bound to 127.0.0.1"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GARE_TORCH_THREADS": "1", "GARE_TEXT_ENCODER": "fp32",
           "GARE_RESULT_CACHE_ENTRIES": "0", "GARE_BATCH_MAX_WAIT_MS": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": CHECKOUT_PATH + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        raise RuntimeError(f"the Ray run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return json.loads(out_path.read_text()), network


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=TARGET_REPLICAS, help="replicas per shard")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--kill-every", type=float, default=TARGET_KILL_EVERY_S)
    ap.add_argument("--kill", choices=KILL_POLICIES, default="one",
                    help="one: one replica of a shard at full strength per kill (default); all: every live replica "
                         "of the shard (issue 26's campaign)")
    ap.add_argument("--videos", type=int, default=24)
    ap.add_argument("--shard-timeout", type=float, default=None,
                    help="the ingress's shard timeout, s (default: the product's, "
                         "gare_serve.ray_serve.deployment.SHARD_TIMEOUT_S)")
    ap.add_argument("--work", default="/tmp/gare-ray-faults")
    ap.add_argument("--out", default=str(OUT))
    add_render_arg(ap, Path(str(OUT) + ".json"))
    ap.add_argument("--child", nargs=2, metavar=("CFG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.child:
        cfg = json.loads(Path(args.child[0]).read_text())
        Path(args.child[1]).write_text(json.dumps(child(cfg)))
        return 0
    if args.render:
        render_saved(args.render, markdown)
        return 0
    for name in ("shards", "replicas", "clients", "videos"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    import ray  # noqa: PLC0415 - the optional dependency, named in the report

    from gare_serve.ray_serve.deployment import SHARD_TIMEOUT_S  # noqa: PLC0415 - needs ray
    if args.shard_timeout is None:
        args.shard_timeout = SHARD_TIMEOUT_S

    from gare_build.build import BuildOptions, build  # noqa: PLC0415
    from gare_build.shard_build import build_sharded  # noqa: PLC0415
    from gare_index.shards import open_sharded  # noqa: PLC0415

    run = start(__name__, MEASURES, argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ckpt = tiny_checkpoint(work / "tiny.safetensors")
    videos = tiny_corpus(work / "corpus", args.videos)
    captions = [json.loads(line)["captions"][0] for mf in sorted((work / "corpus").glob("*.jsonl"))
                for line in mf.read_text().splitlines() if line.strip()]
    opts = dict(workers=0, progress=False, index_type="flat")
    build(str(ckpt), str(videos), str(work / "single"), BuildOptions(**opts))
    build_sharded(str(ckpt), str(videos), work / "sharded", BuildOptions(**opts), n_shards=args.shards)
    with open_sharded(work / "sharded") as sh:
        shard_of_name = {Path(r["path"]).name: s for s, v in enumerate(sh.shards) for r in v.all_metadata()}
    n = args.videos
    requests = [{"query": q, "k": 5, "candidates": 8, "ncl": i % 2 == 0} if i % 3 else
                {"query": q, "k": n, "candidates": n, "ncl": i % 2 == 0} for i, q in enumerate(captions[:12])]
    refs = reference(work / "single", requests)
    every = reference(work / "single", [{**r, "k": n, "candidates": n} for r in requests])
    tables = [{h[0]: h[2] for h in e} for e in every]
    cfg = {"port": free_port(), "nodes": 2, "num_cpus": max(2, (args.shards * args.replicas + 1 + 1) // 2),
           "shards": args.shards, "replicas": args.replicas, "clients": args.clients, "duration": args.duration,
           "kill_every": args.kill_every, "kill": args.kill, "requests": requests,
           "app": {"index": str(work / "sharded"), "checkpoint": str(ckpt), "shard_replicas": args.replicas,
                   "allow_partial": True, "shard_timeout_s": args.shard_timeout}}
    print(f"built {n} videos in {args.shards} shards; starting the Ray campaign", flush=True)
    raw, network = run_child(cfg, work)
    raw.update(duration=args.duration, replicas=args.replicas)
    summary = summarize(raw, refs, tables, shard_of_name, requests, args.shards, n)
    config = {"shards": args.shards, "replicas": args.replicas, "clients": args.clients, "duration": args.duration,
              "kill_every": args.kill_every, "kill": args.kill, "videos": n, "shard_timeout_s": args.shard_timeout,
              "product_shard_timeout_s": SHARD_TIMEOUT_S, "n_requests": len(requests)}
    data = {
        "command": run.command,
        "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(),
        "cores": os.cpu_count(), "python": platform.python_version(), "ray": ray.__version__,
        "nodes": raw["nodes"], "node_ips": raw["node_ips"], "network": network, "ready_s": raw["ready_s"],
        "config": config, "kills": raw["kills"], "kills_pending": raw["kills_pending"], "summary": summary,
        "verdict": verdict(config, summary, SHARD_TIMEOUT_S), "run": run.record(),
    }
    print(write_report(out.with_suffix(".json"), data, markdown).read_text())
    return 0 if data["verdict"]["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
