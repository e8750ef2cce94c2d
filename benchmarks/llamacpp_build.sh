#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-quantize with CUDA (sm_90) on the GPU machine, offline.
#
#     benchmarks/llamacpp_build.sh [TARBALL]        # run from the repository root (carry .cache/llamacpp)
#
# TARBALL defaults to the newest .cache/llamacpp/llama.cpp-*.tar.gz (made by benchmarks/llamacpp_source.sh from the
# llama-cpp-python 0.3.36 sdist: llama.cpp 0c1e57098, trimmed to CPU/CUDA/BLAS backends + llama-bench + quantize).
# It is unpacked into /tmp/llama.cpp and built in /tmp/llama.cpp/build; the binaries land in
# /tmp/llama.cpp/build/bin, which is what benchmarks/gpu_llamacpp.py takes as --bin (it finds gguf-py in
# /tmp/llama.cpp). Skips everything when /tmp/llama.cpp/build/bin/llama-bench already exists.
#
# -DLLAMA_BUILD_APP=OFF is required: the trimmed tree has no app/ (and the app needs the server).
# LLAMA_CURL is deprecated in this llama.cpp (a warning only); LLAMA_OPENSSL=OFF and GGML_CUDA_NCCL=OFF keep the
# configure free of optional system libraries; nothing in this configuration fetches from the network.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARBALL=${1:-$(ls -t "$ROOT"/.cache/llamacpp/llama.cpp-*.tar.gz 2>/dev/null | head -1)}
DEST=/tmp/llama.cpp
BUILD=$DEST/build
BIN=$BUILD/bin
JOBS=${JOBS:-16}

if [[ -x $BIN/llama-bench && -x $BIN/llama-quantize ]]; then
    echo "llamacpp_build: $BIN/llama-bench already exists; skipping the build"
    exit 0
fi

# nvcc on PATH (CMake's CUDA language needs it or CUDACXX)
if ! command -v nvcc >/dev/null 2>&1 && [[ -z ${CUDACXX:-} ]]; then
    for d in /usr/local/cuda/bin /usr/local/cuda-13*/bin /usr/local/cuda-12*/bin; do
        if [[ -x $d/nvcc ]]; then export PATH="$d:$PATH"; break; fi
    done
fi
echo "llamacpp_build: nvcc $(command -v nvcc || echo "${CUDACXX:-not found}")"

start=$(date +%s)

if [[ ! -f $DEST/CMakeLists.txt ]]; then
    [[ -n $TARBALL && -f $TARBALL ]] || {
        echo "llamacpp_build: no tarball (${TARBALL:-none in .cache/llamacpp}): make one with benchmarks/llamacpp_source.sh" >&2
        exit 1
    }
    unpack=$(mktemp -d /tmp/llama.cpp.unpack.XXXXXX)
    tar xzf "$TARBALL" -C "$unpack"
    # the tarball's root is either the llama.cpp tree itself or a single llama.cpp/ folder
    if [[ -f $unpack/CMakeLists.txt ]]; then
        src=$unpack
    else
        src=$(dirname "$(ls -d "$unpack"/*/CMakeLists.txt | head -1)")
    fi
    rm -rf "$DEST"
    mv "$src" "$DEST"
    rm -rf "$unpack"
    echo "llamacpp_build: unpacked $TARBALL into $DEST"
fi
[[ -f $DEST/KILN_SOURCE.txt ]] && cat "$DEST/KILN_SOURCE.txt"

FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DGGML_CUDA=ON
    -DCMAKE_CUDA_ARCHITECTURES=90
    -DLLAMA_CURL=OFF
    -DGGML_CUDA_NCCL=OFF
    -DGGML_NATIVE=ON
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_TOOLS=ON
)
echo "llamacpp_build: cmake -S $DEST -B $BUILD ${FLAGS[*]}"
cmake -S "$DEST" -B "$BUILD" "${FLAGS[@]}"
configured=$(date +%s)
echo "llamacpp_build: configure took $((configured - start)) s"

cmake --build "$BUILD" -j"$JOBS" --target llama-bench llama-quantize
end=$(date +%s)

ls -la "$BIN/llama-bench" "$BIN/llama-quantize"
echo "llamacpp_build: build took $((end - configured)) s; total $((end - start)) s; binaries in $BIN"
