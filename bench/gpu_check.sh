#!/usr/bin/env bash
# The GPU checks, for a lent GPU machine (the `device` tool): it has torch and CUDA 13 but none of our other packages,
# no CUDA 12 libraries and no network. Prepare here with `bash bench/gpu_carry.sh WORK` (the small wheels into
# .gpuwheels, faiss-gpu 1.15.1 with the CUDA 12 runtime and cuBLAS 12 as parts); send the parts over earlier calls
# into /tmp/gpuparts there (GPU_PARTS), then, in the repository root there:
#
#     bash bench/gpu_check.sh COMMIT [bench/gpu_bench.py options]
#
# 1. installs the wheels and faiss-gpu (the wheel's files, as `pip install --target` lays them out) into /tmp/site,
#    with libcudart.so.12 / libcublas(Lt).so.12 where faiss's loader looks for them (nvidia/<name>/lib) and
#    libcurand.so.10, which that loader also opens (libfaiss.so does not link it), from the machine's CUDA 13 curand;
# 2. runs every `gpu`-marked test (CUDA: the fold, build-time constants, the served scorer, the text towers, a
#    training step, Sinkhorn, the build's encode loop; FAISS GPU: flat, IVF-Flat with an HNSW coarse quantiser, the
#    nprobe limit, add/remove, save/load, the tuner's choices, the GPU-assisted IVF build, each against the CPU index),
#    with a junit XML;
# 3. runs bench/gpu_bench.py, every section in one process on this device (the tests' outcome is its gpu_tests
#    section), under a deadline: the whole script ends within GPU_CHECK_SECONDS (default 480 = 8 minutes; a device
#    call allows 600). A section expected to end past the deadline is not run and the report says so; the report
#    (JSON + Markdown with the targets, met / not met) is rewritten after every section into $OUT (default
#    /tmp/gpu-check): bench/results/gpu_bench.{json,md} are copied from there.
# Exit status: the tests'. The logs say what failed; a failed install is reported with its error, the rest still runs.
#
# Expected seconds on an H100/H200 (bench/gpu_bench.py SECTION_SECONDS, from the runs at 5215253 and 251db38): install
# ~20, tests ~80, env 1, index_build 45, http_search 110, faiss_stage1 60 (1M; --stage1-entries 1000000 10000000 adds
# ~130), text_encoder 25, search 26, fidelity 6 (its inputs: .gpuassets from --prepare; without them it is listed as not run), psi 4, sinkhorn 14, served_biases 2: ~400 s.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
SITE=${GPU_SITE:-/tmp/site}
PARTS=${GPU_PARTS:-/tmp/gpuparts}
mkdir -p "$OUT" "$SITE"
unxz_to() {  # unxz_to SRC DEST: xz if the machine has it, else Python's lzma
    if command -v xz >/dev/null; then xz -T0 -dc "$1" > "$2"; else
        python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'), 1 << 24)" "$1" "$2"; fi
}
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpuwheels/*.whl \
    || { echo "could not install the carried wheels"; exit 2; }
if ls "$PARTS"/payload.tar.part* >/dev/null 2>&1; then
    rm -rf /tmp/payload && mkdir -p /tmp/payload
    cat "$PARTS"/payload.tar.part* | tar -C /tmp/payload -xf - && (cd /tmp/payload && sha256sum -c --quiet SHA256SUMS) \
        || echo "FAISS-GPU INSTALL: the carried parts are incomplete or corrupt ($(ls "$PARTS" | tr '\n' ' '))"
    mkdir -p "$SITE/nvidia/cuda_runtime/lib" "$SITE/nvidia/cublas/lib" "$SITE/nvidia/curand/lib"
    # our nvidia/ is a regular package first on the path; extend_path adds the machine's nvidia/ (cu13, cudnn, ...)
    printf 'from pkgutil import extend_path\n\n__path__ = extend_path(__path__, __name__)\n' > "$SITE/nvidia/__init__.py"
    touch "$SITE/nvidia/cuda_runtime/__init__.py" "$SITE/nvidia/cublas/__init__.py" "$SITE/nvidia/curand/__init__.py"
    cp /tmp/payload/libcudart.so.12 "$SITE/nvidia/cuda_runtime/lib/"
    unxz_to /tmp/payload/libcublas.so.12.xz "$SITE/nvidia/cublas/lib/libcublas.so.12" & p1=$!
    unxz_to /tmp/payload/libcublasLt.so.12.xz "$SITE/nvidia/cublas/lib/libcublasLt.so.12" & p2=$!
    unxz_to /tmp/payload/faiss_gpu_tree.tar.xz /tmp/payload/faiss_gpu_tree.tar & p3=$!
    wait $p1 $p2 $p3 || echo "FAISS-GPU INSTALL: decompressing the payload failed"
    rm -rf "$SITE/faiss" && tar -C "$SITE" -xf /tmp/payload/faiss_gpu_tree.tar
    curand=$(python3 -c "
import glob, sys
hits = [h for p in sys.path for h in glob.glob(p + '/nvidia/*/lib/libcurand.so.10')]
print(hits[0] if hits else '')")
    if [ -n "$curand" ]; then ln -sf "$curand" "$SITE/nvidia/curand/lib/libcurand.so.10"; echo "libcurand.so.10: $curand"
    else  # libfaiss.so does not link curand; an empty library satisfies the loader's dlopen, and the log says so
        echo "FAISS-GPU INSTALL: no libcurand.so.10 on this machine: an empty stand-in is used"
        echo "" > /tmp/empty.c && gcc -shared -fPIC -o "$SITE/nvidia/curand/lib/libcurand.so.10" /tmp/empty.c; fi
