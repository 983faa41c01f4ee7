"""Service settings: defaults < config file (YAML/JSON) < environment (``GARE_*``) < command line.

Every field can be set as ``GARE_<FIELD>`` (``GARE_INDEX``, ``GARE_REQUIRE_KEY_FOR_SEARCH=true``, ...),
as a key in the ``--config`` file (YAML or JSON mapping; unknown keys are an error), or on the command line
of ``gare-serve``. API keys have a role: ``GARE_SEARCH_KEYS`` (search, video and index routes) and
``GARE_ADMIN_KEYS`` (every route: admin and search), each comma-separated, and ``GARE_SEARCH_KEYS_FILE`` /
``GARE_ADMIN_KEYS_FILE`` (one key a line, ``#`` comments). The older ``GARE_API_KEYS`` (and its file) are admin keys.
Keys are never kept in clear: the settings hold each listed key as ``sha256:<hex>`` from the moment they are read,
and :func:`load_key_roles` turns the lists and files into sha256 hex digests per role (:class:`KeyRoles`).
"""

from __future__ import annotations

import contextvars
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from gare.text_quant import DEFAULT_CPU_TEXT_ENCODER, DEFAULT_CUDA_TEXT_ENCODER
from gare_search.filtered import FILTER_EXACT_BELOW
from gare_search.search import DEFAULT_CANDIDATES

ENV_PREFIX = "GARE_"
# The config file of the load_settings call in progress (read by Settings.settings_customise_sources).
_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("gare_config_file", default=None)


class SettingsError(ValueError):
    """A configuration problem the operator must fix (message is shown as is)."""


# The settings that list keys in clear: each entry is replaced by sha256:<hex> as the settings are read.
KEY_FIELDS = ("search_keys", "admin_keys", "api_keys")


