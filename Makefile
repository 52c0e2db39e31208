# Two entry points: `make demo` and `make test`. Both create .venv on first use.
# torch is installed pinned first: an open range with no torch installed would download CUDA wheels.
# `make demo` installs what the demo runs: torch, autotune and its plot extra (STAMP); `make test`
# adds the rest (TEST_STAMP: the service, the three frameworks, the dev tools) to what is there.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test chromium lint typecheck bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# pip byte-compiles what it installs one file at a time (53 s of a fresh clone's setup here, most of
# it torch's and transformers' 14,000 modules); compileall does the same on every core (29 s on two),
# after the test's install, so that the suite's hundreds of interpreters read compiled modules. Its
# errors are modules for a newer Python (torch's py312 test helpers), which pip skips as well. The
# demo compiles nothing ahead: its few processes compile the modules they import as they import them
# (a part of torch's), and keep them, also where the environment says not to (PYTHONDONTWRITEBYTECODE,
# as CI images set: each process would compile torch's imports again).
COMPILE := $(PY) -m compileall -qq -j 0 $(VENV)/lib || true
CONSTRAINT := $(VENV)/torch-constraint.txt

# What the demo needs: torch (the one there, else pinned), autotune, its plot extra.
$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)" --no-compile
	# What comes next must never replace the torch found above: pin it.
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(CONSTRAINT)
	$(PY) -m pip install -q -e ".[plot]" -c $(CONSTRAINT) --no-compile
	touch $(STAMP)

# The rest, for the tests: the service, the frameworks (lightning, transformers, accelerate) and the dev
# tools, beside what the demo installed (pip keeps what satisfies them, torch pinned as above).
# Never torchvision: the only wheel reachable is a CUDA build that breaks `import transformers`.
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[server,plot,dev,lightning,transformers,accelerate]" -c $(CONSTRAINT) --no-compile
	$(COMPILE)
	touch $(TEST_STAMP)

# The result is saved for the Python lines the summary ends with (autotune.load_result).
demo: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/autotune probe gpt --effective-batch 256 --save demo-result.json
	@echo "autotune is installed in .venv: run .venv/bin/autotune (e.g. .venv/bin/autotune probe --help), or 'source .venv/bin/activate' first"

# Three pytest workers on two cores, each test file on one worker (its module fixtures made once), in
# the order tests/conftest.py gives (the longest files first; xdist would order them by test count).
# A third worker runs while one of the others waits (on a server starting, a client's retries, a
# killed process): quiet, on the 2-core VM, three workers took 432, 449 and 439 s where two took
# 484, 443 and 453 s, each pair run one after the other (2026-11-27).
# One torch thread per process: with several workers and their probes' children, torch's default of
# a thread per core oversubscribes the cores and its spinning threads slow every process down.
# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE, as some CI
# images set): the suite starts hundreds of interpreters and probe children, and without a cache each
# compiled every module of autotune, api and tests it imported, and pytest rewrote every test module
# in each worker (the CLI and progress tests took 12% more CPU; the whole suite, run side by side, 1%).
TEST_WORKERS ?= 3

test: $(TEST_STAMP) chromium
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# tests/test_status_page.py opens the service's status page in the system's Chromium (Playwright
# drives it; it downloads no browser). As root with apt-get, a missing one is installed; the index is
# refreshed only when the install fails without it.
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium (apt-get) for tests/test_status_page.py"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
		|| { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }; \
	fi

bench: $(TEST_STAMP)
	$(PY) bench/search.py
	$(PY) bench/serve.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
