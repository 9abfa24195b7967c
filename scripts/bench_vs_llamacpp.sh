#!/usr/bin/env bash
# Side-by-side benchmark (issue 39): tailrace against llama.cpp's llama-server on the same GGUF,
# with the same client (`tailrace bench serve`), in one run.
#
#   scripts/bench_vs_llamacpp.sh build      # build llama.cpp once (cached), nothing else
#   scripts/bench_vs_llamacpp.sh [run]      # build if needed, then 1 stream and 32 streams, both servers
#   scripts/bench_vs_llamacpp.sh lib        # no build: tailrace at 1 stream, then llama.cpp's own decode
#                                           # loop from its prebuilt wheel (scripts/bench_llamacpp_lib.py),
#                                           # ROUNDS times alternating; LIB_32=1: then 32 streams too
#                                           # (tailrace at c=32 against the same loop's --parallel 32;
#                                           # ONLY_32=1: those alone); each side's CPU ms per token too
#
# llama.cpp is built from the llama-cpp-python sdist on PyPI (its vendored llama.cpp), with
# -DGGML_NATIVE=OFF and the ISA flags read from /proc/cpuinfo (a native build can die with an
# illegal instruction on some of these VMs; AMX stays off for the same reason).
# Environment: PYTHON, GGUF (default: the bundled SmolLM2 Q4_1), CACHE (build cache),
# TAILRACE_ARGS (extra flags for `tailrace serve`), N_IN/N_OUT (default 128/128), PROMPTS_1/PROMPTS_32.
# ISA=avx2: both sides built as for a CPU without AVX-512, on one that has it: llama.cpp with
# AVX2/FMA/F16C only (its own cached build), tailrace's C kernels with TAILRACE_CPU_MARCH=haswell
# and torch's kernels held to AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2).
# TARGETS (default "llama-server llama-bench"): what to build; TARGETS=llama-server skips llama-bench
# (half the build on 2 cores) and the run then leaves out llama-bench's table.
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
if [[ "${ISA:-}" == avx2 ]]; then
  export TAILRACE_CPU_MARCH=haswell ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
elif has avx512f && has avx512bw && has avx512vl; then
  isa=avx512; cmake_isa+=(-DGGML_AVX512=ON)
  has avx512_vnni && { cmake_isa+=(-DGGML_AVX512_VNNI=ON); isa+=-vnni; }
  has avx512_bf16 && { cmake_isa+=(-DGGML_AVX512_BF16=ON); isa+=-bf16; }
  has avx512vbmi && cmake_isa+=(-DGGML_AVX512_VBMI=ON)
elif has avx_vnni; then
  cmake_isa+=(-DGGML_AVX_VNNI=ON); isa+=-vnni
fi
BUILD="$CACHE/$VERSION-$isa"
BIN="$BUILD/build/bin"
read -r -a targets <<< "${TARGETS:-llama-server llama-bench}"