else
    echo "FAISS-GPU INSTALL: no parts under $PARTS: faiss is not installed; the FAISS sections fail and say so"
fi
export PYTHONPATH=$SITE:$PWD/training:$PWD/indexer:$PWD/service:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 GARE_COMMIT=${1:-unknown}
# the MSR-VTT captions gpu_carry.sh copied (the batch-invariance tests skip without them: the 15:51 run at 5215253)
[ -f .gpuassets/msrvtt/MSRVTT_JSFUSION_test.csv ] && export GARE_MSRVTT_ANNO=$PWD/.gpuassets/msrvtt
echo "install: $(( $(date +%s) - t0 )) s"
python3 -c "import faiss; print('faiss', faiss.__version__, 'GPUs seen by faiss:', faiss.get_num_gpus())" 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
budget=${GPU_CHECK_SECONDS:-480}
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$OUT/pytest_gpu.xml" tests/test_cuda.py \
    tests/training/test_sinkhorn.py tests/training/test_text_determinism.py tests/indexer/test_ann_gpu_plan.py \
    tests/indexer/test_build_stages.py tests/indexer/test_resident_gpu.py tests/service/test_serve_engine_gpu.py \
    2>&1 | tee "$OUT/pytest_gpu.log"
tests=${PIPESTATUS[0]}
echo "tests: exit status $tests; $(( $(date +%s) - t0 )) s"
left=$(( budget - 5 - ($(date +%s) - t0) ))
[ "$left" -lt 60 ] && left=60  # the install or the tests overran: the env and the cheapest sections still run
# the bench plans its sections to end by --deadline-s; timeout is the backstop (a hung section: the report written
# after the last finished section stays, the one in flight says it did not finish)
timeout --kill-after=10 "$left" python3 -m bench.gpu_bench --out "$OUT/gpu_bench" --deadline-s "$(( left - 10 ))" \
    --gpu-tests-junit "$OUT/pytest_gpu.xml" --gpu-tests-status "$tests" --wrapper "bash bench/gpu_check.sh $*" "${@:2}" \
    2>&1 | tee "$OUT/gpu_bench.log"
echo "bench exit status ${PIPESTATUS[0]}; GPU tests exit status: $tests; total $(( $(date +%s) - t0 )) s"
exit "$tests"
