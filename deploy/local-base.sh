#!/usr/bin/env bash
# Base images made from Debian packages, for machines that reach the Debian archive and PyPI but no container
# registry (the upstream bases python:3.11-slim-bookworm and nginx:1.29-alpine cannot be pulled there):
#   localhost/gare-local/python:3.11-bookworm  Debian bookworm's Python 3.11 in a venv on PATH (python, pip)
#   localhost/gare-local/nginx:sid             Debian sid's nginx (>= 1.27.3, which `server ... resolve` needs), wget
# Used by bench/compose_e2e.py through the BASE_IMAGE / NGINX_IMAGE build arguments of deploy/Dockerfile.cpu
# and deploy/Dockerfile.proxy; users with a registry keep the upstream defaults. Root, podman and debootstrap.
#   bash deploy/local-base.sh [--rebuild]      (an existing image is kept unless --rebuild)
set -euo pipefail
WORK="${GARE_BASE_WORK:-/var/tmp/gare-local-base}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PODMAN=(podman)
REBUILD=0
[ "${1:-}" = --rebuild ] && REBUILD=1
mkdir -p "$WORK"

make_base() {  # name suite packages change...
  local name=$1 suite=$2 pkgs=$3; shift 3
  if [ $REBUILD = 0 ] && "${PODMAN[@]}" image exists "$name"; then
    echo "base image $name: kept ($("${PODMAN[@]}" image inspect -f '{{.Created}}' "$name"))"
    return
  fi
  local root="$WORK/rootfs-${suite}-$$"
  echo "base image $name: debootstrap $suite with $pkgs (a few minutes)"
  rm -rf "$root"
  debootstrap --variant=minbase --include="$pkgs" "$suite" "$root" "$MIRROR" > "$WORK/debootstrap-$suite.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap-$suite.log" >&2; exit 1; }
  if [ -n "${SETUP:-}" ]; then chroot "$root" sh -c "$SETUP"; fi
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
  local changes=()
  for c in "$@"; do changes+=(--change "$c"); done
  tar -C "$root" -c . | "${PODMAN[@]}" import "${changes[@]}" - "$name" > /dev/null
  rm -rf "$root"
  echo "base image $name: $("${PODMAN[@]}" image inspect -f '{{.Id}} {{.Size}} bytes' "$name")"
}

# python:3.11-slim-bookworm's shape: python and pip on PATH (a venv: Debian's own python3 is externally managed)
SETUP="python3 -m venv /opt/python && /opt/python/bin/python -V" \
  make_base localhost/gare-local/python:3.11-bookworm bookworm python3,python3-venv,ca-certificates \
  "ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  "ENV LANG=C.UTF-8" 'CMD ["python3"]'
SETUP="nginx -v" \
  make_base localhost/gare-local/nginx:sid sid nginx,wget \
  "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" 'CMD ["nginx", "-g", "daemon off;"]'