def hashed_key_list(listed: str) -> str:
    """A comma-separated key list with every entry as ``sha256:<hex>`` (entries already in that form kept)."""
    return ",".join(f"sha256:{_key_digest(k)}" for k in _split_keys(listed))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Overrides (init) < GARE_* environment < config file (load_settings' file: pydantic-settings' YAML/JSON
        source) < defaults, first wins."""
        path = _CONFIG_FILE.get()
        base = (init_settings, env_settings, dotenv_settings, file_secret_settings)
        return base if path is None else (*base, config_file_source(settings_cls, path))

    # what to serve
    index: Path | None = Field(None, description="index directory (the one holding CURRENT)")
    checkpoint: Path | None = Field(
        None, description="checkpoint file; default: the path the index manifest names. Its sha256 must match the manifest"
    )
    device: str = Field("auto", description="torch device: auto (cuda when present), cpu, cuda, cuda:1, ...")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="text encoder precision; auto = the default tower at its own arithmetic (text_encoder auto), "
        "and for the model's own tower (text_encoder fp32) fp32 on the CPU, bf16 on CUDA (gare_search.query."
        "AUTO_PRECISION, the measured rule); fp16 is CUDA-only. The psi rerank (the fold) always runs in fp32"
    )
    text_encoder: Literal["auto", "fp32", "int8", "fp32-packed", "fp16"] = Field(
        "auto",
        description="query text tower: fp32 = the model's own (at `precision`); int8 (per-token activation and "
        "per-channel weight scales, exact integer sums: gare.text_quant) and fp32-packed (float32, a micro-batch's "
        "texts in shared GEMMs: gare.text_packed) are the CPU options; fp16 (the tower with "
        f"half-precision weights) the CUDA option; auto = {DEFAULT_CPU_TEXT_ENCODER} on the CPU and "
        f"{DEFAULT_CUDA_TEXT_ENCODER} on CUDA (the measured defaults) at fp32 precision, else fp32",
    )
    text_batch_rows: int = Field(
        32, ge=1, le=1024, description="on CUDA the query text tower runs fixed-shape micro-batches of this many rows x "
        "the query context (a text gets the same bits alone or beside others; gare.text_fixed); a change of it changes "
        "the embeddings' rounding, so it is part of the query cache's key"
    )
    text_batching: Literal["auto", "per-text", "fixed"] = Field(
        "auto", description="how the model's own text tower (text_encoder fp32) batches: fixed = fixed-shape "
        "micro-batches of text_batch_rows rows, per-text = each text alone at its own length; auto = fixed on CUDA "
        "(launch-bound: 32 texts cost one forward), per-text on the CPU (compute-bound); both give a text the same "
        "bits alone or beside others"
    )
    text_cuda_graph: bool = Field(
        True, description="replay the fixed-shape text tower as a CUDA graph (the same kernels, the same bits, without "
        "the per-kernel launch cost); a capture that fails falls back to the eager forward with a warning"
    )
    gpu_index: Literal["auto", "off"] = Field(
        "auto", description="auto = when the model runs on CUDA, copy the served index version (stage-1 vectors, the "
        "rerank's frames and psi constants) into GPU memory (gare_index.resident) if it fits under gpu_index_max_bytes "
        "and the free memory, else serve it from host memory with a warning; off = always the host path"
    )
    gpu_index_devices: str = Field(
        "", description="comma-separated CUDA devices the resident index is split across (contiguous row ranges); "
        "empty = the model's device (only a CUDA model gets a resident copy then); named devices are used whatever the "
        "model's device (cpu: a copy in host memory searched exactly by torch)"
    )
    gpu_index_max_bytes: int | None = Field(
        None, ge=0, description="most bytes the resident index may take on one device (None = what is free)"
    )
    stage1_method: Literal["auto", "exact", "ann"] = Field(
        "auto", description="stage 1 of a resident index: exact (one matrix product + top-k on the device, recall "
        "1.0), ann (the version's FAISS index), auto = the one measured faster at load (exact when it is as fast; "
        "the choice and both timings are logged and shown by /readyz)"
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch (and FAISS) intra-op threads; gare-serve sets usable cores // workers"
    )
    rerank_device: Literal["model", "cpu"] = Field(
        "model", description="where the psi rerank runs when the model is on a GPU: model = there (the candidates' "
        "rows are copied over), cpu = the compiled CPU kernel over the memory-mapped index (only the query crosses); "
        "on a CPU model both are the CPU kernel (gare_search.rerank.RerankSettings; bench/gpu_bench.py measures both)"
    )
    workers: int | None = Field(
        None, ge=1, le=256, description="worker processes behind the port (gare-serve; default: the usable cores)"
    )
    worker_sockets: Literal["auto", "reuseport", "shared"] = Field(
        "auto", description="how the workers of gare-serve --workers N listen: reuseport = a socket each on the port "
        "(SO_REUSEPORT: the kernel spreads connections evenly), shared = one socket for all (the first worker awake "
        "takes every queued connection); auto = reuseport on Linux, else shared (gare_serve/processes/port_group.py)"
    )
    engine: Literal["auto", "in_process", "shared"] = Field(
        "auto", description="where the searches run under gare-serve: in_process = every HTTP worker loads the model "
        "and the index itself; shared = one engine process loads them once on the device and searches for every "
        "worker, its micro-batches holding the queries of all of them (the workers keep routes, auth, limits, the "
        "result cache and the metadata; gare_serve/engine/engine_server.py); auto = shared when the device resolves "
        "to CUDA and there are several workers, else in_process"
    )
    engine_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="with engine=shared: a worker answers 503 when the engine has not answered "
        "a call within this"
    )
    run_dir: Path | None = Field(
        None, description="shared state of the workers of one gare-serve (set by gare-serve --workers; see gare_serve/engine/worker_board.py)"
    )
    worker_healthcheck_s: int = Field(
        120, ge=5, le=3600, description="uvicorn kills a worker that does not answer its ping for this long (startup included)"
    )
    reload_wait_s: float = Field(
        15.0, ge=0, le=600, description="how long POST /v1/admin/reload waits for every worker to switch"
    )
    use_gpu_ann: bool | None = Field(None, description="search FAISS on the GPU (default: when faiss has one)")
    verify_index: bool = Field(False, description="re-hash every index file when opening a version")
    index_check: bool = Field(
        True, description="before a version is served (start, reload, following CURRENT), re-hash every index file "
        "against the fast hash its manifest records (sha256 for a version written without them) and refuse a "
        "mismatch; off (GARE_INDEX_CHECK=off) serves files altered in place unnoticed (docs/index-format.md)"
    )
    index_recheck_s: float = Field(
        3600.0, ge=0, le=30 * 86400, description="with index_check: re-hash the served version's files every this "
        "many seconds (a file changed under the running server is logged and counted in "
        "gare_index_checks_total{phase=\"recheck\",result=\"mismatch\"}); 0 = never"
    )
    warm_index_bytes: int = Field(
        1 << 30, ge=0, description="at load and reload, ask the kernel to read this much of the index into the page "
        "cache, hottest first (the ANN index, stage-1 vectors, psi constants, then frames; gare_serve.engine.startup.warm_index)"
    )
    library_root: Path | None = Field(
        None, description="paths in responses are shown relative to this folder (default: file name only)"
    )

    # network
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    cors_origins: str = Field("", description="comma-separated allowed origins ('*' for any); empty = CORS closed")

    # security and limits
    search_keys: str = Field(
        "", repr=False, description="comma-separated search keys: search, video and index routes, never an admin "
        "route (each kept only as its sha256: an entry written sha256:<hex> is taken as the hash of a key)"
    )
    search_keys_file: Path | None = Field(None, description="file with one search key (or sha256:<hex>) a line")
    admin_keys: str = Field(
        "", repr=False, description="comma-separated admin keys: the admin routes (POST /v1/admin/...) and every "
        "search route (kept only as sha256 hashes, as search_keys)"
    )
    admin_keys_file: Path | None = Field(None, description="file with one admin key (or sha256:<hex>) a line")
    api_keys: str = Field(
        "", repr=False, description="deprecated: comma-separated keys taken as admin keys (a WARNING at start-up); "
        "use admin_keys and search_keys"
    )
    api_keys_file: Path | None = Field(None, description="deprecated: file of keys taken as admin keys; use admin_keys_file")
    require_key_for_search: bool = Field(
        False, description="search, video and index routes need a search or an admin key (admin routes always need an "
        "admin key)"
    )
    max_body_bytes: int = Field(256 * 1024, ge=1024)
    max_image_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="largest image upload (/v1/search/image)")
    max_image_pixels: int = Field(16_000_000, ge=1024, description="largest decoded image (width x height)")
    max_query_chars: int = Field(512, ge=1, le=100_000)
    max_k: int = Field(1000, ge=1, le=100_000)
    default_candidates: int = Field(DEFAULT_CANDIDATES, ge=1)
    max_candidates: int = Field(2048, ge=1, le=1_000_000)
    filter_exact_below: float = Field(
        FILTER_EXACT_BELOW, ge=0.0, le=1.0, description="a search filter passing at most this fraction of the gallery "
        "is searched exactly (every passing video scored, no ANN); a broader one runs the ANN with the filter inside")
    max_batch_queries: int = Field(64, ge=1, le=10_000)
    heap_trim_s: float = Field(
        2.0, ge=0, le=3600, description="how often a worker checks whether its heap's free memory grew by 8 MiB since "
        "its last heap trim, and then returns the freed heap to the system (glibc malloc_trim; 0 = never): a burst of large "
        "answers no longer leaves the worker grown (bench/results/http_unread.md)"
    )
    inflight_hits: int = Field(
        2048, ge=1, le=100_000_000, description="result hits one worker holds at once, from search to JSON (a request "
        "counts its queries x k); more wait their turn, and one larger than this runs alone. Bounds the memory a "
        "burst of large batches takes (bench/results/http_unread.md)"
    )
    max_image_aspect: float = Field(
        20.0, ge=1.0, le=10_000.0, description="largest long side / short side of an uploaded image (422 beyond)"
    )
    image_decode_concurrency: int = Field(
        2, ge=1, le=64, description="image uploads decoded and encoded at once per worker; more wait (bounded memory)"
    )
    header_timeout_s: float = Field(
        10.0, gt=0, le=600, description="a connection must send a request's complete headers within this (slow-client bound)"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="a request body must arrive within this once its headers are in (408 beyond)"
    )
    send_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="a connection whose client takes none of its answer's bytes for this long is "
        "reset (slow-reader bound; a client that keeps reading is never cut)"
    )
    send_buffer_bytes: int = Field(
        256 * 1024, ge=0, le=64 * 1024 * 1024, description="kernel send buffer (SO_SNDBUF) of each accepted "
        "connection, bounding what a client that does not read holds in the kernel; 0 = the kernel's autotuning"
    )
    image_decode_queue: int = Field(
        8, ge=0, le=4096, description="image uploads waiting for a decode slot (image_decode_concurrency) per worker; "
        "beyond it a 503 with Retry-After"
    )
    image_decode_budget_s: float = Field(
        2.0, gt=0, le=600, description="the most time one image may take to decode; a decode past it is stopped and "
        "the image refused (422)"
    )
    trusted_hosts: str = Field(
        "", description="comma-separated Host header values accepted ('*' = any; a leading '*.' matches subdomains); "
        "empty = the loopback names (localhost, 127.0.0.1, ::1) when bound to a loopback address, else any"
    )
    metrics_require_key: bool | None = Field(
        None, description="/metrics needs a key, a search or an admin key: the metrics are read-only counts, and a "
        "scraper holding an admin key could also reload the index (least privilege). Default: when search needs one "
        "(require_key_for_search)"
    )

    # signed media URLs: one secret per deployment (every worker and replica must share it)
    media_secret: str = Field(
        "", repr=False, description="secret that signs media URLs (at least 32 characters); every replica needs the "
        "same one. Empty: read media_secret_file, else generated once and kept in <index>/.gare-media-secret"
    )
    media_secret_file: Path | None = Field(None, description="file holding the media URL secret (a docker/k8s secret)")
    media_secret_previous: str = Field(
        "", repr=False, description="the secret before a rotation: tokens it signed stay valid until they expire"
    )
    media_token_ttl_s: int = Field(3600, ge=10, le=7 * 24 * 3600, description="lifetime of a signed media URL")

    # following the index: every worker and replica switches to a new CURRENT by itself
    index_poll_s: float = Field(
        2.0, ge=0, le=3600, description="check the index's CURRENT every this many seconds and switch to a new "
        "version (0 = only on POST /v1/admin/reload or restart)"
    )

    # micro-batching
    batch_max_size: int = Field(32, ge=1, le=4096, description="most queries one micro-batch holds (a worker's, or the shared engine's across workers)")
    batch_max_wait_ms: float = Field(2.0, ge=0, le=1000, description="how long a lone query waits for company")
    batch_queue_size: int = Field(1024, ge=1, description="queries waiting beyond this get 503 (per worker; the shared engine holds this many per worker)")

    # adaptive query bank (opt-in; embeddings only, never query text: see gare_serve/engine/traffic_bank.py)
    query_bank_size: int = Field(0, ge=0, le=10_000_000, description="keep the last N served query embeddings; 0 = off")
    query_bank_path: Path | None = Field(None, description="where the bank is written (float32 .npy); required when the bank is on")
    query_bank_flush_every: int = Field(1000, ge=1, description="write the bank every N queries (and at shutdown)")

    # stage-1 recall watch (gare_serve/engine/recall_watch.py): sampled served queries re-run exactly in the background
    recall_sample_rate: float = Field(
        0.01, ge=0, le=1, description="share of served text queries whose stage-1 recall (recall@K of the exact top-10, "
        "the index's definition) is measured against an exact search in the background; 0 = off"
    )
    recall_cpu_share: float = Field(
        0.05, gt=0, le=1, description="most of one core's time the exact re-runs may take (per worker; paced per chunk)"
    )
    recall_queue_size: int = Field(64, ge=1, description="sampled queries waiting for their re-run; more are dropped (counted)")
    recall_window: int = Field(200, ge=1, description="the rolling mean (gauge, warning) covers the last N evaluated queries")
    recall_warn_min_queries: int = Field(
        50, ge=1, description="no low-recall WARNING before this many evaluated queries on the served version"
    )
    recall_warn_interval_s: float = Field(600.0, ge=0, description="at most one low-recall WARNING per interval")
    recall_alarm_after_s: float = Field(
        3600.0, ge=0, description="the rolling recall mean below the index's target for this long: an ERROR line, "
        "gare_stage1_recall_alarm = 1 and gare_stage1_recall_alarms_total + 1 (docs/retune.md)")

    # query embedding cache (gare_serve/engine/query_cache.py); either bound at 0 turns it off
    query_cache_entries: int = Field(
        10_000, ge=0, le=100_000_000, description="most query embeddings kept (LRU); 0 = cache off"
    )
    query_cache_bytes: int = Field(
        64 * 1024 * 1024, ge=0, description="most bytes the query embedding cache holds (vectors + keys); 0 = cache off"
    )

    # whole search results (gare_serve/engine/result_cache.py): a repeat on the same version skips the queue and every stage
    result_cache_entries: int = Field(
        10_000, ge=0, le=10_000_000, description="most search results kept (LRU); 0 = off (always off while the query bank is on)"
    )
    result_cache_bytes: int = Field(
        64 * 1024 * 1024, ge=0, description="most bytes the result cache holds (~160 per hit + the key); 0 = off"
    )

    # thumbnails
    thumbnail_width: int = Field(320, ge=16, le=1920)
    thumbnail_cache_size: int = Field(1024, ge=0)

    @field_validator("checkpoint", "index", "api_keys_file", "search_keys_file", "admin_keys_file", "library_root",
                     "query_bank_path", "run_dir", "workers", "torch_threads", "media_secret_file",
                     "metrics_require_key", mode="before")
    @classmethod
    def _empty_is_none(cls, v: Any) -> Any:
        return None if v == "" else v

    @field_validator(*KEY_FIELDS)
    @classmethod
    def _hash_keys(cls, v: str) -> str:
        # the clear keys end here: the settings (their dump, the workers' environment built from it) hold hashes
        return hashed_key_list(v)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.default_candidates > self.max_candidates:
            raise ValueError(f"default_candidates={self.default_candidates} exceeds max_candidates={self.max_candidates}")
        return self

    def trusted_host_list(self) -> list[str]:
        """The Host header values accepted; ['*'] = any (see ``trusted_hosts``)."""
        given = [h.strip() for h in self.trusted_hosts.split(",") if h.strip()]
        if given:
            return given
        if self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127."):
            return ["localhost", "127.0.0.1", "::1", "[::1]"]
        return ["*"]

    def metrics_need_key(self) -> bool:
        return self.require_key_for_search if self.metrics_require_key is None else self.metrics_require_key

    def cors_origin_list(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _split_keys(listed: str) -> list[str]:
    return [k.strip() for k in listed.split(",") if k.strip()]


def _key_digest(entry: str) -> str:
    """The sha256 hex digest an entry stands for: ``sha256:<64 hex digits>`` is taken as the hash of a key (so a
    keys file need not hold keys in clear: gare-serve --hash-key), anything else is a key and is hashed here."""
    digest = entry[7:].lower()
    if entry.lower().startswith("sha256:") and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
        return digest
    return hash_key(entry)


def _file_keys(path: Path | None, what: str) -> list[str]:
    if path is None:
        return []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SettingsError(f"cannot read the {what} file {path}: {e.strerror or e}") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


@dataclass(frozen=True)
class KeyRoles:
    """The configured keys by role, as sha256 hex digests (never a key in clear).

    ``admin`` holds the admin keys and the deprecated api keys (an admin key may also search); ``search`` the keys
    that may only search (a key listed under both is an admin key). ``legacy`` counts the keys that came from the deprecated
    ``api_keys`` / ``api_keys_file`` alone, for the start-up WARNING.
    """

    search: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()
    legacy: int = 0

    def for_role(self, role: Literal["search", "admin"]) -> tuple[str, ...]:
        """The digests that may call a route needing ``role``."""
        return self.admin if role == "admin" else self.admin + self.search


def load_key_roles(settings: Settings) -> KeyRoles:
    """Every configured key (env lists and files) as sha256 digests per role, blank entries and ``#`` lines
    ignored; a file that cannot be read is a SettingsError naming it."""
    admin_new = {_key_digest(k) for k in _split_keys(settings.admin_keys)}
    admin_new |= {_key_digest(k) for k in _file_keys(settings.admin_keys_file, "admin keys")}
    legacy = {_key_digest(k) for k in _split_keys(settings.api_keys)}
    legacy |= {_key_digest(k) for k in _file_keys(settings.api_keys_file, "API keys")}
    admin = admin_new | legacy
    search = {_key_digest(k) for k in _split_keys(settings.search_keys)}
    search |= {_key_digest(k) for k in _file_keys(settings.search_keys_file, "search keys")}
    return KeyRoles(search=tuple(sorted(search - admin)), admin=tuple(sorted(admin)), legacy=len(legacy))


def load_api_key_hashes(settings: Settings) -> list[str]:
    """sha256 hex digests of every configured key, any role (see :func:`load_key_roles`)."""
    roles = load_key_roles(settings)
    return sorted(set(roles.admin) | set(roles.search))


def _normalise(path: Path, data: Any) -> dict[str, Any]:
    """The settings of a config file's mapping: keys with or without the GARE_ prefix, any case, '-' or '_';
    unknown keys refused; lists of keys and cors_origins joined as the environment gives them."""
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of settings, not a {type(data).__name__}")
    out: dict[str, Any] = {}
    known = set(Settings.model_fields)
    for key, value in data.items():
        name = str(key).lower().replace("-", "_")
        if name.startswith(ENV_PREFIX.lower()):
            name = name[len(ENV_PREFIX):]
        if name not in known:
            raise SettingsError(f"config file {path}: unknown setting {key!r}; known: {', '.join(sorted(known))}")
        if isinstance(value, list) and name in ("api_keys", "search_keys", "admin_keys", "cors_origins"):
            value = ",".join(str(v) for v in value)
        out[name] = value
    return out


class _Checked:
    """Mixed into pydantic-settings' YAML/JSON sources: this service's errors and key rules on the file read."""

    kind = "YAML"

    def _read_file(self, file_path: Path) -> dict[str, Any]:
        try:
            data = super()._read_file(file_path)  # type: ignore[misc]
        except OSError as e:
            raise SettingsError(f"cannot read config file {file_path}: {e.strerror or e}") from None
        except Exception as e:  # noqa: BLE001 - yaml and json raise many types
            raise SettingsError(f"config file {file_path} is not valid {self.kind}: {e}") from None
        return _normalise(file_path, data)


class _YamlFile(_Checked, YamlConfigSettingsSource):
    kind = "YAML"


class _JsonFile(_Checked, JsonConfigSettingsSource):
    kind = "JSON"


def config_file_source(settings_cls: type[BaseSettings], path: str | os.PathLike) -> PydanticBaseSettingsSource:
    """The settings source of a YAML (or, by its .json suffix, JSON) config file."""
    p = Path(path)
    if not p.is_file():  # pydantic-settings skips a missing file silently; a named one must exist
        raise SettingsError(f"cannot read config file {p}: {'is a directory' if p.is_dir() else 'no such file'}")
    if p.suffix.lower() == ".json":
        return _JsonFile(settings_cls, json_file=p)
    return _YamlFile(settings_cls, yaml_file=p)


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The settings a YAML or JSON config file sets (names with or without the GARE_ prefix, any case)."""
    return config_file_source(Settings, path)()


def load_settings(config_file: str | os.PathLike | None = None, **overrides: Any) -> Settings:
    """Merge defaults < config file < GARE_* environment < overrides (None values are ignored)."""
    config_file = config_file or os.environ.get(f"{ENV_PREFIX}CONFIG") or None
    token = _CONFIG_FILE.set(Path(config_file) if config_file else None)
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        raise SettingsError("invalid settings: " + "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or 'settings'}: {err['msg']}" for err in e.errors()
        )) from None
    finally:
        _CONFIG_FILE.reset(token)
