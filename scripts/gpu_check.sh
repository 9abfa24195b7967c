#!/usr/bin/env bash
# Device check for the lent GPU machine (H200 image: Python 3.12, torch 2.11 CUDA, triton 3.6).
#
# How to run it there (the device tool's `run`, one call, timeout_s 600):
#   here, once:  bash scripts/fetch_gpu_wheels.sh     # py3.12 wheels the image lacks -> .whl/
#   run:         command "bash scripts/gpu_check.sh", carry [".whl"], timeout_s 600
# What travels: the working tree (tracked and untracked-not-ignored files) and, through
# carry, .whl/ (trio, outcome, sniffio, cattrs, structlog, orjson, gguf, attrs,
# typing-extensions, and structured output's xgrammar and pydantic: about 9 MiB).
# Time limit: the steps below share a 540 s budget (GPU_CHECK_BUDGET_S), inside the
# tool's 600 s per command; each step gets what is left, less what the later ones need.
# Results: at most 8 files in $OUT (./results when unset):
#   env.json            versions, the device, the wheel checks
#   throughput.json     1. nano-vllm's workload end to end (the figure), with failures,
#                          CUDA graphs (and why not), Triton compiles in the timed window
#   bf16_greedy.json    2. bf16 greedy: the Triton path against the torch path
#   graph_splits.json   2b. CUDA graphs against eager at 1, 4, 8 and 16 KV splits
#   kernels_tests.json  3. kernel tests on CUDA (a summary of pytest's junit report)
#   kernels_tests.log   its output
#   kernels_bench.json  4. kernel micro-benchmarks (Qwen3-0.6B shapes, GB/s vs 4.8 TB/s)
#   steps.log           every step's output (throughput's too, 5. the MXFP4 MoE bench, 6. the
#                       tensor-parallel tests: 2+ GPUs) and what was skipped, and why
# The first line of results (RESULT, printed after step 1 and again at the end) says
# whether CUDA graphs were captured: a capture failure means an eager figure, said loudly.
# On a machine without CUDA (PYTHON=/work/main/.venv/bin/python bash scripts/gpu_check.sh)
# it runs what it can (the environment checks, the kernel tests and benchmarks under the
# Triton interpreter at small shapes) and says what it skipped and why. The dry run that
# stands for the image: TAILRACE_DEVICE_IMAGE=1 PYTHON=/work/main/.venv/bin/python bash
# scripts/gpu_check.sh: every package the image lacks and .whl/ does not carry then fails
# to import (scripts/device_image/sitecustomize.py), as it would there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the CPU stand-in for the image: its missing packages blocked (header)
[ "${TAILRACE_DEVICE_IMAGE:-0}" = 1 ] && export PYTHONPATH="$PWD/scripts/device_image:$PYTHONPATH"
BUDGET_S="${GPU_CHECK_BUDGET_S:-540}"
STEPS_LOG="$OUT/steps.log"
: > "$STEPS_LOG"
say() { echo "[gpu_check $(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$STEPS_LOG"; }
# left RESERVE_S: seconds a step may take, keeping RESERVE_S for the steps after it
left() { local l=$(( BUDGET_S - SECONDS - $1 )); echo $(( l > 0 ? l : 0 )); }

# 0. Carried wheels. First every carried wheel's own requirements, read from the wheels,
#    against what this image has (a carried wheel stands in for the image's copy):
#    --no-deps hides a mismatch until an import or a call fails in the middle of the run.
"$PY" - "$OUT/env.json" <<'PY' 2>&1 | tee -a "$STEPS_LOG"
import glob, importlib.metadata as md, json, platform, re, sys, zipfile
from email.parser import Parser
try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
import torch
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
carried = {}
for path in sorted(glob.glob(".whl/*.whl")):
    with zipfile.ZipFile(path) as z:
        meta = Parser().parsestr(z.read(next(n for n in z.namelist()
                                             if n.endswith(".dist-info/METADATA"))).decode())
    carried[norm(meta["Name"])] = meta
