"""The GARE service on Ray Serve, over a sharded index: one ingress deployment running gare-serve's
FastAPI app, and one deployment per shard.

``serve run gare_serve.ray_serve.deployment:build_app index=/data/index`` (or ``serve.run(build_app({...}))``) builds:

- ``shard-000`` ... ``shard-NNN``: one deployment per shard, ``shard_replicas`` replicas each. A replica loads
  psi alone from the checkpoint (``gare_serve.ray_serve.shard_replica.load_shard_model``: not the CLIP towers, which only
  the ingress holds) and opens its shard, memory-mapped, at the version the current generation names
  (``gare_serve.ray_serve.shard_replica.ShardWorker``); it answers stage 1 + the psi rerank + biases for the queries the
  ingress sends (``gare_search.shard_search.shard_candidates``), the examples' rows, image stage 1 and metadata, each
  for the generation the request names.
- ``gare-ingress``: gare-serve's app (``gare_serve.app.create_app``: the same routes, schemas, auth and key roles, limits,
  caches and page) with a ``gare_serve.ray_serve.ingress_state.ShardedServiceState``: it encodes each query once, calls every
  shard through :class:`RayShards` and merges the global top k (``gare_search.shard_search.merge``). As gare-serve,
  it records the query bank (``GARE_QUERY_BANK_SIZE``, ``GARE_QUERY_BANK_PATH``: a path the ingress can write; with
  several ingress replicas each rewrites the file with its own bank, so it holds one replica's share) and watches
  stage-1 recall (``GARE_RECALL_*``: sampled queries probed on every shard, the ``gare_stage1_recall_*`` metrics
  and alarm on the ingress's ``/metrics``; docs/retune.md).

Arguments (``serve run ... key=value`` or the dict): ``index`` (required, a sharded INDEX root, on storage every
node sees), ``checkpoint`` (optional, as gare-serve), ``shard_replicas`` (default 1), ``ingress_replicas``
(default 1), ``allow_partial`` (default false: a shard that does not answer is a 503; true: the answer of the
others, flagged ``partial`` with ``missing_shards``), ``shard_timeout_s`` (default ``SHARD_TIMEOUT_S``, 10 s:
how long the ingress waits for a shard before counting it as not answering). Every other setting comes from the
``GARE_*`` variables gare-serve reads (``gare_serve.settings``), in the ingress and in every shard replica.

Ray binds every interface unless told otherwise: start each node with ``python -m gare_serve.ray_serve.ray_node``
(``ray start`` with every listener on the node address, and gare-serve's HTTP limits in Serve's proxy:
``gare_serve.ray_serve.proxy_limits``), and Serve's HTTP proxy on the address you mean (``serve start --http-host``).
Each replica binds Ray's inter-deployment gRPC server to its node address
(``gare_serve.ray_serve.ray_node.bind_replica_grpc_to_node_address``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from gare.model import resolve_device
from gare_index.shards import current_generation, shard_root
from gare_search import rerank
from gare_search.by_example import ExampleError
from gare_serve.app import create_app
from gare_serve.engine.startup import resolve_checkpoint
from gare_serve.ray_serve.ingress_state import ShardedServiceState, follow_generations
from gare_serve.ray_serve.ray_node import bind_replica_grpc_to_node_address
from gare_serve.ray_serve.shard_replica import SHARD_CALLS, ShardWorker, load_shard_model
from gare_serve.settings import load_settings

log = logging.getLogger(__name__)

__all__ = ["AppArgs", "RayShards", "ShardServer", "Ingress", "build_app", "SHARD_TIMEOUT_S"]

INGRESS_NAME = "gare-ingress"
SHARD_TIMEOUT_S = 10.0  # build_app's default shard_timeout_s: how long the ingress waits for a shard


def shard_deployment_name(shard: int) -> str:
    return f"shard-{int(shard):03d}"


class AppArgs:
    """``build_app``'s arguments, checked: a bad value is a ValueError naming it."""

    KNOWN = ("index", "checkpoint", "shard_replicas", "ingress_replicas", "allow_partial", "shard_timeout_s")

    def __init__(self, args: Mapping[str, Any]) -> None:
        unknown = sorted(set(args) - set(self.KNOWN))
        if unknown:
            raise ValueError(f"unknown build_app arguments {unknown}; known: {list(self.KNOWN)}")
        if not args.get("index"):
            raise ValueError("build_app needs index=<a sharded INDEX root> (gare-index build --shards N)")
        self.index = str(args["index"])
        self.checkpoint = str(args["checkpoint"]) if args.get("checkpoint") else None
        self.shard_replicas = self._int(args, "shard_replicas", 1)
        self.ingress_replicas = self._int(args, "ingress_replicas", 1)
        self.allow_partial = self._bool(args, "allow_partial", False)
        self.shard_timeout_s = float(args.get("shard_timeout_s", SHARD_TIMEOUT_S))
        if not self.shard_timeout_s > 0:
            raise ValueError(f"shard_timeout_s must be > 0, got {args.get('shard_timeout_s')!r}")

    @staticmethod
    def _int(args: Mapping[str, Any], name: str, default: int) -> int:
        v = args.get(name, default)
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}") from None
        if n < 1 or isinstance(v, bool) or (isinstance(v, float) and v != n):
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        return n

    @staticmethod
    def _bool(args: Mapping[str, Any], name: str, default: bool) -> bool:
        v = args.get(name, default)
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return v.strip().lower() in ("1", "true", "yes", "on")
        raise ValueError(f"{name} must be true or false, got {v!r}")

    def settings_overrides(self) -> dict[str, Any]:
        return {"index": self.index, "checkpoint": self.checkpoint}


