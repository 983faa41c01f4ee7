"""Shared test setup: no network, deterministic threads, the tiny registered model."""

from __future__ import annotations

import os

# A failed hub lookup retries DNS for ~46 s; nothing in the tests may download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.psi_weights import randomize_psi  # noqa: E402


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(condition: object, reason: str) -> None:
    """A test's prerequisite (a browser, root for a tmpfs, a linter binary). Missing: under CI=true the test
    fails with `reason` (CI must run it); elsewhere it is skipped with `reason`."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"prerequisite missing under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


# ------------------------------------------------------------------------------------------ parallel runs
# The README's test command runs on two pytest-xdist processes. Each module is one unit of work, so its
# module-scoped servers start once, on one process; the modules that read the suite's one Ray cluster run
# (a session fixture, tests/serve_ray/one_cluster.py) are one unit, or each process would start its own cluster.
# (xdist's own --dist loadgroup cannot carry this: it renames items through a node attribute pytest 9.2 no longer
# reads, so every test became its own unit.)
RAY_CLUSTER_UNIT = "ray-cluster"
CLUSTER_READERS = frozenset({"tests/serve_ray/test_ray_limits.py", "tests/serve_ray/test_ray_serve.py",
                             "tests/serve_ray/test_sharded_ncl_default.py"})


def _unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return RAY_CLUSTER_UNIT if module in CLUSTER_READERS else module


@pytest.hookimpl(optionalhook=True)  # an xdist hook: only called when xdist runs the tests
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling  # xdist is there when this hook is called (not otherwise)

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ModuleScheduling(config, log)


def pytest_itemcollected(item: pytest.Item) -> None:
    if "ray_cluster" in getattr(item, "fixturenames", ()) and _unit(item.nodeid) != RAY_CLUSTER_UNIT:
        raise pytest.UsageError(f"{item.nodeid} reads the Ray cluster run: add its module to "
                                "CLUSTER_READERS in tests/conftest.py")


# The longest units, longest first (CI's --durations): handed out first, so that no long unit is left for the end
# while the other process has nothing to do. Only an order: a unit missing here runs after them, in file order.
LONG_UNITS = (RAY_CLUSTER_UNIT, "tests/test_walkthrough.py", "tests/robustness/test_robust_faults.py",
              "tests/service/test_serve_shutdown.py", "tests/service/test_serve_engine.py",
              "tests/service/test_page_e2e.py", "tests/service/test_serve_spread.py",
              "tests/service/test_http_limits.py", "tests/test_install.py", "tests/training/test_training.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: within a unit and among the others the file order stays (each process collects the same list,
    # which xdist requires).
    rank = {u: i for i, u in enumerate(LONG_UNITS)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))


@pytest.fixture(scope="session")
def tiny_cfg():
    from gare.config import get_model_config

    return get_model_config("gare-test-tiny")


@pytest.fixture()
def tiny_model(tiny_cfg):
    from gare.model import GARE

    torch.manual_seed(0)
    model = GARE.build(tiny_cfg).eval()
    randomize_psi(model.psi)
    return model


# ------------------------------------------------------------------------------------------ shared corpora
# Session-scoped: generated once per test run and shared by every folder (tests/indexer, tests/robustness).
# Tests copy what they modify (tests.indexer.support.copy_videos); these stay read-only.
@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A tiny GARE checkpoint with non-trivial psi weights and a 256 x 64 text queue."""
    from tests.indexer.support import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny.safetensors")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A folder of small synthetic mp4 files (tests.indexer.support.N_VIDEOS of them)."""
    from tests.indexer.support import make_corpus

    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def service_env(tmp_path_factory):
    """The service tests' corpus (16 captioned mp4 files), checkpoint, index and 1-s segment index
    (tests.service.support.make_service_env); shared by tests/service and tests/indexer, read-only."""
    from tests.service.support import make_service_env

    return make_service_env(tmp_path_factory.mktemp("service"))


@pytest.fixture(scope="session")
def model_and_index(service_env):
    """(model, the opened service index, service_env): the service test index read offline (the reference the
    service and the search functions are compared with); read-only, shared by tests/indexer and tests/service."""
    from gare.checkpoint import load_model
    from gare_index.store import open_index

    model, _ = load_model(service_env["checkpoint"], "cpu")
    version = open_index(service_env["index"])
    yield model, version, service_env
    version.close()
