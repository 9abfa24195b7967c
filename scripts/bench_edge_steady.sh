#!/bin/sh
# The HTTP edge's CPU per streamed token in a steady window (docs/benchmarks.md, issue 60,
# one writer per step): serve the H200 stand-in with --api-server-count 2 from TREE, run
# scripts/bench_procs.py's `bench serve` load (256 streams), and once 30,000 tokens have
# streamed read the server's CPU (/proc, every process) and vllm:generation_tokens_total
# 12 s apart: the per-token path without each request's own costs.
#     scripts/bench_edge_steady.sh TREE      (PROF=file: py-spy one frontend meanwhile)
TREE=${1:-$PWD}; PY=${PY:-/work/main/.venv/bin/python}
SMOL=$(cd $TREE && PYTHONPATH=$TREE $PY -c "from gpu.loader.decoder import default_model_path as p; print(p())")
OUT=$(mktemp); BENCH=$(mktemp)
cd $TREE
PYTHONPATH=$TREE $PY -m web.cli serve gpu/configs/qwen3-0.6b --tokenizer $SMOL --simulate-gpu h200 \
    --port 0 --max-model-len 2064 --log-level warning --api-server-count 2 > $OUT 2>&1 &
SP=$!
until grep -q listening $OUT; do sleep 1; done
URL=$(grep -o 'http://[^ ]*' $OUT)
until curl -sf $URL/health >/dev/null; do sleep 1; done
PIDS=$(pgrep -P $SP | tr '\n' ' ')
cpu() { t=0; for p in $PIDS; do t=$((t+$(awk '{print $14+$15}' /proc/$p/stat))); done; echo $t; }
fe() { t=0; for p in $PIDS; do grep -q frontend /proc/$p/cmdline && t=$((t+$(awk '{print $14+$15}' /proc/$p/stat))); done; echo $t; }
tok() { curl -s $URL/metrics | awk '/^vllm:generation_tokens_total/{printf "%d\n", $2}'; }
PYTHONPATH=$TREE $PY -m web.cli bench serve --backend openai-completions --base-url $URL \
    --num-prompts 256 --max-concurrency 256 --random-input-len 562 --random-output-len 562 \
    --random-range-ratio 0.822 --ignore-eos --tokenizer $SMOL > $BENCH 2>&1 &
BP=$!
while [ "$(tok)" -lt 30000 ]; do sleep 1; done
c0=$(cpu); f0=$(fe); t0=$(tok)
if [ -n "$PROF" ]; then
    FP=$(for p in $PIDS; do grep -q frontend /proc/$p/cmdline && echo $p; done | head -1)
    py-spy record -p $FP -d 12 -r 250 -f raw -o $PROF --nonblocking >/dev/null 2>&1
else
    sleep 12
fi
c1=$(cpu); f1=$(fe); t1=$(tok)
wait $BP
$PY -c "
c=($c1-$c0)/$(getconf CLK_TCK); f=($f1-$f0)/$(getconf CLK_TCK); t=$t1-$t0
print('$TREE steady: tokens %d server %.1f us/tok frontends %.1f us/tok engine %.1f us/tok' % (t, c*1e6/t, f*1e6/t, (c-f)*1e6/t))"
kill $SP; wait $SP 2>/dev/null; rm -f $OUT $BENCH