@serve.deployment
class ShardServer:
    """One shard of the index (a Ray Serve deployment per shard; its replicas all serve that shard)."""

    def __init__(self, index: str, shard: int, checkpoint: str | None) -> None:
        bind_replica_grpc_to_node_address()  # before Ray starts this replica's gRPC server (after the constructor)
        settings = load_settings(index=str(shard_root(index, shard)), checkpoint=checkpoint)
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        path, sha, _ = resolve_checkpoint(settings)
        model = load_shard_model(path, resolve_device(settings.device))  # psi alone: the ingress encodes queries
        self.worker = ShardWorker(index, shard, model, expect_checkpoint_sha=sha, verify=settings.verify_index,
                                  use_gpu=settings.use_gpu_ann, check=settings.index_check,
                                  rerank_settings=rerank.RerankSettings(device=settings.rerank_device))
        self.shard = shard

    def call(self, method: str, *args: Any) -> Any:
        if method not in SHARD_CALLS:
            raise ValueError(f"unknown shard call {method!r}; one of {SHARD_CALLS}")
        return getattr(self.worker, method)(*args)


class RayShards:
    """The shard deployments as the ingress calls them (``gare_serve.ray_serve.ingress_state.ShardClient``): one call per
    shard, all in flight at once, each waited for at most ``timeout_s`` (or the call's own: the recall watch's paced
    probes); a shard whose replica died, timed out or failed is left out of the answer (and logged), so the caller
    flags it. An ExampleError (an unknown example id) is the user's error and is raised as such."""

    def __init__(self, handles: Sequence[DeploymentHandle], timeout_s: float) -> None:
        self.handles = list(handles)
        self.n_shards = len(self.handles)
        self.timeout_s = float(timeout_s)

    def call(self, method: str, args: Mapping[int, tuple[Any, ...]], timeout_s: float | None = None) -> dict[int, Any]:
        # called from worker threads (the micro-batcher's, the route thread pool, the recall watch's): blocking waits
        # are allowed there
        pending = {s: self.handles[s].call.remote(method, *a) for s, a in args.items()}
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else float(timeout_s))
        out: dict[int, Any] = {}
        for s, resp in pending.items():
            try:
                out[s] = resp.result(timeout_s=max(0.05, deadline - time.monotonic()))
            except ExampleError as e:  # Ray raises the replica's error as a subclass of it; its cause is the error
                cause = getattr(e, "cause", None)
                raise (cause if isinstance(cause, ExampleError) else e) from None
            except Exception as e:  # noqa: BLE001 - a dead replica, a timeout, a failure: this shard did not answer
                log.warning("shard %d did not answer %s: %s", s, method, str(e).splitlines()[0] if str(e) else type(e))
                resp.cancel()
        return out


@serve.deployment(name=INGRESS_NAME)
@serve.ingress()
class Ingress:
    """gare-serve's FastAPI app over the shards (built on the replica: ``__serve_build_asgi_app__``)."""

    def __init__(self, shards: list[DeploymentHandle], args: dict[str, Any]) -> None:
        bind_replica_grpc_to_node_address()  # before Ray starts this replica's gRPC server (after the constructor)
        self.shards = shards
        self.args = AppArgs(args)

    def __serve_build_asgi_app__(self) -> Any:
        a = self.args
        client = RayShards(self.shards, a.shard_timeout_s)
        settings = load_settings(**a.settings_overrides())
        return create_app(settings, state_factory=functools.partial(ShardedServiceState, client=client,
                                                                    allow_partial=a.allow_partial),
                          follow=follow_generations)


def build_app(args: dict[str, Any]) -> Any:
    """The Ray Serve application (``serve run gare_serve.ray_serve.deployment:build_app index=...``): one deployment per shard of
    the index's current generation and the ingress over them. ValueError naming a bad argument."""
    a = AppArgs(args)
    gen = current_generation(a.index)
    if gen is None:
        raise ValueError(f"index={a.index!r} is not a sharded index (no GENERATION file); build one with "
                         "gare-index build --shards N")
    shards = [ShardServer.options(name=shard_deployment_name(s), num_replicas=a.shard_replicas)
              .bind(a.index, s, a.checkpoint) for s in range(gen.n_shards)]
    return Ingress.options(num_replicas=a.ingress_replicas).bind(shards, dict(args))
