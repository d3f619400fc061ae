#!/usr/bin/env bash
# Installs a Docker engine, the compose v2 plugin, iptables and debootstrap on Debian (as root), when
# they are missing. Idempotent and quiet: prints one line per thing it installs.
#
#   scripts/install_docker.sh
#
# Debian 12 (bookworm) packages only compose v1; compose v2 comes from Debian 13's docker-compose
# package (2.26), which installs on bookworm. It is downloaded through a private apt source list under
# $COLLSVC_CONTAINER_CACHE (default ~/.cache/collsvc-containers): the system's apt sources stay as
# they are. The engine is not started: run `dockerd` (or let the container tests start it).
set -euo pipefail

CACHE="${COLLSVC_CONTAINER_CACHE:-$HOME/.cache/collsvc-containers}"
export DEBIAN_FRONTEND=noninteractive

if [[ $(id -u) -ne 0 ]]; then
    echo "install_docker.sh: needs root (apt-get)" >&2
    exit 1
fi

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v iptables >/dev/null || missing+=(iptables)
command -v debootstrap >/dev/null || missing+=(debootstrap)
mkdir -p "$CACHE"
log="$CACHE/install.log"
quietly() { "$@" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }; }

if ((${#missing[@]})); then
    echo "installing ${missing[*]}"
    quietly apt-get update -qq
    quietly apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if ! docker compose version >/dev/null 2>&1; then
    echo "installing the docker compose v2 plugin (Debian trixie's docker-compose package)"
    apt_dir="$CACHE/apt-trixie"
    mkdir -p "$apt_dir/sources.list.d" "$apt_dir/lists/partial" "$apt_dir/archives/partial"
    keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)
    printf 'Types: deb\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: %s\n' \
        "${uri:-http://deb.debian.org/debian}" "$keyring" >"$apt_dir/sources.list.d/trixie.sources"
    apt_opts=(-qq -o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d"
        -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache::Archives=$apt_dir/archives"
        -o "APT::Sandbox::User=root")
    quietly apt-get "${apt_opts[@]}" update
    rm -f "$apt_dir"/docker-compose_*.deb
    (cd "$apt_dir" && quietly apt-get "${apt_opts[@]}" download docker-compose)
    quietly dpkg -i "$apt_dir"/docker-compose_*.deb
    docker compose version >/dev/null
fi
