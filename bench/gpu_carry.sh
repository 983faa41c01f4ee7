#!/usr/bin/env bash
# Here (a CPU machine with PyPI): make what bench/gpu_check.sh needs on a lent GPU machine that has torch and CUDA 13
# but no network and none of faiss-gpu's CUDA 12 libraries:
#   .gpuwheels/   the small pure/CPU wheels the project needs there (open_clip, pydantic, fastapi, decord, ...)
#   .gpuparts/    faiss-gpu 1.15.1 (its wheel's files) and the CUDA 12 runtime and cuBLAS 12 libraries from the
#                 nvidia-cuda-runtime-cu12 / nvidia-cublas-cu12 wheels, xz -9 compressed (one device call fewer than -3) into one tar split into
#                 parts of at most 56 MiB (a device call carries 64 MiB with the working tree)
#
#     bash bench/gpu_carry.sh WORK        # WORK: a scratch folder (about 1.5 GB)
#
# Then send one part per device call (each call copies .gpuparts/* to /tmp/gpuparts there) and run
# `bash bench/gpu_check.sh COMMIT` in the last. faiss-gpu's loader also dlopens libcurand.so.10 (libfaiss.so does
# not link it): gpu_check.sh takes the machine's own (CUDA 13 curand, the same soname).
set -euo pipefail
WORK=${1:?scratch folder}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux2010_x86_64 --platform any)
mkdir -p "$WORK/dl" "$WORK/payload" "$WORK/faisswheel"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/dl" faiss-gpu==1.15.1 nvidia-cuda-runtime-cu12==12.6.77 \
    nvidia-cublas-cu12==12.6.4.1
# av (PyAV, ~36 MB): the tests' synthetic corpora write their mp4s with it (the device has OpenCV but no PyAV).
# the MSR-VTT test captions for the CUDA batch-invariance test (../shared does not travel; gpu_check.sh points
# GARE_MSRVTT_ANNO here). Carry .gpuwheels and .gpuassets (fidelity inputs, bench/gpu_bench.py --prepare) in the
# last call: about 20 + 35 MB beside the ~6 MB tree.
mkdir -p "$REPO/.gpuassets/msrvtt" && cp "$REPO/../shared/data/msrvtt/MSRVTT_JSFUSION_test.csv" "$REPO/.gpuassets/msrvtt/"
rm -rf "$REPO/.gpuwheels" && mkdir -p "$REPO/.gpuwheels"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$REPO/.gpuwheels" open_clip_torch==3.3.0 ftfy==6.3.1 \
    wcwidth==0.9.4 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    pydantic-settings==2.16.3 python-dotenv==1.2.4 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
    itsdangerous==2.2.0 cachetools==8.0.2 python-multipart==0.0.34 fastapi_offline==1.7.7 decord==0.6.0 \
    typing_extensions==4.16.0 opentelemetry-api==1.45.2 av==18.1.0
# each large file compressed on its own (a re-run reuses what is already compressed)
(cd "$WORK/faisswheel" && unzip -q -o "$WORK"/dl/faiss_gpu-1.15.1-*.whl)
[ -f "$WORK/payload/faiss_gpu_tree.tar.xz" ] || tar -C "$WORK/faisswheel" -cf - . | xz -9 -T0 > "$WORK/payload/faiss_gpu_tree.tar.xz"
unzip -q -o -j "$WORK"/dl/nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12' -d "$WORK/payload"
for lib in libcublas.so.12 libcublasLt.so.12; do
    [ -f "$WORK/payload/$lib.xz" ] || unzip -p "$WORK"/dl/nvidia_cublas_cu12-*.whl "nvidia/cublas/lib/$lib" | xz -9 -T0 > "$WORK/payload/$lib.xz"
done
(cd "$WORK/payload" && sha256sum faiss_gpu_tree.tar.xz libcublas.so.12.xz libcublasLt.so.12.xz libcudart.so.12 > SHA256SUMS)
rm -rf "$REPO/.gpuparts" "$WORK/parts" && mkdir -p "$WORK/parts"
tar -C "$WORK/payload" -cf - SHA256SUMS libcudart.so.12 libcublas.so.12.xz faiss_gpu_tree.tar.xz libcublasLt.so.12.xz \
    | split -b 56M -d -a 2 - "$WORK/parts/payload.tar.part"
# the device has Python 3.12 and the packages listed in /work/.library/device/KINDS.md; check here that the
# carried wheels' own requirements are met by them plus each other (a missing one -- opentelemetry-api, pulled in
# by fastapi 0.165 -- cost a GPU run once)
python3 - "$REPO/.gpuwheels" <<'PY'
import re, sys, zipfile, pathlib
have = {"numpy", "torch", "torchvision", "anyio", "annotated-doc", "h11", "click", "huggingface-hub", "regex", "tqdm",
        "timm", "safetensors", "packaging", "pillow", "httpx", "pyyaml", "prometheus-client", "numba", "sniffio",
        "idna", "matplotlib", "zipp"}
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wheels = list(pathlib.Path(sys.argv[1]).glob("*.whl"))
names = {norm(w.name.split("-")[0]) for w in wheels}
missing = set()
for w in wheels:
    meta = next(n for n in zipfile.ZipFile(w).namelist() if n.endswith(".dist-info/METADATA"))
    for line in zipfile.ZipFile(w).read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line and "python_version < " not in line:
            dep = norm(re.split(r"[ ;<>=!~\[(]", line.split(":", 1)[1].strip())[0])
            if dep not in names and dep not in have:
                missing.add(f"{dep} (for {w.name})")
if missing:
    sys.exit("missing wheels: " + ", ".join(sorted(missing)))
print("every requirement of the carried wheels is carried or on the device")
PY
ls -la "$WORK/parts" "$REPO/.gpuwheels"
