#!/usr/bin/env bash
# Side-by-side benchmark (issue 39): tailrace against llama.cpp's llama-server on the same GGUF,
# with the same client (`tailrace bench serve`), in one run.
#
#   scripts/bench_vs_llamacpp.sh build      # build llama.cpp once (cached), nothing else
#   scripts/bench_vs_llamacpp.sh [run]      # build if needed, then 1 stream and 32 streams, both servers
#
# llama.cpp is built from the llama-cpp-python sdist on PyPI (its vendored llama.cpp), with
# -DGGML_NATIVE=OFF and the ISA flags read from /proc/cpuinfo (a native build can die with an
# illegal instruction on some of these VMs; AMX stays off for the same reason).
# Environment: PYTHON, GGUF (default: the bundled SmolLM2 Q4_1), CACHE (build cache),
# TAILRACE_ARGS (extra flags for `tailrace serve`), N_IN/N_OUT (default 128/128), PROMPTS_1/PROMPTS_32.
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-/work/main/.venv/bin/python}"
CACHE="${CACHE:-$HOME/.cache/tailrace/llamacpp}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
flags="$(grep -m1 '^flags' /proc/cpuinfo)"
has() { [[ " $flags " == *" $1 "* ]]; }
cmake_isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
           -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
isa=avx2
if has avx512f && has avx512bw && has avx512vl; then
  isa=avx512; cmake_isa+=(-DGGML_AVX512=ON)
  has avx512_vnni && { cmake_isa+=(-DGGML_AVX512_VNNI=ON); isa+=-vnni; }
  has avx512_bf16 && { cmake_isa+=(-DGGML_AVX512_BF16=ON); isa+=-bf16; }
  has avx512vbmi && cmake_isa+=(-DGGML_AVX512_VBMI=ON)
elif has avx_vnni; then
  cmake_isa+=(-DGGML_AVX_VNNI=ON); isa+=-vnni
fi
BUILD="$CACHE/$VERSION-$isa"
BIN="$BUILD/build/bin"

build() {
  if [[ -x "$BIN/llama-server" && -x "$BIN/llama-bench" ]]; then return 0; fi
  mkdir -p "$BUILD"
  local sdist
  sdist="$(ls "$CACHE"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
  if [[ -z "$sdist" ]]; then
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$CACHE" "llama-cpp-python==$VERSION"
    sdist="$CACHE/llama_cpp_python-$VERSION.tar.gz"
  fi
  [[ -d "$BUILD/src" ]] || { mkdir -p "$BUILD/src"; tar -xzf "$sdist" -C "$BUILD/src" --strip-components=1; }
  echo "building llama.cpp ($isa) in $BUILD" >&2
  nice -n 19 cmake -S "$BUILD/src/vendor/llama.cpp" -B "$BUILD/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    "${cmake_isa[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF >&2
  nice -n 19 cmake --build "$BUILD/build" -j "${JOBS:-2}" --target llama-server llama-bench >&2
}

cmd="${1:-run}"
build
[[ "$cmd" == build ]] && { echo "$BIN"; exit 0; }
