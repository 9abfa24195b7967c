#!/usr/bin/env bash
# Download, here, the Python 3.12 wheels that the lent GPU machine's image lacks, into .whl/
# (ignored by git; `carry` it). The image has torch, triton, attrs, numpy, tokenizers,
# jinja2, safetensors, tqdm, sortedcontainers, idna: the engine needs these on top.
# The versions this project is tested with (the dev venv). cattrs needs attrs>=25.4 and
# typing-extensions>=4.14, newer than the image may hold: they travel too (pure Python),
# and scripts/gpu_check.sh checks every carried wheel's requirements before anything runs.
# Structured output (--json-schema, response_format) travels too: xgrammar, apache-tvm-ffi
# and pydantic's stack (about 7.5 MiB, compiled for cp312 x86-64).
# Not carried: openai-harmony and bpe-openai (gpt-oss's Harmony format and o200k vocabulary:
# bpe-openai's wheel alone is 41 MiB of the 64 MiB a call may carry, and gpt-oss is no
# device-check model); stages/api/harmony.py imports them only for a Harmony model, so every
# other model runs without them. scripts/device_image/sitecustomize.py blocks, on a CPU
# dry run, every package that the image lacks and this list does not carry.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)   # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d .whl \
    trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 cattrs==26.2.1 structlog==26.1.0 \
    orjson==3.13.0 gguf==0.19.0 attrs==26.1.0 typing-extensions==4.16.0 \
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5
ls -la .whl
