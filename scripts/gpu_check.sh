#!/usr/bin/env bash
# Device check for a lent GPU machine (H200: Python 3.12, torch 2.11 CUDA, triton 3.6).
# Runs the kernel tests on CUDA, the kernel micro-benchmarks, then the end-to-end
# throughput benchmark (nano-vllm's workload); JSON results go to $OUT (default ./results).
# Budget: under 8 minutes in all; each step has its own timeout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Carried py3.12 wheels (scripts/fetch_gpu_wheels.sh: trio, cattrs, structlog, orjson, gguf)
# for the pipeline benchmark; the kernels need none. Run with carry [".whl"].
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi

python3 - > "$OUT/env.json" <<'PY'
import json, torch, triton
print(json.dumps(dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                      device=torch.cuda.get_device_name() if torch.cuda.is_available() else None)))
PY
cat "$OUT/env.json"

# 1. Kernel tests on CUDA (addopts cleared: pytest-trio may be absent here).
timeout 300 python3 -m pytest tests/kernels -q -p no:cacheprovider -o addopts="" -rfE \
    --junitxml "$OUT/kernels_junit.xml" 2>&1 | tee "$OUT/kernels_tests.log"
tests_rc=${PIPESTATUS[0]}
python3 - "$OUT" "$tests_rc" <<'PY'
import json, sys, xml.etree.ElementTree as ET
out, rc = sys.argv[1], int(sys.argv[2])
summary = dict(rc=rc)
try:
    suite = ET.parse(f"{out}/kernels_junit.xml").getroot()
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

# 2. Kernel micro-benchmarks at model-sized shapes.
timeout 120 python3 -m gpu.kernels.bench --out "$OUT/kernels_bench.json" 2>&1 | tee "$OUT/kernels_bench.log"
bench_rc=${PIPESTATUS[0]}

# 3. End to end: nano-vllm's published workload (Qwen3-0.6B architecture, dummy weights,
#    256 sequences, input and output lengths uniform in [100, 1024], seed 0, ignore_eos)
#    through the whole engine. Needs the carried wheels (scripts/fetch_gpu_wheels.sh).
timeout 240 python3 -m pipeline.bench gpu/configs/qwen3-0.6b --load-format dummy --workload nano-vllm \
    --dtype bfloat16 --max-model-len 4096 --output-json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log"
e2e_rc=${PIPESTATUS[0]}

echo "kernel tests rc=$tests_rc, kernel bench rc=$bench_rc, throughput rc=$e2e_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$e2e_rc" -eq 0 ]
