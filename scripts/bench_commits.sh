#!/usr/bin/env bash
# Two commits side by side, in one run, on the workload (32 requests, 128 in / 128 out,
# ignore_eos, fp32, SmolLM2): `tailrace bench throughput` (engine, no HTTP) alternating
# OLD, NEW, OLD, NEW..., then `tailrace bench serve` over HTTP against a server of each.
#
#   scripts/bench_commits.sh OLD_REV NEW_REV [ROUNDS]      (SKIP_THROUGHPUT=1: HTTP only)
#
# Rounds alternate the order (OLD NEW, then NEW OLD) so that neither always runs first.
# Each commit is checked out in a temporary git worktree and run with this checkout's .venv
# (the worktree is the working directory, so its packages come first on sys.path).
set -euo pipefail
old=$1 new=$2 rounds=${3:-2}
root=$(git rev-parse --show-toplevel)
py=$root/.venv/bin/python
tmp=$(mktemp -d)
declare -A dir
for rev in "$old" "$new"; do
  dir[$rev]=$tmp/$(git rev-parse --short "$rev")
  git worktree add -f --detach "${dir[$rev]}" "$rev" >/dev/null 2>&1
done
cleanup() {
  for rev in "$old" "$new"; do git worktree remove --force "${dir[$rev]}" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

order() {  # OLD NEW on odd rounds, NEW OLD on even ones: neither always runs first
  if (( $1 % 2 )); then echo "$old $new"; else echo "$new $old"; fi
}

if [ "${SKIP_THROUGHPUT:-0}" != 1 ]; then
echo "== bench throughput: 32 x 128/128, fp32, ignore_eos, temperature 0.6 =="
for r in $(seq "$rounds"); do
  for rev in $(order "$r"); do
    line=$(cd "${dir[$rev]}" && "$py" -m web.cli bench throughput --dtype float32 \
      --num-prompts 32 --input-len 128 --output-len 128 2>/dev/null | grep Throughput)
    echo "$rev round $r: $line"
  done
done
fi

echo "== bench serve: openai-completions, 32 x 128/128, max concurrency 32, ignore_eos =="
for r in $(seq "$rounds"); do
for rev in $(order "$r"); do
  log=$tmp/serve.log
  (cd "${dir[$rev]}" && exec "$py" -m web.cli serve --port 0 --dtype float32 \
    --max-model-len 1024 >"$log" 2>&1) &
  server=$!
  url=""
  for _ in $(seq 600); do
    url=$(grep -o 'listening on http://[0-9.:]*' "$log" | head -1 | cut -d' ' -f3 || true)
    [ -n "$url" ] && break
    sleep 0.5
  done
  echo "-- $rev round $r ($url)"
  (cd "${dir[$rev]}" && "$py" -m web.cli bench serve --backend openai-completions \
    --base-url "$url" --num-prompts 32 --random-input-len 128 --random-output-len 128 \
    --max-concurrency 32 --ignore-eos --percentile-metrics ttft,tpot,itl,e2el 2>/dev/null) \
    | grep -E "Successful|Benchmark duration|Output token throughput|Mean (TTFT|TPOT|ITL|E2EL)|P99 (TTFT|ITL)"
  kill -INT "$server"; wait "$server" || true
done
done
