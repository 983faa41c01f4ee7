#!/usr/bin/env bash
# The GPU checks, for a lent GPU machine (the `device` tool; it has torch and CUDA but none of our other
# packages and no network). Carry .gpuwheels (faiss-cpu, open_clip_torch, ftfy, wcwidth, pydantic and its
# parts, as wheels) and .gpuassets (`python bench/gpu_bench.py --prepare .gpuassets ...`), then:
#
#     bash bench/gpu_check.sh COMMIT
#
# It runs the CUDA tests (tests/test_cuda.py and the CUDA Sinkhorn test) and bench/gpu_bench.py, and leaves
# their logs and bench/results-style JSON/Markdown in $OUT (default /tmp/gpu-check). Exit status: the tests'.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpuwheels/*.whl \
    || { echo "could not install the carried wheels"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 GARE_COMMIT=${1:-unknown}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/training/test_sinkhorn.py::test_cuda_matches_cpu \
    tests/indexer/test_ann_gpu_plan.py \
    2>&1 | tee "$OUT/pytest_cuda.log"
tests=${PIPESTATUS[0]}
python3 bench/gpu_bench.py --out "$OUT/gpu_bench" "${@:2}" 2>&1 | tee "$OUT/gpu_bench.log"
echo "CUDA tests exit status: $tests"
exit "$tests"
