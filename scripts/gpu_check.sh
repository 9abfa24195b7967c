#!/usr/bin/env bash
# Device check for the lent GPU machine (H200 image: Python 3.12, torch 2.11 CUDA, triton 3.6).
#
# How to spend the 15 minutes of device time (start-up, both calls and idle waits all count):
#   0. here, before any device time: bash scripts/fetch_gpu_wheels.sh (py3.12 wheels the
#      image lacks -> .whl/); this script's first line says whether .whl/ holds them all.
#   1. the figure: the device tool's `run`, command "GPU_CHECK_BUDGET_S=240 bash scripts/gpu_check.sh",
#      carry [".whl"], timeout_s 300. After the wheel and import checks, step 1 only
#      (nano-vllm's workload end to end): the RESULT lines (CUDA graphs captured or not;
#      output tok/s), then the SUMMARY line; nothing else.
#   2. the rest, straight after call 1 returns (a warm machine waits only ~30 s, a fresh one
#      costs minutes): `status` for budget_left_s, then `run` command
#      "GPU_CHECK_PART=rest GPU_CHECK_BUDGET_S=B bash scripts/gpu_check.sh" with
#      B = budget_left_s - 90 (at most 540), carry [".whl"], timeout_s B + 45: steps 2-6, the
#      bf16 comparison, the kernel tests (kernels_tests.json), graphs vs eager, the benchmarks.
#   3. give_back at once: idle time counts too.
#   Start-up ~3 min and call 1 ~4.5 min leave call 2 about 6 min (B ~ 270).
# GPU_CHECK_PART: figure (step 1), rest (steps 2-6) or all; unset: all when the budget is
# 480 s or more (everything in one 600 s call), else figure.
# What travels: the working tree (tracked and untracked-not-ignored files) and, through
# carry, .whl/ (trio, outcome, sniffio, cattrs, structlog, orjson, gguf, attrs,
# typing-extensions, and structured output's xgrammar and pydantic: about 9 MiB). The first
# line printed says whether .whl/ holds every wheel fetch_gpu_wheels.sh lists, before any
# device time goes to a run that cannot import the engine.
# Time limit: the steps of a call share GPU_CHECK_BUDGET_S (default 540, inside the tool's
# 600 s a command); each step gets what is left, less what the later ones of its part need.
# The last line of every call: SUMMARY, what passed, failed, timed out, was skipped for lack
# of time, and what this part does not run. Exit 0 unless a step failed or timed out.
# The rest runs in the order 2, 3, 2b, 4, 5, 6: the kernel tests before graphs vs eager.
# Results: at most 8 files in $OUT (./results when unset):
#   env.json            versions, the device, the wheel checks
#   throughput.json     1. nano-vllm's workload end to end (the figure), with failures,
#                          CUDA graphs (and why not), Triton compiles in the timed window
#   bf16_greedy.json    2. bf16 greedy: the Triton path against the torch path
#   graph_splits.json   2b. CUDA graphs against eager at 1, 4, 8 and 16 KV splits
#   kernels_tests.json  3. kernel tests on CUDA: pytest's junit report summed up, each case's
#                          outcome, worst error against its reference and its tolerance (atol,
#                          rtol; ratio > 1 fails), the misses first; the kernels listed in
#                          scripts/check_triton_compile.py KERNELS (which are not here yet)
#   kernels_tests.log   its output
#   kernels_bench.json  4. kernel micro-benchmarks (Qwen3-0.6B shapes, GB/s vs 4.8 TB/s)
#   steps.log           every step's output (throughput's too, 5. the MXFP4 MoE bench, 6. the
#                       tensor-parallel tests: 2+ GPUs) and what was skipped, and why
# The RESULT lines (after step 1, and again at the end of a call that ran more) say first
# whether CUDA graphs were captured: a capture failure means an eager figure, said loudly.
# On a machine without CUDA (PYTHON=/work/main/.venv/bin/python bash scripts/gpu_check.sh)
# it runs what it can (the environment checks, a tiny end-to-end bench for step 1, the
# kernel tests and benchmarks under the Triton interpreter at small shapes) and says what it
# skipped and why. The dry run that stands for the image: TAILRACE_DEVICE_IMAGE=1
# PYTHON=/work/main/.venv/bin/python bash scripts/gpu_check.sh: every package the image
# lacks and .whl/ does not carry then fails to import (scripts/device_image/sitecustomize.py),
# as it would there. GPU_CHECK_TESTS_K (a pytest -k expression) narrows step 3's tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
STEPS_LOG="$OUT/steps.log"
: > "$STEPS_LOG"