build() {
  local t missing=0
  for t in "${targets[@]}"; do [[ -x "$BIN/$t" ]] || missing=1; done
  [[ $missing == 0 ]] && return 0
  mkdir -p "$BUILD"
  local sdist
  sdist="$(ls "$CACHE"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
  if [[ -z "$sdist" ]]; then
    "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$CACHE" "llama-cpp-python==$VERSION"
    sdist="$CACHE/llama_cpp_python-$VERSION.tar.gz"
  fi
  [[ -d "$BUILD/src" ]] || { mkdir -p "$BUILD/src"; tar -xzf "$sdist" -C "$BUILD/src" --strip-components=1; }
  echo "building llama.cpp ($isa) in $BUILD" >&2
  nice -n 19 cmake -S "$BUILD/src/vendor/llama.cpp" -B "$BUILD/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    "${cmake_isa[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF >&2
  nice -n 19 cmake --build "$BUILD/build" -j "${JOBS:-2}" --target "${targets[@]}" >&2
}

cmd="${1:-run}"
[[ "$cmd" == lib ]] || build
[[ "$cmd" == build ]] && { echo "$BIN"; exit 0; }

GGUF="${GGUF:-$("$PYTHON" -c 'from gpu.tokenizers.files import default_model_path; print(default_model_path())')}"
N_IN="${N_IN:-128}" N_OUT="${N_OUT:-128}"
PROMPTS_1="${PROMPTS_1:-8}" PROMPTS_32="${PROMPTS_32:-64}"
OUTDIR="${OUTDIR:-$(mktemp -d /tmp/bench_vs_llamacpp.XXXXXX)}"; mkdir -p "$OUTDIR"
PORT_T="${PORT_T:-18931}" PORT_L="${PORT_L:-18932}"
THREADS="${THREADS:-$(nproc)}"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

wait_up() {  # url [pid]
  for _ in $(seq 600); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    [[ -n "${2:-}" ]] && ! kill -0 "$2" 2>/dev/null && { echo "the server at $1 exited" >&2; return 1; }
    sleep 1
  done
  echo "server at $1 did not come up" >&2; return 1
}
rss_mb() { awk '/VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }
# CPU seconds (user + system, all threads) the process has used: on a shared machine a run's wall
# clock follows the load; its CPU per output token does not (as much)
cpu_s() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.2f", ($14 + $15) / hz}' "/proc/$1/stat"; }
tcpu() {  # name concurrency prompts: bench tailrace (tpid) and print its server's CPU ms per output token
  local c0 c1
  c0="$(cpu_s "$tpid")"
  bench "$1" "$PORT_T" "$2" "$3"
  c1="$(cpu_s "$tpid")"
  awk -v a="$c0" -v b="$c1" -v n="$(( $3 * N_OUT ))" -v c="$2" \
    'BEGIN {printf "  tailrace server CPU c=%s: %.1f ms per output token (%.1f s, prefill included)\n", c, (b - a) * 1e3 / n, b - a}'
}

bench() {  # name port concurrency prompts
  "$PYTHON" -m web.cli bench serve --backend openai-chat --base-url "http://127.0.0.1:$2" \
    --tokenizer "$GGUF" --dataset-name random --random-input-len "$N_IN" --random-output-len "$N_OUT" \
    --ignore-eos --temperature 0 --num-prompts "$4" --max-concurrency "$3" --disable-tqdm \
    --save-result --result-dir "$OUTDIR" --result-filename "$1-c$3.json" > "$OUTDIR/$1-c$3.txt" 2>&1
  "$PYTHON" - "$OUTDIR/$1-c$3.json" "$1" "$3" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:>10s} c={sys.argv[3]:>2s}  TPOT p50 {r.get('median_tpot_ms', 0):7.1f} ms  "
      f"TTFT p50 {r.get('median_ttft_ms', 0):8.1f} ms  output {r.get('output_throughput', 0):7.1f} tok/s")
PY
}

start_tailrace() {  # sets tpid: `tailrace serve` with default flags (+ TAILRACE_ARGS), up
  # shellcheck disable=SC2086
  OMP_NUM_THREADS="$THREADS" "$PYTHON" -m web.cli serve "$GGUF" --host 127.0.0.1 --port "$PORT_T" \
    --kv-cache-memory-bytes "${KV_BYTES:-1GiB}" ${TAILRACE_ARGS:-} > "$OUTDIR/tailrace.log" 2>&1 &
  tpid=$!; pids+=("$tpid")
  wait_up "http://127.0.0.1:$PORT_T/v1/models" "$tpid"
}

if [[ "$cmd" == lib ]]; then
  LCPY="$("$HERE/scripts/llamacpp_wheel/setup.sh" "${LC_VENV:-/tmp/lcvenv}")"
  echo "# $(date -u +%FT%TZ) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $THREADS threads; load: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# GGUF $GGUF; $N_IN in / $N_OUT out, greedy, ignore_eos, 1 stream; results in $OUTDIR"
  start_tailrace
  for r in $(seq "${ROUNDS:-3}"); do
    [[ "${ONLY_32:-0}" == 1 ]] && break
    tcpu "tailrace-r$r" 1 "$PROMPTS_1"
    "$LCPY" "$HERE/scripts/bench_llamacpp_lib.py" --model "$GGUF" --threads "$THREADS" --n-in "$N_IN" \
      --n-out "$N_OUT" --rounds 1 2> "$OUTDIR/llamacpp-lib-r$r.log"
  done
  if [[ "${LIB_32:-0}" == 1 ]]; then
    echo "# 32 streams, $PROMPTS_32 prompts; load: $(cut -d' ' -f1-3 /proc/loadavg)"
    for r in $(seq "${ROUNDS:-3}"); do
      tcpu "tailrace-r$r" 32 "$PROMPTS_32"
      "$LCPY" "$HERE/scripts/bench_llamacpp_lib.py" --model "$GGUF" --threads "$THREADS" --n-in "$N_IN" \
        --n-out "$N_OUT" --rounds 1 --parallel 32 --prompts "$PROMPTS_32" 2> "$OUTDIR/llamacpp-lib32-r$r.log"
    done
  fi
  echo "tailrace RSS $(rss_mb "$tpid") MB; load after: $(cut -d' ' -f1-3 /proc/loadavg)"
  exit 0
fi

echo "# $(date -u +%FT%TZ) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) ($isa), $THREADS threads; load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# GGUF $GGUF; $N_IN in / $N_OUT out, greedy, ignore_eos; results in $OUTDIR"
start_tailrace
grep -m1 -o 'weights: .*' "$OUTDIR/tailrace.log" || true
for c in 1 32; do bench tailrace "$PORT_T" "$c" "$([[ $c == 1 ]] && echo "$PROMPTS_1" || echo "$PROMPTS_32")"; done
echo "tailrace RSS $(rss_mb "$tpid") MB"
kill "$tpid"; wait "$tpid" 2>/dev/null || true

"$BIN/llama-server" -m "$GGUF" --host 127.0.0.1 --port "$PORT_L" -t "$THREADS" -np 32 -c $((32 * (N_IN + N_OUT + 64))) \
  > "$OUTDIR/llama-server.log" 2>&1 &
pids+=($!); lpid=$!
wait_up "http://127.0.0.1:$PORT_L/health" "$lpid"
for c in 1 32; do bench llama "$PORT_L" "$c" "$([[ $c == 1 ]] && echo "$PROMPTS_1" || echo "$PROMPTS_32")"; done
echo "llama-server RSS $(rss_mb "$lpid") MB"
kill "$lpid"; wait "$lpid" 2>/dev/null || true
[[ -x "$BIN/llama-bench" ]] || exit 0
"$BIN/llama-bench" -m "$GGUF" -t "$THREADS" -p "$N_IN" -n "$N_OUT" -o md 2>/dev/null | tail -n +1
