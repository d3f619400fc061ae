#!/usr/bin/env bash
# Builds a Debian base image with Python for docker/Dockerfile (BASE_IMAGE) without any image registry:
# debootstrap from the Debian mirror the host already uses, the host's extra CA certificates added (so
# that pip inside `docker build` trusts the same TLS proxies the host trusts), then `docker import`.
#
#   scripts/build_base_image.sh [IMAGE]          # default IMAGE: collsvc-base:bookworm
#   DOCKER_BUILDKIT=0 docker build -f docker/Dockerfile --build-arg BASE_IMAGE=collsvc-base:bookworm \
#       -t collsvc:0.1.0 .
#
# Needs root, debootstrap and a running Docker engine (DOCKER_HOST is honoured). The root file system is
# cached as a tarball in $COLLSVC_CONTAINER_CACHE (default ~/.cache/collsvc-containers), keyed by the
# suite, the package list and the CA certificates, so a second run only imports it (seconds). An image
# that already exists with the same key (label org.collsvc.base-key) is kept as it is.
set -euo pipefail

IMAGE="${1:-collsvc-base:bookworm}"
SUITE="${BASE_SUITE:-bookworm}"
PACKAGES="python3,python3-venv,python-is-python3,ca-certificates"
CACHE="${COLLSVC_CONTAINER_CACHE:-$HOME/.cache/collsvc-containers}"

mirror() {
    # The first Debian mirror URI the host's apt sources name (deb822 or one-line format).
    local uri
    uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)
    if [[ -z "$uri" ]]; then
        uri=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}' \
            | grep -v security | head -n1 || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

host_cas() {
    find /usr/local/share/ca-certificates -name '*.crt' -type f 2>/dev/null | sort
}

key=$( { echo "$SUITE $PACKAGES"; host_cas | xargs -r cat; } | sha256sum | cut -c1-16)
if [[ "$(docker image inspect -f '{{index .Config.Labels "org.collsvc.base-key"}}' "$IMAGE" 2>/dev/null)" == "$key" ]]; then
    echo "base image $IMAGE is up to date ($key)"
    exit 0
fi

mkdir -p "$CACHE"
tarball="$CACHE/rootfs-$SUITE-$key.tar"
if [[ ! -s "$tarball" ]]; then
    rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$rootfs"' EXIT
    echo "debootstrap $SUITE from $(mirror) (about a minute)"
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$(mirror)" >"$CACHE/debootstrap.log" 2>&1 \
        || { tail -n 20 "$CACHE/debootstrap.log" >&2; exit 1; }
    host_cas | while read -r crt; do cp "$crt" "$rootfs/usr/local/share/ca-certificates/"; done
    chroot "$rootfs" update-ca-certificates >/dev/null 2>&1 || { echo "update-ca-certificates failed in $rootfs" >&2; exit 1; }
    # Smaller image: no apt lists or caches, no documentation.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
    tar -C "$rootfs" --numeric-owner -cf "$tarball.partial" .
    mv "$tarball.partial" "$tarball"
fi
docker import \
    --change "LABEL org.collsvc.base-key=$key" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    "$tarball" "$IMAGE" >/dev/null
echo "base image $IMAGE imported from $tarball"
