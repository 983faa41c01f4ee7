#!/bin/sh
# The proxy container's entrypoint: point nginx's resolver at this container's DNS server (the first
# nameserver of /etc/resolv.conf: 127.0.0.11 under Docker, the network's aardvark-dns address under podman;
# GARE_PROXY_RESOLVER overrides it), then run nginx in the foreground. GARE_RESOLV_CONF and GARE_RESOLVER_OUT
# exist for the offline test (tests/service/test_deploy.py); nginx.conf includes /tmp/gare-resolver.conf.
set -eu
out="${GARE_RESOLVER_OUT:-/tmp/gare-resolver.conf}"
ns="${GARE_PROXY_RESOLVER:-$(awk '$1 == "nameserver" { print $2; exit }' "${GARE_RESOLV_CONF:-/etc/resolv.conf}")}"
if [ -z "$ns" ]; then
    echo "proxy-entrypoint: no nameserver in /etc/resolv.conf (set GARE_PROXY_RESOLVER)" >&2
    exit 1
fi
case "$ns" in *:*) ns="[$ns]" ;; esac  # an IPv6 address goes in brackets
echo "resolver $ns valid=5s ipv6=off;" > "$out"
echo "proxy-entrypoint: resolver $ns" >&2
exec nginx -e stderr -g 'daemon off;' "$@"