# The first line: the carried wheels, against fetch_gpu_wheels.sh's list (no torch import:
# it comes at once).
"$PY" - <<'PY' 2>&1 | tee -a "$STEPS_LOG"
import glob, re
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
want = {norm(n): v for n, v in re.findall(r"([A-Za-z0-9][A-Za-z0-9_.-]*)==([0-9][^\s\\]*)",
                                           open("scripts/fetch_gpu_wheels.sh").read())}
have = {}
for path in glob.glob(".whl/*.whl"):
    name, version, *tags = path.rsplit("/", 1)[-1][:-4].split("-")
    have[norm(name)] = version
missing = [f"{n}=={v}" for n, v in want.items() if have.get(n) != v]
fetch = 'here, run bash scripts/fetch_gpu_wheels.sh, then call with carry [".whl"]'
if not missing:
    print(f"gpu_check wheels: all {len(want)} that scripts/fetch_gpu_wheels.sh lists are in .whl/ (carried)")
elif len(missing) == len(want):
    print(f"gpu_check wheels: NONE of the {len(want)} in .whl/: the GPU image cannot import the engine "
          f"without them ({fetch}); a CPU run uses the installed packages")
else:
    print(f"gpu_check wheels: MISSING {len(missing)} of {len(want)} in .whl/: {', '.join(missing)} ({fetch})")
PY
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the CPU stand-in for the image: its missing packages blocked (header)
[ "${TAILRACE_DEVICE_IMAGE:-0}" = 1 ] && export PYTHONPATH="$PWD/scripts/device_image:$PYTHONPATH"
BUDGET_S="${GPU_CHECK_BUDGET_S:-540}"
PART="${GPU_CHECK_PART:-}"
if [ -z "$PART" ]; then
    if [ "$BUDGET_S" -ge 480 ]; then PART=all; else PART=figure; fi
fi
case "$PART" in figure|rest|all) ;; *) echo "GPU_CHECK_PART=$PART: figure, rest or all"; exit 64;; esac
say() { echo "[gpu_check $(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$STEPS_LOG"; }
# left RESERVE_S: seconds a step may take, keeping RESERVE_S for the steps after it
left() { local l=$(( BUDGET_S - SECONDS - $1 )); echo $(( l > 0 ? l : 0 )); }
wants() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }   # wants figure|rest: this call runs it

# What became of each step, for the SUMMARY line: passed, failed (rc), timed out, time
# (skipped: the budget was spent), part (another call's), or "skip:why".
STEP_NAMES=(throughput bf16_greedy graphs_vs_eager kernel_tests kernel_bench moe_bench tp_tests)
declare -A ST
for n in "${STEP_NAMES[@]}"; do ST[$n]=part; done
ran() {   # ran STEP RC
    case "$2" in 0) ST[$1]=passed;; 124|137) ST[$1]=timed_out;; *) ST[$1]="failed rc=$2";; esac
}
summary() {
    local passed="" failed="" timed="" budget="" other="" skipped="" n v
    for n in "${STEP_NAMES[@]}"; do
        v="${ST[$n]}"
        case "$v" in
            passed) passed+="${passed:+, }$n";;
            timed_out) timed+="${timed:+, }$n";;
            failed*) failed+="${failed:+, }$n (${v#failed })";;
            time) budget+="${budget:+, }$n";;
            part) other+="${other:+, }$n";;
            skip:*) skipped+="${skipped:+, }$n (${v#skip:})";;
        esac
    done
    local hint=""
    [ -n "$other" ] && { [ "$PART" = figure ] && hint=" (GPU_CHECK_PART=rest runs them)" || hint=" (GPU_CHECK_PART=figure)"; }
    say "SUMMARY part $PART, ${SECONDS}s of ${BUDGET_S}s: passed: ${passed:-none}; failed: ${failed:-none}; timed out: ${timed:-none}; skipped for time: ${budget:-none}; not in this part: ${other:-none}${hint}; skipped: ${skipped:-none}"
}
stopped() {   # stopped WHY: the summary of a call that stops before its steps
    local n
    for n in "${STEP_NAMES[@]}"; do
        { [ "$n" = throughput ] && wants figure; } || { [ "$n" != throughput ] && wants rest; } && ST[$n]="skip:$1"
    done
    summary
}
say "part $PART of the device check, budget ${BUDGET_S}s (header: call 1 figure, call 2 rest)"

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
[ "${PIPESTATUS[0]}" -eq 0 ] || { say "stopping: fix scripts/fetch_gpu_wheels.sh's versions (above)"; stopped "a wheel's requirements"; exit 3; }

CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
PYVER=$("$PY" -c "import sys; print('%d.%d' % sys.version_info[:2])")
if ! compgen -G ".whl/*.whl" > /dev/null; then
    say "no .whl/ carried: using the packages already installed"
elif [ "$PYVER" != 3.12 ] && [ "$CUDA" != 1 ]; then
    say "SKIPPED installing .whl/: its wheels are for the GPU image's Python 3.12, this is $PYVER"
else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { say "FAIL: installing the carried wheels (.whl/) failed"; stopped "the wheels did not install"; exit 2; }
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
    say "installed $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
fi
# Fail fast, before any GPU time goes to a run that cannot import the engine: import the
# entry points the steps below run (not a list of packages, which drifts from the code).
if ! "$PY" - 2>>"$STEPS_LOG" <<'PY'
import importlib, importlib.util, sys
for name in ("pipeline.tools.bench", "gpu.kernels.triton.bench", "gpu.kernels.triton.compile_count"):
    importlib.import_module(name)
for path in ("scripts/compare_paths.py",):   # a script: loaded as a module, main() not run
    spec = importlib.util.spec_from_file_location("_check_" + path.replace("/", "_")[:-3], path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
import pytest  # step 3
PY
then
    say "FAIL: an entry point does not import (steps.log has the traceback)."
    say "      Here: bash scripts/fetch_gpu_wheels.sh; then run with carry [\".whl\"]."
    stopped "an entry point does not import"; exit 2
fi

tiny_config() {   # a folder holding the kernel tests' tiny Qwen3 config (CPU stand-ins)
    local d; d=$(mktemp -d)
    "$PY" -c "import json; from tests.support.tiny_runners import TINY_QWEN3; json.dump(TINY_QWEN3, open('$d/config.json', 'w'))"
    echo "$d"
}

# The headline, graphs first: a capture failure only logs a warning in the run and turns
# the figure into an eager one. Without CUDA: the tiny stand-in's, marked as such.
headline() {
    "$PY" - "$OUT/throughput.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print("RESULT: no throughput.json (step 1 skipped or died before writing it)")
    sys.exit(0)
if not str(r.get("device", "cuda")).startswith("cuda"):
    print(f"RESULT (CPU dry run, tiny model: not the figure): CUDA graphs: none on {r.get('device')}")
    print(f"RESULT (CPU dry run, tiny model: not the figure): {r.get('output_tokens_per_s')} output tok/s")
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

# Reserves: what a part's later steps need at the least. The figure takes what the call has
# (less the headline's and the summary's few seconds) unless the rest runs after it in this
# call (all): then it leaves the rest 260 s.
if [ "$PART" = all ]; then FIGURE_RESERVE=260; else FIGURE_RESERVE=20; fi

# 1. The figure first: nano-vllm's published workload (Qwen3-0.6B architecture, dummy
#    weights, 256 sequences, lengths uniform in [100, 1024] drawn in nano-vllm's order,
#    133,966 output tokens, seed 0, ignore_eos, temperature 0.6) through the whole engine;
#    the JSON says whether CUDA graphs were captured, capture and warm-up time, failures.
if ! wants figure; then
    :
elif [ "$CUDA" = 1 ] && [ "$(left $FIGURE_RESERVE)" -gt 30 ]; then
    t=$(left $FIGURE_RESERVE); say "1. end-to-end throughput (nano-vllm workload), up to ${t}s"
    # nano-vllm's engine settings: max_model_len 4096, max_num_seqs 512,
    # max_num_batched_tokens 16384, CUDA graphs, gpu_memory_utilization 0.9
    timeout -s INT -k 10 "$t" "$PY" -m pipeline.tools.bench gpu/configs/qwen3-0.6b --load-format dummy --workload nano-vllm \
        --dtype bfloat16 --max-model-len 4096 --max-num-seqs 512 --max-num-batched-tokens 16384 \
        --output-json "$OUT/throughput.json" 2>&1 | tee -a "$STEPS_LOG"
    rc=${PIPESTATUS[0]}; ran throughput "$rc"
    { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && \
        say "1. TIMED OUT after ${t}s (interrupted: throughput.json says how far it got)"
elif [ "$CUDA" = 1 ]; then
    say "1. SKIPPED end-to-end throughput: the budget is spent"; ST[throughput]=time
else
    say "1. no CUDA device: the figure needs the GPU (on CPU see docs/benchmarks.md)"
    # the same entry point run end to end, tiny, so that what it imports while running
    # (not only at import) is checked here too, and the headline with it
    t=$(left $FIGURE_RESERVE); [ "$t" -gt 120 ] && t=120
    if [ "$t" -gt 15 ]; then
        tiny=$(tiny_config)
        say "1. instead: pipeline.tools.bench end to end on a tiny Qwen3 (CPU, dummy weights), up to ${t}s"
        timeout "$t" "$PY" -m pipeline.tools.bench "$tiny" --load-format dummy --num-prompts 4 --input-len 16 \
            --output-len 8 --dtype float32 --output-json "$OUT/throughput.json" 2>&1 | tee -a "$STEPS_LOG"
        ran throughput "${PIPESTATUS[0]}"
    else
        say "1. SKIPPED the tiny end-to-end run: the budget is spent"; ST[throughput]=time
    fi
fi
wants figure && headline | tee -a "$STEPS_LOG"

# 2. bf16 greedy, end to end through the runner: the Triton path (kernels, CUDA graphs,
#    device sampling) and the torch path, both in bf16, against the torch path in fp32 on
#    the same weights; fails unless the Triton path is about as close as the torch path.
if ! wants rest; then
    :
elif [ "$CUDA" != 1 ]; then
    ST[bf16_greedy]="skip:no CUDA; step 3's test_compare_paths.py runs it tiny"
    say "2. SKIPPED bf16 greedy comparison: no CUDA device (bf16 tensor-core dots need the GPU;"
    say "   step 3's tests/kernels/test_compare_paths.py runs the same comparison, tiny, here)"
elif [ "$(left 150)" -gt 20 ]; then
    t=$(left 150); [ "$t" -gt 60 ] && t=60; say "2. bf16 greedy Triton vs torch, up to ${t}s"
    timeout "$t" "$PY" scripts/compare_paths.py --config gpu/configs/qwen3-0.6b --dtype bfloat16 \
        --out "$OUT/bf16_greedy.json" 2>&1 | tee -a "$STEPS_LOG"
    ran bf16_greedy "${PIPESTATUS[0]}"
else
    say "2. SKIPPED bf16 greedy comparison: the budget is spent"; ST[bf16_greedy]=time
fi

# 3. Kernel tests (on CPU: under the Triton interpreter, small shapes): tests/kernels and
#    the test files of scripts/check_triton_compile.py's KERNELS. addopts cleared:
#    pytest-trio may be absent on the image; plugins not autoloaded: the kernel tests need none,
#    and an installed one that fails to import (here, or there) cannot stop them. Each case's worst error and its tolerance go
#    into the junit report (tests/kernels/conftest.py), and from it into kernels_tests.json.
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if wants rest; then
    # on CUDA at most 300 s, leaving the benchmarks theirs; under the interpreter they take longer
    t=$(left 60); [ "$CUDA" = 1 ] && [ "$t" -gt 300 ] && t=300; say "3. kernel tests, up to ${t}s"
    gpus=$(( NGPU > 0 ? NGPU : 1 ))   # without CUDA the one-GPU kernels run under the interpreter
    "$PY" scripts/check_triton_compile.py --list --gpus "$gpus" > /tmp/gpu_check_kernels.txt 2>>"$STEPS_LOG"
    absent=$(grep -v ": ok" /tmp/gpu_check_kernels.txt | sed 's/^/   /')
    [ -n "$absent" ] && say "3. kernels listed but not checked here:" && echo "$absent" | tee -a "$STEPS_LOG"
    # tests/kernels runs whole; KERNELS' tests elsewhere are added
    extra=$("$PY" scripts/check_triton_compile.py --tests --gpus "$gpus" 2>>"$STEPS_LOG" | grep -v '^tests/kernels/' || true)
    if [ "$t" -gt 10 ]; then
        rm -f /tmp/kernels_junit.xml
        # shellcheck disable=SC2086
        PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "$t" "$PY" -m pytest tests/kernels $extra ${GPU_CHECK_TESTS_K:+-k "$GPU_CHECK_TESTS_K"} -q -p no:cacheprovider \
            -o addopts="" -o junit_family=xunit1 -W ignore::pytest.PytestConfigWarning -rfE --junitxml /tmp/kernels_junit.xml 2>&1 | tee "$OUT/kernels_tests.log"
        rc_tests=${PIPESTATUS[0]}; ran kernel_tests "$rc_tests"
        "$PY" - "$OUT" "$rc_tests" /tmp/gpu_check_kernels.txt <<'PY'
import json, sys, xml.etree.ElementTree as ET
out, rc, kernels = sys.argv[1], int(sys.argv[2]), sys.argv[3]
summary = dict(rc=rc)
try:
    summary["kernels"] = dict(line.rstrip("\n").split(": ", 1) for line in open(kernels) if ": " in line)
except OSError:
    pass
try:
    suite = ET.parse("/tmp/kernels_junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")},
                   time_s=float(suite.get("time", 0)))
    cases = []
    for c in suite.iter("testcase"):
        outcome = next((tag for tag in ("failure", "error", "skipped") if c.find(tag) is not None), "passed")
        case = dict(test=f"{c.get('classname')}::{c.get('name')}", outcome=outcome, time_s=float(c.get("time", 0)))
        for p in c.iter("property"):
            v = p.get("value")
            try:
                v = json.loads(v)
            except ValueError:
                pass
            case[p.get("name")] = v
        if outcome in ("failure", "error"):
            first = (c.find(outcome).get("message") or "").splitlines()
            case["message"] = first[0][:300] if first else ""
        cases.append(case)
    summary["failed"] = [c["test"] for c in cases if c["outcome"] in ("failure", "error")]
    # the misses first, then the closest shaves (ratio: worst error over its tolerance, >1 fails)
    cases.sort(key=lambda c: (c["outcome"] not in ("failure", "error"), -float(c.get("ratio", -1) or 0)))
    summary["cases"] = cases
except Exception as exc:  # no junit file: pytest did not get far
    summary["junit_error"] = repr(exc)
json.dump(summary, open(f"{out}/kernels_tests.json", "w"), indent=1)
brief = {k: summary.get(k) for k in ("rc", "tests", "failures", "errors", "skipped", "time_s", "failed", "junit_error")
         if k in summary}
print(json.dumps(brief))
for c in summary.get("cases", [])[:5]:
    if "ratio" in c:
        print(f"   {c['outcome']:8} {c['test']}: max err {c['max_abs_err']:.3g} vs atol {c['atol']:.3g} "
              f"rtol {c['rtol']:.3g} (ratio {c['ratio']:.3g}, {c.get('dtype')})")
PY
    else
        say "3. SKIPPED kernel tests: the budget is spent"; ST[kernel_tests]=time
    fi
fi

# 2b. CUDA graphs against eager for every KV split count a graph can be captured with (on
#     CPU: the eager half under the interpreter, tiny).
if wants rest; then
    if [ "$(left 10)" -gt 20 ]; then
        t=$(left 10); [ "$t" -gt 90 ] && t=90; say "2b. graphs vs eager at 1, 4, 8, 16 KV splits, up to ${t}s"
        if [ "$CUDA" = 1 ]; then
            timeout "$t" "$PY" scripts/check_graph_splits.py --config gpu/configs/qwen3-0.6b --dtype bfloat16 \
                --out "$OUT/graph_splits.json" 2>&1 | tee -a "$STEPS_LOG"
        else
            tiny=$(tiny_config)
            timeout "$t" "$PY" scripts/check_graph_splits.py --config "$tiny" --dtype float32 --batch-sizes 1,3 \
                --max-ctx 70 --out "$OUT/graph_splits.json" 2>&1 | tee -a "$STEPS_LOG"
        fi
        ran graphs_vs_eager "${PIPESTATUS[0]}"
    else
        say "2b. SKIPPED graphs vs eager: the budget is spent"; ST[graphs_vs_eager]=time
    fi
fi

# 4. Kernel micro-benchmarks (on CPU: tiny shapes once, a smoke test of the script).
if wants rest; then
    t=$(left 5); [ "$t" -gt 120 ] && t=120; say "4. kernel micro-benchmarks, up to ${t}s"
    if [ "$t" -gt 10 ]; then
        timeout "$t" "$PY" -m gpu.kernels.triton.bench --out "$OUT/kernels_bench.json" 2>&1 | tee -a "$STEPS_LOG"
        ran kernel_bench "${PIPESTATUS[0]}"
    else
        say "4. SKIPPED kernel micro-benchmarks: the budget is spent"; ST[kernel_bench]=time
    fi
fi

# 5. MXFP4 MoE (issue 27): the packed-expert grouped GEMM against torch's bf16 grouped GEMM at
#    gpt-oss-20b shapes, decode batches 1-32 and prefill (its correctness test ran in step 3:
#    tests/kernels/test_mxfp4_moe.py). Figures into steps.log. On CPU: a tiny smoke run.
if wants rest; then
    t=$(left 0); [ "$t" -gt 120 ] && t=120; say "5. MXFP4 MoE bench, up to ${t}s"
    if [ "$t" -gt 15 ]; then
        if [ "$CUDA" = 1 ]; then moe_args="--tokens 1 2 4 8 16 32 512 2048"; else moe_args="--hidden 64 --experts 8 --tokens 1 5"; fi
        # shellcheck disable=SC2086
        timeout "$t" "$PY" scripts/bench_moe.py --gpu $moe_args 2>&1 | tee -a "$STEPS_LOG"
        rc=${PIPESTATUS[0]}; ran moe_bench "$rc"
        say "5. MXFP4 MoE bench rc=$rc"
    else
        say "5. SKIPPED MXFP4 MoE bench: the budget is spent"; ST[moe_bench]=time
    fi
fi

# 6. Tensor parallelism (issue 25) on the GPUs, NCCL: tests/tp's servers with --device cuda
#    (TP 2 on the tiny gpt-oss; TP 3 on SmolLM2 with three or more GPUs), greedy output
#    against one rank, CUDA graphs with their collectives captured, a killed worker. Needs
#    two GPUs or more: skipped with the reason otherwise (one GPU cannot show TP).
if wants rest; then
    MISSING_TP=$("$PY" -c "import importlib.util as u; print(' '.join(m for m in ('openai', 'transformers', 'httpx') if u.find_spec(m) is None))" 2>/dev/null)
    if [ "$NGPU" -lt 2 ]; then
        ST[tp_tests]="skip:needs 2+ GPUs, torch sees $NGPU"
        say "6. SKIPPED tensor-parallel tests: they need 2 or more GPUs, torch sees $NGPU"
    elif [ -n "$MISSING_TP" ]; then
        ST[tp_tests]="skip:the image lacks $MISSING_TP"
        say "6. SKIPPED tensor-parallel tests: the image lacks $MISSING_TP (carry their wheels in .whl/)"
    else
        t=$(left 0); [ "$t" -gt 240 ] && t=240; say "6. tensor-parallel tests on $NGPU GPUs, up to ${t}s"
        if [ "$t" -gt 60 ]; then
            TAILRACE_TP_DEVICE=cuda TAILRACE_TP_TIMEOUT_S=30 timeout "$t" "$PY" -m pytest tests/tp -q \
                -p no:cacheprovider -o addopts="" -rfEs 2>&1 | tee -a "$STEPS_LOG"
            ran tp_tests "${PIPESTATUS[0]}"
        else
            say "6. SKIPPED tensor-parallel tests: the budget is spent"; ST[tp_tests]=time
        fi
    fi
fi

[ "$PART" = all ] && headline | tee -a "$STEPS_LOG"
summary
for n in "${STEP_NAMES[@]}"; do
    case "${ST[$n]}" in failed*|timed_out) exit 1;; esac
done
exit 0