problems = []
for name, meta in carried.items():
    needs_py = meta.get("Requires-Python")
    if needs_py and not SpecifierSet(needs_py).contains(platform.python_version()):
        problems.append(f"{name} {meta['Version']} needs Python {needs_py}, have {platform.python_version()}")
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if norm(req.name) in carried:
            have = carried[norm(req.name)]["Version"]
        else:
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{name} {meta['Version']} needs {line}: not installed")
                continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{name} {meta['Version']} needs {line}: have {have}")
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
image = {}
for pkg in ("attrs", "typing_extensions", "numpy", "tokenizers", "packaging"):
    try:
        image[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
        image[pkg] = None
env = dict(python=platform.python_version(), torch=torch.__version__, triton=triton_version,
           cuda=torch.version.cuda, device=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           image_packages=image, carried={n: m["Version"] for n, m in carried.items()},
           wheel_problems=problems)
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env))
if problems:
    print("FAIL: a carried wheel's requirements do not hold on this image:\n  " + "\n  ".join(problems))
    sys.exit(3)
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || { say "stopping: fix scripts/fetch_gpu_wheels.sh's versions (above)"; exit 3; }

CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
PYVER=$("$PY" -c "import sys; print('%d.%d' % sys.version_info[:2])")
if ! compgen -G ".whl/*.whl" > /dev/null; then
    say "no .whl/ carried: using the packages already installed"
elif [ "$PYVER" != 3.12 ] && [ "$CUDA" != 1 ]; then
    say "SKIPPED installing .whl/: its wheels are for the GPU image's Python 3.12, this is $PYVER"
else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { say "FAIL: installing the carried wheels (.whl/) failed"; exit 2; }
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
    say "installed $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
fi
# Fail fast, before any GPU time goes to a run that cannot import the engine: import the
# entry points the steps below run (not a list of packages, which drifts from the code).
if ! "$PY" - 2>>"$STEPS_LOG" <<'PY'
import importlib, importlib.util, sys
for name in ("pipeline.tools.bench", "gpu.kernels.bench", "gpu.kernels.compile_count"):
    importlib.import_module(name)
