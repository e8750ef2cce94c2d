#!/usr/bin/env bash
# A small llama.cpp source tarball for a machine without network: enough to build llama-bench and llama-quantize
# with the CUDA (and CPU) backend, cut from the llama.cpp tree that the llama-cpp-python sdist vendors.
#
#     benchmarks/llamacpp_source.sh [OUT.tar.gz] [SDIST]
#
# OUT defaults to .cache/llamacpp/llama.cpp-<commit>.tar.gz (git-ignored); SDIST to
# /tmp/llsrc/llama_cpp_python-0.3.36.tar.gz. The tarball's root is the llama.cpp tree itself. Kept: the top
# CMakeLists.txt, cmake/, include/, src/, common/, ggml/ with only its CPU, CUDA and BLAS backends, the vendored
# header libraries that common/ links (nlohmann, sheredom, cpp-httplib, hash), tools/llama-bench,
# tools/quantize, and gguf-py (the pure-Python `gguf` package of the same commit: benchmarks/gpu_llamacpp.py writes
# its GGUF files with it, and the GPU machine's Python has no `gguf`). Dropped: models, docs, media, tests, gguf-py's
# tests and scripts, examples, the web UI, server, mtmd, miniaudio, stb and every other ggml backend (ggml-hip holds
# only a CMakeLists.txt that compiles ggml-cuda's sources for ROCm; the CUDA build needs nothing of it or of MUSA).
# Patched: tools/CMakeLists.txt and vendor/CMakeLists.txt add only what is kept, and cmake/build-info.cmake
# records the commit from llama-cpp-python's CHANGELOG (the tree is not a git checkout; without the patch a tree
# unpacked inside another git repository would report that repository's commit).
#
# Build on the GPU machine with benchmarks/llamacpp_build.sh (carry .cache/llamacpp), which runs these lines (H100;
# nothing here fetches from the network: no OpenSSL, no NCCL, no CCCL fetch, no KleidiAI, no OpenMP download):
#
#     mkdir -p /tmp/llama.cpp && tar xzf llama.cpp-*.tar.gz -C /tmp/llama.cpp && cd /tmp/llama.cpp
#     cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
#         -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
#         -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON
#     cmake --build build -j16 --target llama-bench llama-quantize      # binaries in build/bin
#
# The CPU-only build that checks the tarball (as on the 2-core machine that makes it):
#
#     cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \
#         -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
#     nice -n 19 cmake --build build -j2 --target llama-bench llama-quantize
#
# LLAMA_CURL is gone from this llama.cpp (it warns that the option is ignored); downloads now go through
# cpp-httplib, which LLAMA_OPENSSL=OFF leaves without HTTPS.
set -euo pipefail

SDIST=${2:-/tmp/llsrc/llama_cpp_python-0.3.36.tar.gz}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

TOP=$(basename "$SDIST" .tar.gz)  # llama_cpp_python-X.Y.Z, the sdist's top folder
COMMIT=$(tar xzf "$SDIST" -O "$TOP/CHANGELOG.md" | grep -o 'ggml-org/llama.cpp@[0-9a-f]*' | head -1 | cut -d@ -f2 \
    || true)  # the newest "update llama.cpp to ggml-org/llama.cpp@..." entry
OUT=${1:-$ROOT/.cache/llamacpp/llama.cpp-${COMMIT:-unknown}.tar.gz}

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
SRC=$TOP/vendor/llama.cpp
KEEP=(CMakeLists.txt LICENSE cmake include src common ggml vendor tools/CMakeLists.txt tools/llama-bench
      tools/quantize gguf-py/gguf gguf-py/LICENSE gguf-py/pyproject.toml)
tar xzf "$SDIST" -C "$WORK" --strip-components=3 "${KEEP[@]/#/$SRC/}"

cd "$WORK"
for dir in ggml/src/ggml-*/; do
    case $(basename "$dir") in
        ggml-cpu | ggml-cuda | ggml-blas) ;;
        *) rm -rf "$dir" ;;
    esac
done
rm -rf vendor/miniaudio vendor/stb gguf-py/gguf/scripts

cat > tools/CMakeLists.txt <<'EOF'
# kiln's trimmed tree: only the two tools its GPU benchmarks run (llama-bench, llama-quantize)
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
add_subdirectory(quantize)
EOF
cat > vendor/CMakeLists.txt <<'EOF'
# kiln's trimmed tree: the vendored libraries that common/ and the kept tools use
add_subdirectory(hash)
add_subdirectory(nlohmann)
add_subdirectory(sheredom)
if (LLAMA_BUILD_COMMON)
    add_subdirectory(cpp-httplib)
endif()
EOF
cat >> cmake/build-info.cmake <<EOF

# kiln's trimmed tree is not a git checkout: the commit is llama-cpp-python's (${TOP}) vendored llama.cpp
set(BUILD_COMMIT "${COMMIT:-unknown}")
set(BUILD_NUMBER 0)
EOF
printf 'llama.cpp %s from %s (vendor/llama.cpp), trimmed by kiln benchmarks/llamacpp_source.sh\n' \
    "${COMMIT:-unknown}" "$TOP" > KILN_SOURCE.txt

mkdir -p "$(dirname "$OUT")"
tar czf "$OUT" --owner=0 --group=0 --sort=name .
echo "$OUT $(du -h "$OUT" | cut -f1) llama.cpp ${COMMIT:-unknown}"
