#!/usr/bin/env bash
# Everything that needs a GPU, in one run: the GPU tests and the GPU benchmarks, each one's output in
# OUTPUT_DIR (default: gpu-results). Needs python3 with torch (CUDA), CuPy and NCCL, and collsvc's own
# dependencies (pip install -e '.[cuda12,torch,test]' or '.[cuda13,torch,test]').
#
# Usage: scripts/gpu_checks.sh [OUTPUT_DIR]        (PYTHON=... picks the interpreter; default python3)
# Exit status: pytest's. Without a GPU every check says it was skipped (tests/smoke runs it so).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}

"$py" - <<'EOF' 2>&1 | tee "$out/environment.txt"
import importlib, platform
print("python", platform.python_version())
for name in ("numpy", "torch", "cupy", "grpc", "google.protobuf"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:
        print(name, "MISSING", exc)
try:
    import torch
    count = torch.cuda.device_count()
    print("cuda", torch.version.cuda, "devices", count, torch.cuda.get_device_name(0) if count else "")
    from cupy.cuda import nccl
    print("nccl", nccl.get_version())
except Exception as exc:
    print("no GPU stack:", type(exc).__name__, exc)
EOF

"$py" -m pytest tests/gpu -q -rfEs -p no:cacheprovider --timeout 300 2>&1 | tee "$out/pytest.txt"
status=${PIPESTATUS[0]}

timeout 120 "$py" benchmarks/nccl_overhead.py --sizes 4K,1M,16M,256M --iters 50 2>&1 | tee "$out/nccl_overhead.txt"
timeout 120 "$py" benchmarks/torch_cuda.py --sizes 4K,64K,1M,16M,256M --iters 50 2>&1 | tee "$out/torch_cuda.txt"
timeout 120 "$py" -m collsvc bench -n 1 --device cuda --backend nccl --op all_reduce --sizes 4K:256M \
    2>&1 | tee "$out/bench_nccl.txt"
timeout 120 "$py" -m collsvc bench -n 2 --device cuda --backend ring --op all_reduce --sizes 4K:16M \
    2>&1 | tee "$out/bench_ring_cuda.txt"
# The same ring with host arrays on this machine: what the CuPy run above adds is the host staging.
timeout 120 "$py" -m collsvc bench -n 2 --device cpu --op all_reduce --sizes 4K:16M \
    2>&1 | tee "$out/bench_ring_cpu.txt"
exit "$status"