for path in ("scripts/compare_paths.py",):   # a script: loaded as a module, main() not run
    spec = importlib.util.spec_from_file_location("_check_" + path.replace("/", "_")[:-3], path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
import pytest  # step 3
PY
then
    say "FAIL: an entry point does not import (steps.log has the traceback)."
    say "      Here: bash scripts/fetch_gpu_wheels.sh; then run with carry [\".whl\"]."
    exit 2
fi

rc_e2e=skipped rc_bf16=skipped rc_graphs=skipped rc_tests=skipped rc_bench=skipped

# 1. The figure first: nano-vllm's published workload (Qwen3-0.6B architecture, dummy
#    weights, 256 sequences, lengths uniform in [100, 1024] drawn in nano-vllm's order,
#    133,966 output tokens, seed 0, ignore_eos, temperature 0.6) through the whole engine;
#    the JSON says whether CUDA graphs were captured, capture and warm-up time, failures.
if [ "$CUDA" = 1 ] && [ "$(left 260)" -gt 30 ]; then
    t=$(left 260); say "1. end-to-end throughput (nano-vllm workload), up to ${t}s"
    # nano-vllm's engine settings: max_model_len 4096, max_num_seqs 512,
    # max_num_batched_tokens 16384, CUDA graphs, gpu_memory_utilization 0.9
    timeout -s INT -k 15 "$t" "$PY" -m pipeline.tools.bench gpu/configs/qwen3-0.6b --load-format dummy --workload nano-vllm \
        --dtype bfloat16 --max-model-len 4096 --max-num-seqs 512 --max-num-batched-tokens 16384 \
        --output-json "$OUT/throughput.json" 2>&1 | tee -a "$STEPS_LOG"
    rc_e2e=${PIPESTATUS[0]}
    { [ "$rc_e2e" -eq 124 ] || [ "$rc_e2e" -eq 137 ]; } && \
        say "1. TIMED OUT after ${t}s (interrupted: throughput.json says how far it got)"
elif [ "$CUDA" = 1 ]; then
    say "1. SKIPPED end-to-end throughput: the budget is spent"; rc_e2e=budget
else
    say "1. SKIPPED end-to-end throughput: no CUDA device (the figure needs the GPU; on CPU see docs/benchmarks.md)"
    # the same entry point run end to end, tiny, so that what it imports while running
    # (not only at import) is checked here too
    tiny=$(mktemp -d)
    "$PY" -c "import json, sys; sys.path.insert(0, 'tests/kernels'); from conftest import TINY_QWEN3; json.dump(TINY_QWEN3, open('$tiny/config.json', 'w'))"
    say "1. instead: pipeline.tools.bench end to end on a tiny Qwen3 (CPU, dummy weights)"
    timeout 120 "$PY" -m pipeline.tools.bench "$tiny" --load-format dummy --num-prompts 4 --input-len 16 \
        --output-len 8 --dtype float32 --output-json "$tiny/throughput.json" 2>&1 | tee -a "$STEPS_LOG"
    rc_e2e=${PIPESTATUS[0]}
fi
# The headline, graphs first: a capture failure only logs a warning in the run and turns
# the figure into an eager one.
headline() {
    "$PY" - "$OUT/throughput.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print("RESULT: no throughput.json (step 1 skipped or died before writing it)")
    sys.exit(0)
if r.get("cuda_graphs"):
    print(f"RESULT: CUDA graphs captured (sizes {r.get('cuda_graph_sizes')}, {r.get('cuda_graph_capture_s')} s)")
else:
    print(f"RESULT: CUDA GRAPH CAPTURE FAILED, the figure ran EAGER: {r.get('cuda_graph_error') or r.get('error')}")
compiles = r.get("triton_compiles_in_timed_window")
print(f"RESULT: {r.get('output_tokens_per_s')} output tok/s; Triton compiles in the timed window: {compiles}"
      + ("" if compiles in (0, None) else "  <-- MUST BE 0"))
if r.get("failed_requests") or r.get("error"):
    print(f"RESULT: {r.get('failed_requests')} requests failed: {r.get('first_error') or r.get('error')}")
PY
}
[ "$CUDA" = 1 ] && headline | tee -a "$STEPS_LOG"

# 2. bf16 greedy, end to end through the runner: the Triton path (kernels, CUDA graphs,
#    device sampling) and the torch path, both in bf16, against the torch path in fp32 on
#    the same weights; fails unless the Triton path is about as close as the torch path.
if [ "$CUDA" = 1 ] && [ "$(left 190)" -gt 20 ]; then
    t=$(left 190); [ "$t" -gt 60 ] && t=60; say "2. bf16 greedy Triton vs torch, up to ${t}s"
    timeout "$t" "$PY" scripts/compare_paths.py --config gpu/configs/qwen3-0.6b --dtype bfloat16 \
        --out "$OUT/bf16_greedy.json" 2>&1 | tee -a "$STEPS_LOG"
    rc_bf16=${PIPESTATUS[0]}
else
    if [ "$CUDA" = 1 ]; then
        say "2. SKIPPED bf16 greedy comparison: the budget is spent"; rc_bf16=budget
    else
        say "2. SKIPPED bf16 greedy comparison: no CUDA device (bf16 tensor-core dots need the GPU;"
        say "   step 3's tests/kernels/test_compare_paths.py runs the same comparison, tiny, here)"
    fi
fi

# 2b. CUDA graphs against eager for every KV split count a graph can be captured with (on
#     CPU: the eager half under the interpreter, tiny).
if [ "$(left 100)" -gt 20 ]; then
    t=$(left 100); [ "$t" -gt 90 ] && t=90; say "2b. graphs vs eager at 1, 4, 8, 16 KV splits, up to ${t}s"
    if [ "$CUDA" = 1 ]; then
        timeout "$t" "$PY" scripts/check_graph_splits.py --config gpu/configs/qwen3-0.6b --dtype bfloat16 \
            --out "$OUT/graph_splits.json" 2>&1 | tee -a "$STEPS_LOG"
    else
        tiny=$(mktemp -d)
        "$PY" -c "import json, sys; sys.path.insert(0, 'tests/kernels'); from conftest import TINY_QWEN3; json.dump(TINY_QWEN3, open('$tiny/config.json', 'w'))"
        timeout "$t" "$PY" scripts/check_graph_splits.py --config "$tiny" --dtype float32 --batch-sizes 1,3 \
            --max-ctx 70 --out "$OUT/graph_splits.json" 2>&1 | tee -a "$STEPS_LOG"
    fi
    rc_graphs=${PIPESTATUS[0]}
else
    say "2b. SKIPPED graphs vs eager: the budget is spent"; rc_graphs=budget
fi

# 3. Kernel tests (on CPU: under the Triton interpreter, small shapes). addopts cleared:
#    pytest-trio may be absent on the image.
t=$(left 60); say "3. kernel tests, up to ${t}s"
if [ "$t" -gt 10 ]; then
    rm -f /tmp/kernels_junit.xml
    timeout "$t" "$PY" -m pytest tests/kernels -q -p no:cacheprovider -o addopts="" -rfE \
        --junitxml /tmp/kernels_junit.xml 2>&1 | tee "$OUT/kernels_tests.log"
    rc_tests=${PIPESTATUS[0]}
    "$PY" - "$OUT" "$rc_tests" <<'PY'
import json, sys, xml.etree.ElementTree as ET
out, rc = sys.argv[1], int(sys.argv[2])
summary = dict(rc=rc)
try:
    suite = ET.parse("/tmp/kernels_junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")},
                   time_s=float(suite.get("time", 0)),
                   failed=[f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                           if c.find("failure") is not None or c.find("error") is not None])
