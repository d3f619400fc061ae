#!/usr/bin/env bash
# Regenerates collsvc/proto/v1 from protos/ with the pinned generator. Usage: scripts/gen_protos.sh [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
want="1.85.1"
have=$(python -c 'import grpc_tools, importlib.metadata as m; print(m.version("grpcio-tools"))' 2>/dev/null || true)
if [ "$have" != "$want" ]; then
  echo "gen_protos: need grpcio-tools==$want (have '${have:-none}'): pip install grpcio-tools==$want" >&2
  exit 2
fi
mkdir -p "$out/collsvc/proto/v1"
python -m grpc_tools.protoc -Iprotos --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  protos/collsvc/proto/v1/*.proto