except Exception as exc:  # no junit file: pytest did not get far
    summary["junit_error"] = repr(exc)
json.dump(summary, open(f"{out}/kernels_tests.json", "w"), indent=1)
print(json.dumps(summary))
PY
else
    say "3. SKIPPED kernel tests: the budget is spent"; rc_tests=budget
fi

# 4. Kernel micro-benchmarks (on CPU: tiny shapes once, a smoke test of the script).
t=$(left 5); [ "$t" -gt 120 ] && t=120; say "4. kernel micro-benchmarks, up to ${t}s"
if [ "$t" -gt 10 ]; then
    timeout "$t" "$PY" -m gpu.kernels.bench --out "$OUT/kernels_bench.json" 2>&1 | tee -a "$STEPS_LOG"
    rc_bench=${PIPESTATUS[0]}
else
    say "4. SKIPPED kernel micro-benchmarks: the budget is spent"; rc_bench=budget
fi

# 5. MXFP4 MoE (issue 27): the packed-expert grouped GEMM against torch's bf16 grouped GEMM at
#    gpt-oss-20b shapes, decode batches 1-32 and prefill (its correctness test ran in step 3:
#    tests/kernels/test_mxfp4_moe.py). Figures into steps.log. On CPU: a tiny smoke run.
rc_moe=skipped
t=$(left 0); [ "$t" -gt 120 ] && t=120; say "5. MXFP4 MoE bench, up to ${t}s"
if [ "$t" -gt 15 ]; then
    if [ "$CUDA" = 1 ]; then moe_args="--tokens 1 2 4 8 16 32 512 2048"; else moe_args="--hidden 64 --experts 8 --tokens 1 5"; fi
    timeout "$t" "$PY" scripts/bench_moe.py --gpu $moe_args 2>&1 | tee -a "$STEPS_LOG"
    rc_moe=${PIPESTATUS[0]}
    say "5. MXFP4 MoE bench rc=$rc_moe"
else
    say "5. SKIPPED MXFP4 MoE bench: the budget is spent"; rc_moe=budget
fi

# 6. Tensor parallelism (issue 25) on the GPUs, NCCL: tests/tp's servers with --device cuda
#    (TP 2 on the tiny gpt-oss; TP 3 on SmolLM2 with three or more GPUs), greedy output
#    against one rank, CUDA graphs with their collectives captured, a killed worker. Needs
#    two GPUs or more: skipped with the reason otherwise (one GPU cannot show TP).
rc_tp=skipped
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
MISSING_TP=$("$PY" -c "import importlib.util as u; print(' '.join(m for m in ('openai', 'transformers', 'httpx') if u.find_spec(m) is None))" 2>/dev/null)
if [ "$NGPU" -lt 2 ]; then
    say "6. SKIPPED tensor-parallel tests: they need 2 or more GPUs, torch sees $NGPU"
elif [ -n "$MISSING_TP" ]; then
    say "6. SKIPPED tensor-parallel tests: the image lacks $MISSING_TP (carry their wheels in .whl/)"
else
    t=$(left 0); [ "$t" -gt 240 ] && t=240; say "6. tensor-parallel tests on $NGPU GPUs, up to ${t}s"
    if [ "$t" -gt 60 ]; then
        TAILRACE_TP_DEVICE=cuda TAILRACE_TP_TIMEOUT_S=30 timeout "$t" "$PY" -m pytest tests/tp -q \
            -p no:cacheprovider -o addopts="" -rfEs 2>&1 | tee -a "$STEPS_LOG"
        rc_tp=${PIPESTATUS[0]}
    else
        say "6. SKIPPED tensor-parallel tests: the budget is spent"; rc_tp=budget
    fi
fi

[ "$CUDA" = 1 ] && headline | tee -a "$STEPS_LOG"
say "done in ${SECONDS}s: throughput rc=$rc_e2e, bf16 greedy rc=$rc_bf16, graphs vs eager rc=$rc_graphs, kernel tests rc=$rc_tests, kernel bench rc=$rc_bench, MXFP4 MoE bench rc=$rc_moe, TP tests rc=$rc_tp"
for rc in "$rc_e2e" "$rc_bf16" "$rc_graphs" "$rc_tests" "$rc_bench" "$rc_moe" "$rc_tp"; do
    [ "$rc" = skipped ] || [ "$rc" = 0 ] || exit 1   # "budget": a step the time limit cut
done
exit 0
